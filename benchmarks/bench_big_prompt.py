"""Benchmark the gateway's event loop while it reads huge prompts of known sessions (issue 16, item 5).

The app runs in-process under uvicorn (in a thread with its own event loop) in front of a fake upstream
(`httpx.MockTransport`, answers at once); from another thread a client polls `GET /health` every 2 ms
while it posts, each to a session the gateway already knows:

1. one user message of `--message-mb` MB (23 by default, the size issue 16 measured) as a session's
   second call;
2. the same message as the task of a session without a session id (identified by a hash of its first
   messages), as its second call;
3. a `--conversation-tokens` conversation (300k by default: agent turns with tool output) as a
   session's second call, then the same conversation grown by one turn per call, `--calls` times
   (what an agent sends: the gateway counts only the new turn).

It prints, for each, the worst and median `/health` latency seen while the calls ran (and with nothing
else going on) and each call's own time. A `/health` answer waits as long as the event loop is busy,
so its worst latency is the longest stall a client of any other session would see.

    .venv/bin/python benchmarks/bench_big_prompt.py [--message-mb 23] [--conversation-tokens 300000]

To compare with another checkout, run this file with `PYTHONPATH` set to that checkout's root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from basin_runtime.clock import ManualClock
from basin_runtime.gateway.app import create_app
from basin_runtime.gateway.build import assemble
from basin_runtime.gateway.gateway import GatewaySettings
from basin_runtime.gateway.measure import Meter
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.predictors import Predictors
from basin_runtime.gateway.proxy import Upstream
from basin_runtime.gateway.telemetry import Telemetry
from basin_runtime.policy import Policy, PolicyConfig
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.runtime.httpx_upstream import HttpxUpstreamClient

ANSWER = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
          "content": "ok"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
WORDS = [
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by", "this", "be",
    "are", "from", "or", "have", "an", "not", "which", "but", "all", "file", "line", "error", "test", "run", "def",
    "return", "import", "class", "self", "value", "none", "true", "false", "path", "data", "result", "config",
    "function", "module", "output", "input", "string", "list", "dict", "key", "index", "count", "number", "name",
    "type", "check", "build", "make", "print", "open", "read", "write", "close", "start", "stop", "next", "first",
    "last", "new", "old", "set", "get", "add", "remove", "update",
]


class FixedPeak:
    """A predictor that always says the same peak (the benchmark is about the event loop, not the model)."""

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        return 50_000.0


def text_of(num_chars: int, seed: int) -> str:
    """Agent-like English and code words, about 4 characters per token."""
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(WORDS) + ("\n" if rng.random() < 0.08 else " ")
        words.append(word)
        size += len(word)
    return "".join(words)[:num_chars]


def conversation(num_tokens: int) -> list[dict[str, str]]:
    """A system prompt, a task, then assistant commands and tool outputs until about `num_tokens` tokens."""
    tokenizer = get_tokenizer()
    messages = [{"role": "system", "content": text_of(8_000, 0)},
                {"role": "user", "content": "Task: " + text_of(2_000, 1)}]
    tokens = tokenizer.count_prompt(messages)
    turn = 0
    while tokens < num_tokens:
        turn += 1
        pair = [{"role": "assistant", "content": text_of(300, 10 * turn)},
                {"role": "tool", "content": text_of(8_000, 10 * turn + 1)}]
        messages += pair
        tokens += sum(tokenizer.count_message(m) for m in pair)
    return messages


def encoded(messages: list[dict[str, str]]) -> bytes:
    """A chat body, encoded ahead of time so the client's own JSON work is not measured."""
    return json.dumps({"model": "m", "messages": messages}).encode()


def build_app() -> Any:
    async def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=ANSWER)

    clock, tokenizer = ManualClock(), get_tokenizer()
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstream), base_url="http://upstream")
    gateway = assemble(GatewaySettings(), clock, Meter(tokenizer, TaskTextRule()), Predictors(FixedPeak()),
                       Upstream(HttpxUpstreamClient(client)),
                       Telemetry(clock, GatewayMetrics(), tokenizer_name=tokenizer.name), retry_after_s=30,
                       policy=Policy(PolicyConfig(budget_tokens=10**9)))
    return create_app(gateway)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int) -> tuple[uvicorn.Server, threading.Thread]:
    config = uvicorn.Config(build_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread


async def health_latencies_during(client: httpx.AsyncClient, work: Callable[[], Awaitable[None]]) -> list[float]:
    """`/health` latencies (s) measured every 2 ms while `work` runs."""
    latencies: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            started = time.perf_counter()
            response = await client.get("/health")
            latencies.append(time.perf_counter() - started)
            assert response.status_code == 200
            await asyncio.sleep(0.002)

    poller = asyncio.create_task(poll())
    try:
        await work()
    finally:
        done.set()
        await poller
    return latencies


def report(name: str, latencies: list[float], call_s: list[float]) -> None:
    ms = sorted(1000 * s for s in latencies)
    calls = ", ".join(f"{s * 1000:.0f}" for s in call_s) or "-"
    print(f"{name:<36} /health worst {ms[-1]:7.1f} ms  p90 {ms[int(0.9 * (len(ms) - 1))]:5.1f} ms  median "
          f"{statistics.median(ms):4.1f} ms ({len(ms)} polls)  calls: {calls} ms")


async def run(args: argparse.Namespace, base_url: str) -> None:
    message = text_of(int(args.message_mb * 1_000_000), 7)
    history = conversation(args.conversation_tokens)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as poller, \
            httpx.AsyncClient(base_url=base_url, timeout=timeout) as caller:
        call_s: list[float] = []

        async def post(session: str | None, body: bytes) -> None:
            started = time.perf_counter()
            headers = {"Content-Type": "application/json"} | ({} if session is None else {"X-Session-ID": session})
            response = await caller.post("/v1/chat/completions", content=body, headers=headers)
            assert response.status_code == 200, response.text[:300]
            call_s.append(time.perf_counter() - started)

        report("idle", await health_latencies_during(poller, lambda: asyncio.sleep(1.0)), [])

        first = [{"role": "user", "content": "Task: summarise the attached log"}]
        await post("big-message", encoded(first))
        call_s.clear()
        grown = encoded([*first, {"role": "assistant", "content": "send it"}, {"role": "user", "content": message}])
        latencies = await health_latencies_during(poller, lambda: post("big-message", grown))
        report(f"{args.message_mb:g} MB message (2nd call)", latencies, call_s)

        task = [{"role": "user", "content": message}]  # identified by the hash of this first message
        await post(None, encoded(task))
        call_s.clear()
        grown = encoded([*task, {"role": "assistant", "content": "read it"}, {"role": "user", "content": "go on"}])
        latencies = await health_latencies_during(poller, lambda: post(None, grown))
        report(f"{args.message_mb:g} MB task, no session id (2nd)", latencies, call_s)

        await post("long-conversation", encoded(history[:2]))
        call_s.clear()
        start = len(history) - 2 * args.calls
        bodies = [encoded(history[:start + 2 * k]) for k in range(args.calls + 1)]  # encoded before timing
        latencies = await health_latencies_during(poller, lambda: post("long-conversation", bodies[0]))
        report(f"{args.conversation_tokens // 1000}k-token conversation (2nd call)", latencies, call_s)
        call_s.clear()

        async def grow() -> None:
            for body in bodies[1:]:
                await post("long-conversation", body)

        latencies = await health_latencies_during(poller, grow)
        report(f"  then +1 turn per call, x{args.calls}", latencies, call_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--message-mb", type=float, default=23.0, help="size of the big message (default 23)")
    parser.add_argument("--conversation-tokens", type=int, default=300_000, help="long conversation size")
    parser.add_argument("--calls", type=int, default=5, help="calls of the long conversation, one turn apart")
    args = parser.parse_args(argv)
    port = free_port()
    server, thread = start_server(port)
    try:
        asyncio.run(run(args, f"http://127.0.0.1:{port}"))
    finally:
        server.should_exit = True
        thread.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

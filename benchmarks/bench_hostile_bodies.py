"""The gateway against hostile request bodies (issue 36, items 4 and 5): event-loop stalls and memory.

A real gateway process (`python -m basin_runtime.gateway`, the CLI, default options but the budget) runs
in front of a fake upstream process (a raw asyncio server that reads each request whole and answers a
small JSON chat completion). This process sends one hostile body at a time while a poller process of its
own (so the sender's work cannot delay it) polls the gateway's `GET /health` every 2 ms, and it reads the
gateway's memory from /proc:

1. `tools`: a 39 MB chat body holding 500,000 tool schemas (the issue's first stall: 38 MB);
2. `messages`: 600,000 tiny messages (the issue's second stall);
3. `big-message`: one 60 MB body, a single user message (the issue's memory case);
4. `big-conversation`: one 60 MB body, an agent conversation of 8 KB tool outputs;
5. `concurrent`: `--concurrent` (default 8) such 60 MB conversations sent at once, each to its own session.

Each case runs in a gateway process of its own (after one small call to warm it up: `idle`). For each it prints
the answer's status and error type, the worst and median `/health` latency while the
body was sent and served (a `/health` answer waits as long as the gateway's event loop is busy, so its worst
latency is the longest stall any other client saw), the call's own time, and the gateway's resident memory
before and at its peak (VmHWM, reset through /proc/PID/clear_refs before each case).

    .venv/bin/python benchmarks/bench_hostile_bodies.py [--cases tools,messages,...] [--gateway-arg=--max-tools=0]

Run it with `PYTHONPATH` set to another checkout's root to measure that checkout's gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "peak_predictor.onnx"
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {
    "role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
CASES = ("tools", "messages", "big-message", "big-conversation", "concurrent")


# --- the fake upstream (run as `--serve-upstream PORT`) ------------------------------------------


class _Upstream(asyncio.Protocol):
    """Reads one request at a time whole (by Content-Length) and answers ANSWER."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n", 0, 1 << 16)  # a head is small: never search a body
            if end < 0:
                return
            head = bytes(self.buffer[:end]).decode("latin-1").lower()
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.startswith("content-length:")), 0)
            if len(self.buffer) < end + 4 + length:
                return
            del self.buffer[:end + 4 + length]
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)


async def _serve_upstream(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Upstream, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# --- bodies --------------------------------------------------------------------------------------


def tools_body(num_tools: int = 500_000) -> bytes:
    """A chat body with `num_tools` small tool schemas (~78 bytes each: 39 MB for 500,000)."""
    tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "tools": [tool] * num_tools}).encode()


def messages_body(num_messages: int = 600_000) -> bytes:
    """A chat body with `num_messages` tiny messages."""
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * num_messages}).encode()


def big_message_body(num_bytes: int = 60_000_000) -> bytes:
    """One user message making a body of about `num_bytes` (English-like words)."""
    words = "the file line error test run def return import class self value "
    text = (words * (num_bytes // len(words) + 1))[:num_bytes - 100]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


def big_conversation_body(num_bytes: int = 60_000_000, seed: int = 0) -> bytes:
    """An agent conversation of 8 KB tool outputs making a body of about `num_bytes`."""
    words = "the file line error test run def return import class self value path data result "
    output = (words * 200)[:8000]
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"Task {seed}"}]
    size = 200
    turn = 0
    while size < num_bytes:
        turn += 1
        pair = [{"role": "assistant", "content": f"run step {turn}"}, {"role": "tool", "content": output}]
        messages += pair
        size += 8100
    return json.dumps({"model": "m", "messages": messages}).encode()


# --- the gateway process and its memory ---------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of `pid`, in MB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0]) / 1024
    return values


def reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux: `5` to /proc/PID/clear_refs)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the process for {url} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} was not ready within {timeout_s:g} s")


# --- the measurement -----------------------------------------------------------------------------


def poll_health(base_url: str) -> None:
    """`/health` polled every 2 ms on one connection until stdin closes; then each latency (s), one a line (a process
    of its own: the sender's work must not delay the poller)."""
    latencies: list[float] = []
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with httpx.Client(base_url=base_url, timeout=120) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.002)
    sys.stdout.write("".join(f"{s}\n" for s in latencies))


async def health_latencies_during(base_url: str, work: asyncio.Task[list[httpx.Response]]) -> list[float]:
    """`/health` latencies (s) seen by a poller process until `work` is done."""
    poller = subprocess.Popen([sys.executable, __file__, "--poll-health", base_url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    await asyncio.wait({work})
    output, _ = poller.communicate("", timeout=120)
    return [float(line) for line in output.split()]


async def send_all(base_url: str, bodies: list[bytes]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        return list(await asyncio.gather(*(client.post(
            "/v1/chat/completions", content=body,
            headers={"content-type": "application/json", "x-session-id": f"bench-{k}-{time.monotonic_ns()}"})
            for k, body in enumerate(bodies))))


def describe(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except ValueError:
        return f"{response.status_code} (not JSON)"
    return f"{response.status_code}" + ("" if not isinstance(error, dict) else f" {error.get('type')}")


async def measure(name: str, bodies: list[bytes], base_url: str, pid: int) -> None:
    reset_peak(pid)
    before = memory_mb(pid)["VmRSS"]
    started = time.perf_counter()
    work = asyncio.create_task(send_all(base_url, bodies))
    latencies = await health_latencies_during(base_url, work)
    call_s = time.perf_counter() - started
    responses = work.result()
    peak = memory_mb(pid)["VmHWM"]
    ms = sorted(1000 * s for s in latencies) or [0.0]
    answers = ", ".join(sorted({describe(r) for r in responses}))
    size = sum(len(b) for b in bodies) / 1e6
    print(f"{name:<17} {size:7.1f} MB  answer {answers:<34} /health worst {ms[-1]:7.1f} ms median "
          f"{statistics.median(ms):5.1f} ms ({len(ms)} polls)  call {call_s:6.2f} s  RSS {before:6.0f} -> peak "
          f"{peak:6.0f} MB (+{peak - before:.0f})", flush=True)


def bodies_for(case: str, concurrent: int) -> list[bytes]:
    if case == "tools":
        return [tools_body()]
    if case == "messages":
        return [messages_body()]
    if case == "big-message":
        return [big_message_body()]
    if case == "big-conversation":
        return [big_conversation_body()]
    return [big_conversation_body(seed=k) for k in range(concurrent)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--concurrent", type=int, default=8, help="bodies sent at once in `concurrent`")
    parser.add_argument("--gateway-arg", action="append", default=[], help="an extra gateway option (repeat)")
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--poll-health", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_upstream is not None:
        asyncio.run(_serve_upstream(args.serve_upstream))
        return 0
    if args.poll_health is not None:
        poll_health(args.poll_health)
        return 0
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}")
    upstream_port = free_port()
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(upstream_port)], env=env)
    try:
        for case in cases:  # each in a gateway of its own: memory a process took is not given back to the system
            bodies = bodies_for(case, args.concurrent)
            with tempfile.TemporaryDirectory() as tmp:
                gateway_port = free_port()
                gateway = subprocess.Popen(
                    [sys.executable, "-m", "basin_runtime.gateway", "--upstream", f"http://127.0.0.1:{upstream_port}",
                     "--port", str(gateway_port), "--model", str(MODEL), "--budget-tokens", str(10**9),
                     "--log-level", "warning", "--session-log", f"{tmp}/sessions.jsonl", *args.gateway_arg],
                    env=env, cwd=tmp)
                try:
                    base_url = f"http://127.0.0.1:{gateway_port}"
                    wait_ready(base_url + "/health", gateway)
                    asyncio.run(measure("idle", [b'{"messages": [{"role": "user", "content": "warm up"}]}'],
                                        base_url, gateway.pid))
                    asyncio.run(measure(case, bodies, base_url, gateway.pid))
                finally:
                    gateway.terminate()
                    gateway.wait(30)
            del bodies
    finally:
        upstream.terminate()
        upstream.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

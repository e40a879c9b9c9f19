"""The gateway under issue 46's attacks: slow clients, header-less connections, the two-step and the ride.

A real gateway process (`python -m basin_runtime.gateway`, the CLI, default options but those named) runs in
front of the fake upstream of `bench_hostile_bodies.py` (a raw asyncio server answering a small JSON chat
completion). Three measurements, each against a gateway of its own:

1. `slow-bodies`: 4 connections each declare a 64 MiB body (the default `--max-body-bytes`; together the default
   `--max-body-bytes-in-flight`) and send one byte every 2 s; meanwhile a normal 2 MiB chat body is sent. Prints
   its status and time.
2. `header-less`: `--connections` (300) connections open and send nothing. Prints how many the gateway closed,
   and when (the last one's time), within `--wait-s` (60 s).
3. `attacks`: with `--always-engaged` and a 216,000-token budget (the issue's), one owner session, then 6
   attackers admitted on a tiny first call whose second call carries a ~150,000-token made-up history (the
   two-step), and 2 rides: ~125,000-token unrelated prompts under the owner's id (chat and `/v1/completions`).
   `/basin/state` is sampled every 20 ms while they run; then every session is ended, head first, so the held
   calls go in. Prints the largest reserved total seen with more than one session live (never past the budget,
   the rule), the largest with one live (the lone head's reservation), and what is still reserved at the end
   (leaked reservations).

    .venv/bin/python benchmarks/bench_slow_clients.py [--cases slow-bodies,header-less,attacks]
        [--connections 300] [--wait-s 60]

Run it with `PYTHONPATH` set to another checkout's root to measure that checkout's gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "peak_predictor.onnx"
UPSTREAM = ROOT / "benchmarks" / "bench_hostile_bodies.py"
CASES = ("slow-bodies", "header-less", "attacks")
BUDGET_TOKENS = 216_000
WORDS = "the file line error test run def return import class self value path data result "


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gateway(upstream_port: int, *args: str) -> Iterator[str]:
    """A gateway process (the CLI) in front of the upstream; its base URL."""
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "basin_runtime.gateway", "--upstream",
                                 f"http://127.0.0.1:{upstream_port}", "--port", str(port), "--model", str(MODEL),
                                 "--log-level", "warning", *args], env=env, cwd=tmp)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not start")
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


def text_of(num_tokens: int) -> str:
    """About `num_tokens` tokens of English-like words (one word a token, roughly)."""
    words = WORDS.split()
    return " ".join(words[k % len(words)] for k in range(num_tokens))


async def slow_bodies(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nX-Session-ID: slow%d"
            b"\r\nContent-Length: " + str(64 << 20).encode() + b"\r\n\r\n")
    writers = []
    for k in range(4):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head % k + b"{")
        writers.append(writer)

    async def trickle() -> None:
        while True:
            await asyncio.sleep(2)
            for writer in writers:
                writer.write(b" ")

    task = asyncio.create_task(trickle())
    await asyncio.sleep(0.5)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(url + "/v1/chat/completions", content=body,
                                   headers={"content-type": "application/json", "x-session-id": "normal"})
    took = time.monotonic() - started
    kind = answer.json().get("error", {}).get("type", "") if answer.status_code != 200 else ""
    print(f"slow-bodies: 4 connections declaring 64 MiB each, trickling; a normal {len(body) / (1 << 20):.1f} MiB "
          f"body: {answer.status_code} {kind} in {took:.2f} s")
    task.cancel()
    for writer in writers:
        writer.close()


async def header_less(url: str, connections: int, wait_s: float) -> None:
    port = int(url.rsplit(":", 1)[1])
    started = time.monotonic()
    closed_at: list[float] = []

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await asyncio.wait_for(reader.read(), wait_s - (time.monotonic() - started))
            closed_at.append(time.monotonic() - started)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    last = f", the last after {max(closed_at):.1f} s" if closed_at else ""
    print(f"header-less: {connections} connections sending nothing: {len(closed_at)} closed by the gateway within "
          f"{wait_s:g} s{last}")


async def attacks(url: str) -> None:
    samples: list[tuple[int, int, int]] = []  # (num live, reserved, budget)
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        async def sample() -> None:
            while not done.is_set():
                state = (await client.get(url + "/basin/state")).json()["policy"]
                samples.append((len(state["live"]), state["reserved_tokens"], state["budget_tokens"]))
                await asyncio.sleep(0.02)

        async def chat(session: str, messages: list[dict[str, str]]) -> int:
            answer = await client.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages},
                                       headers={"x-session-id": session})
            return answer.status_code

        async def completion(session: str, prompt: str) -> int:
            answer = await client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt},
                                       headers={"x-session-id": session})
            return answer.status_code

        sampler = asyncio.create_task(sample())
        owner = [{"role": "user", "content": "fix the failing test in the parser"}]
        assert await chat("owner", owner) == 200
        for k in range(6):
            assert await chat(f"attacker{k}", [{"role": "user", "content": f"say hi {k}"}]) == 200
        made_up = text_of(150_000)
        calls = [asyncio.create_task(chat(f"attacker{k}", [
            {"role": "user", "content": f"say hi {k}"}, {"role": "assistant", "content": made_up[:len(made_up) // 2]},
            {"role": "user", "content": made_up[len(made_up) // 2:]}])) for k in range(6)]
        ride = text_of(125_000)
        calls.append(asyncio.create_task(chat("owner", [{"role": "user", "content": ride}])))
        calls.append(asyncio.create_task(completion("owner", ride)))
        await asyncio.sleep(5)  # the attacks are in: held, or running
        while not all(c.done() for c in calls) or (await client.get(url + "/basin/sessions")).json()["sessions"]:
            sessions = (await client.get(url + "/basin/sessions")).json()["sessions"]
            live = [s["session_id"] for s in sessions if s["state"] == "live"]
            if live:
                await client.post(url + f"/basin/sessions/{live[0]}/end")
            await asyncio.sleep(0.2)
        statuses = [c.result() for c in calls]
        done.set()
        await sampler
        end = (await client.get(url + "/basin/state")).json()["policy"]
    several = [(r, b) for n, r, b in samples if n > 1]
    alone = [r for n, r, _ in samples if n == 1]
    over = max((r - b for r, b in several), default=0)
    print(f"attacks (budget {BUDGET_TOKENS}, always engaged; 6 two-step attackers, 2 rides): {len(samples)} samples; "
          f"answers {sorted(statuses)}")
    print(f"  with more than one session live: largest reserved total {max((r for r, _ in several), default=0)}, "
          f"largest excess over the budget {over}")
    print(f"  with one session live (the lone head): largest reserved total {max(alone, default=0)}")
    print(f"  at the end: reserved {end['reserved_tokens']}, working set {end['working_set_tokens']}, "
          f"live {end['live']}, queued {end['queued']} (leaked reservations: {end['reserved_tokens']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--wait-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}")
    upstream_port = free_port()
    upstream = subprocess.Popen([sys.executable, str(UPSTREAM), "--serve-upstream", str(upstream_port)])
    try:
        for case in cases:
            if case == "attacks":
                with gateway(upstream_port, "--always-engaged", "--budget-tokens", str(BUDGET_TOKENS)) as url:
                    asyncio.run(attacks(url))
            else:
                with gateway(upstream_port, "--budget-tokens", str(10**9)) as url:
                    if case == "slow-bodies":
                        asyncio.run(slow_bodies(url))
                    else:
                        asyncio.run(header_less(url, args.connections, args.wait_s))
    finally:
        upstream.terminate()
        upstream.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark the gateway against a stand-in upstream on loopback: added latency, throughput, memory.

One run measures, against the same stand-in upstream (a minimal raw-ASGI app served by uvicorn in
a subprocess) and the real gateway (`python -m basin_runtime.gateway` in a subprocess):

1. Unloaded added latency: calls one at a time, directly and through the gateway, interleaved;
   added = via-gateway latency minus direct latency (p50, p99 of the per-pair differences).
2. At 200 concurrent sessions (each making `--calls` growing chat calls, then ending itself with the
   end key its first answer carried; the gateway runs with an admin token that only the benchmark's
   state read uses): p50/p99 latency direct and via the gateway, the difference, the gateway's own
   `basin_gateway_added_latency_seconds` (time before forwarding) and throughput via / direct.
3. Memory: the gateway's RSS (from /proc) while 10,000 sessions pass through it (200 at a time).

    .venv/bin/python benchmarks/bench_gateway.py [--sessions 10000] [--concurrency 200] [--calls 5]
        [--upstream-client aiohttp|httpx]

Loopback only; every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from basin_runtime.session_keys import SESSION_KEY_HEADER

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
ANSWER = json.dumps({
    "id": "c", "object": "chat.completion", "model": "standin",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 80}},
}).encode()


# --- the stand-in upstream (runs in its own process) ---------------------------------------------


async def upstream_app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Answers every POST with a fixed chat completion and every GET with `{}`."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body = ANSWER if scope["method"] == "POST" else b"{}"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-smg-routed-worker-id", b"http://decode-1")]})
    await send({"type": "http.response.body", "body": body})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


# --- processes -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def process(args: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- a light HTTP/1.1 client (httpx's pool costs more CPU than the gateway at 200 connections) ------


class Connection:
    """One keep-alive HTTP/1.1 connection: POST JSON, read a Content-Length or chunked answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """(status, headers by lower-case name, body)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n{head}\r\n".encode() + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        answer_headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            answer_headers[name.lower()] = value.strip()
        length = answer_headers.get("content-length")
        if "chunked" not in answer_headers.get("transfer-encoding", "").lower():
            return status, answer_headers, await self.reader.readexactly(int(length or 0))
        data = b""
        while (size := int((await self.reader.readline()).split(b";")[0], 16)) > 0:
            data += await self.reader.readexactly(size)
            await self.reader.readline()
        await self.reader.readline()
        return status, answer_headers, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --- load ----------------------------------------------------------------------------------------


def messages(session: int, turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": f"Task {session}: fix the failing test in module_{session % 97}.py"}]
    for k in range(turns):
        out.append({"role": "assistant", "content": f"I will run the tests (step {k})."})
        out.append({"role": "user", "content": f"Tool output {k}: " + "x = 1\n" * 20})
    return out


async def run_sessions(base: str, first: int, count: int, calls: int, concurrency: int,
                       is_gateway: bool, latencies: list[float]) -> float:
    """Run `count` sessions on `concurrency` connections; return the wall time; per-call latencies appended."""
    host, port = base.removeprefix("http://").split(":")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(first, first + count):
        queue.put_nowait(k)

    async def worker() -> None:
        conn = Connection(host, int(port))
        try:
            while not queue.empty():
                k = queue.get_nowait()
                sid, key = f"bench-{k}", None
                for turn in range(calls):
                    body = json.dumps({"model": "standin", "messages": messages(k, turn), "max_tokens": 1}).encode()
                    started = time.perf_counter()
                    status, headers, answer = await conn.post("/v1/chat/completions", body, {"x-session-id": sid})
                    latencies.append(time.perf_counter() - started)
                    if status != 200:
                        raise RuntimeError(f"call failed: {status} {answer[:200]!r}")
                    key = key or headers.get(SESSION_KEY_HEADER.lower())
                if is_gateway:  # as an agent: its own end key, no admin token
                    status, _, answer = await conn.post(f"/basin/sessions/{sid}/end", b"",
                                                        {SESSION_KEY_HEADER: key} if key else {})
                    if status != 200:
                        raise RuntimeError(f"ending {sid} failed: {status} {answer[:200]!r}")
        finally:
            conn.close()

    started = time.perf_counter()
    async with asyncio.timeout(600):
        await asyncio.gather(*(worker() for _ in range(min(concurrency, count))))
    return time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def gateway_added_quantiles(client: httpx.AsyncClient, gateway: str) -> tuple[float, float, int]:
    """p50, p99 (upper bucket bounds) and count of `basin_gateway_added_latency_seconds`."""
    text = (await client.get(gateway + "/metrics")).text
    buckets = []
    for line in text.splitlines():
        if line.startswith("basin_gateway_added_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1]
    p50 = next(le for le, n in buckets if n >= 0.5 * total)
    p99 = next(le for le, n in buckets if n >= 0.99 * total)
    return p50, p99, int(total)


@contextlib.asynccontextmanager
async def servers(log_dir: str, upstream_client: str, admin_token: str) -> AsyncIterator[tuple[str, str, int]]:
    up_port, gw_port = free_port(), free_port()
    upstream, gateway = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    config = Path(log_dir) / "gateway.yaml"  # the token in a 0600 file, not on the command line
    config.write_text(json.dumps({"admin_token": admin_token}), encoding="utf-8")
    config.chmod(0o600)
    with process([sys.executable, __file__, "--serve-upstream", str(up_port)]) as up_proc:
        await wait_healthy(upstream, up_proc)
        with process([sys.executable, "-m", "basin_runtime.gateway", "--upstream", upstream, "--port", str(gw_port),
                      "--model", str(MODEL_FILE), "--budget-tokens", str(10**12), "--log-level", "warning",
                      "--upstream-client", upstream_client, "--config", str(config),
                      "--session-log", str(Path(log_dir) / "sessions.jsonl")]) as gw_proc:
            await wait_healthy(gateway, gw_proc)
            yield upstream, gateway, gw_proc.pid


async def bench(args: argparse.Namespace) -> None:
    admin_token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as log_dir:
        async with servers(log_dir, args.upstream_client, admin_token) as (upstream, gateway, gw_pid), \
                httpx.AsyncClient(trust_env=False, timeout=60) as client:
            # warm-up (tokenizer, model, connections)
            await run_sessions(gateway, 10**6, 50, 2, 50, True, [])
            await run_sessions(upstream, 10**6, 50, 2, 50, False, [])

            direct_1, via_1 = [], []
            for k in range(args.unloaded_calls):
                await run_sessions(upstream, 2 * 10**6 + k, 1, 1, 1, False, direct_1)
                await run_sessions(gateway, 2 * 10**6 + k, 1, 1, 1, True, via_1)
            added_1 = [v - d for v, d in zip(via_1, direct_1, strict=True)]

            n = args.concurrency * 2
            direct, via = [], []
            direct_s = await run_sessions(upstream, 0, n, args.calls, args.concurrency, False, direct)
            via_s = await run_sessions(gateway, 0, n, args.calls, args.concurrency, True, via)
            own_p50, own_p99, own_n = await gateway_added_quantiles(client, gateway)

            rss = [(0, rss_mib(gw_pid))]
            done, batch = 0, 1000
            while done < args.sessions:
                await run_sessions(gateway, 10**7 + done, batch, 2, args.concurrency, True, [])
                done += batch
                rss.append((done, rss_mib(gw_pid)))
            admin = {"Authorization": f"Bearer {admin_token}"}
            state = (await client.get(gateway + "/basin/state", headers=admin)).json()["policy"]

    ms = 1000.0
    print(f"machine: {os.cpu_count()} cpus; upstream: raw ASGI on uvicorn; gateway: basin_runtime.gateway "
          f"({args.upstream_client} upstream client), session log on")
    print(f"unloaded ({args.unloaded_calls} calls, one at a time): added p50 {pct(added_1, .5) * ms:.2f} ms, "
          f"p99 {pct(added_1, .99) * ms:.2f} ms (direct p50 {pct(direct_1, .5) * ms:.2f} ms)")
    print(f"{args.concurrency} concurrent sessions x {args.calls} calls ({len(via)} calls):")
    print(f"  direct  p50 {pct(direct, .5) * ms:7.2f} ms  p99 {pct(direct, .99) * ms:7.2f} ms  "
          f"{len(direct) / direct_s:8.1f} calls/s")
    print(f"  gateway p50 {pct(via, .5) * ms:7.2f} ms  p99 {pct(via, .99) * ms:7.2f} ms  "
          f"{len(via) / via_s:8.1f} calls/s")
    print(f"  added (difference of percentiles): p50 {(pct(via, .5) - pct(direct, .5)) * ms:.2f} ms, "
          f"p99 {(pct(via, .99) - pct(direct, .99)) * ms:.2f} ms")
    print(f"  gateway's own pre-forward time (histogram bucket bounds, {own_n} calls): p50 <= {own_p50 * ms:g} ms, "
          f"p99 <= {own_p99 * ms:g} ms")
    print(f"  throughput via gateway / direct: {(len(via) / via_s) / (len(direct) / direct_s):.2f}x")
    print(f"memory (gateway RSS MiB) over {args.sessions} sessions: "
          + ", ".join(f"{k}: {mib:.1f}" for k, mib in rss))
    print(f"  growth after the first {rss[1][0]} sessions: {rss[-1][1] - rss[1][1]:+.1f} MiB; "
          f"sessions still held at the end: {len(state['live']) + len(state['queued'])}")
    steps = [b - a for (_, a), (_, b) in itertools.pairwise(rss[1:])] or [0.0]
    print(f"  median RSS step per {batch} sessions: {statistics.median(steps):+.2f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--calls", type=int, default=5, help="calls per session in the latency phase")
    parser.add_argument("--unloaded-calls", type=int, default=300)
    parser.add_argument("--upstream-client", choices=("aiohttp", "httpx"), default="aiohttp")
    args = parser.parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return 0
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

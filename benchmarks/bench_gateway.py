"""Benchmark the gateway against a stand-in upstream on loopback: added latency, throughput, memory.

One run measures, against the same stand-in upstream (a minimal raw-ASGI app served by uvicorn in
a subprocess) and the real gateway (`python -m basin_runtime.gateway` in a subprocess):

1. Unloaded added latency: calls one at a time, directly and through the gateway, interleaved;
   added = via-gateway latency minus direct latency (p50, p99 of the per-pair differences).
2. At 200 concurrent sessions (each making `--calls` growing chat calls, then ending itself with the
   end key its first answer carried; the gateway runs with an admin token that only the benchmark's
   state read uses): p50/p99 latency direct and via the gateway, the difference, the gateway's own
   `basin_gateway_added_latency_seconds` (time before forwarding) and throughput via / direct
   (`--rounds` alternations of a direct and a via phase, summed).
3. Memory: the gateway's RSS (from /proc) while 10,000 sessions pass through it (200 at a time).

With `--via-smg` the upstream is the real router (`python -m smg.launch_router`, PD mode) in front of
a prefill and a decode stand-in worker (`tests/e2e/standin_worker.py`: a streamed answer is three
chunks 20 ms apart, the usage and `[DONE]`), so "direct" is client -> smg -> workers and "via" is
client -> gateway -> smg -> workers. `--stream` makes every chat call streamed: latencies are then
times to the first body chunk (TTFT as the client sees it). `--state redis` runs the gateway with its
admission state in a real redis-server (`tests/redis_server.py`). Each load phase also prints the CPU
seconds per chat call of every process (client, gateway, smg, workers, Redis; from /proc, each process
with its descendants), and the run ends with:

4. A stage profile of one call (in this process, on the load phase's last call of a session): the
   microseconds of the gateway's own steps (parse, identify, count, policy, serialise, relay, metrics),
   timed one by one; the gateway's measured CPU per call minus their sum is the HTTP server, the upstream
   client and the event loop.
5. A `--big-tokens` conversation (300k tokens of agent turns by default): the gateway's CPU per later
   call (each grown by one turn), averaged over `--big-calls` calls, and the other processes' beside it.

With `--gateway bare-asgi` or `--gateway bare-protocol` a bare relay (`bare_relay.py`: forwarding alone,
no sessions, parsing, counting, policy, metrics or log) takes the gateway's place, on uvicorn or on a raw
asyncio protocol: the same phases then measure the floor under the gateway's numbers on this stack.

    .venv/bin/python benchmarks/bench_gateway.py [--sessions 10000] [--concurrency 200] [--calls 5]
        [--via-smg] [--stream] [--state memory|redis] [--rounds 1]
        [--big-tokens 300000] [--big-calls 20] [--gateway basin|bare-asgi|bare-protocol]

Loopback only; every process started is stopped at the end. The machine's load average is printed
with the numbers: on a shared machine compare runs made in the same conditions.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from basin_runtime.session_keys import SESSION_KEY_HEADER  # noqa: E402

MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
MODEL_NAME = "standin-model"  # the name smg's stand-in workers serve (the plain stand-in takes any)
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
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0,
                       path: str = "/health") -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url + path)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) `pid` and its live descendants have used so far (from /proc)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = fields
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        k = todo.pop()
        if k in stats:
            total += int(stats[k][11]) + int(stats[k][12])  # utime, stime (fields 14 and 15 of stat)
        todo += children.get(k, [])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each named group of processes; "client" is this process."""
    out = {name: sum(cpu_s(pid) for pid in group) for name, group in pids.items()}
    times = os.times()
    out["client"] = times.user + times.system
    return out


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- a light HTTP/1.1 client (httpx's pool costs more CPU than the gateway at 200 connections) ------


class Connection:
    """One keep-alive HTTP/1.1 connection: POST JSON, read a Content-Length or chunked answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.first_chunk_at = 0.0  # perf_counter() when the last answer's first body bytes were read

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """(status, headers by lower-case name, body)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.first_chunk_at = 0.0
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
            data = await self.reader.readexactly(int(length or 0))
            self.first_chunk_at = time.perf_counter()
            return status, answer_headers, data
        data = b""
        while (size := int((await self.reader.readline()).split(b";")[0], 16)) > 0:
            data += await self.reader.readexactly(size)
            self.first_chunk_at = self.first_chunk_at or time.perf_counter()
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


def chat_body(session: int, turn: int, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages(session, turn), "max_tokens": 1}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


async def run_sessions(base: str, first: int, count: int, calls: int, concurrency: int,
                       is_gateway: bool, latencies: list[float], stream: bool = False) -> float:
    """Run `count` sessions on `concurrency` connections; return the wall time; per-call latencies appended
    (to the first body chunk when `stream`)."""
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
                    body = chat_body(k, turn, stream)
                    started = time.perf_counter()
                    status, headers, answer = await conn.post("/v1/chat/completions", body, {"x-session-id": sid})
                    latencies.append((conn.first_chunk_at if stream else time.perf_counter()) - started)
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


@dataclass
class Deployment:
    direct: str  # the upstream the gateway forwards to: the stand-in, or smg
    gateway: str
    pids: dict[str, list[int]]  # process groups whose CPU is counted, by name
    upstream_name: str


@contextlib.asynccontextmanager
async def servers(log_dir: str, args: argparse.Namespace, admin_token: str) -> AsyncIterator[Deployment]:
    async with contextlib.AsyncExitStack() as stack:
        pids: dict[str, list[int]] = {}
        if args.via_smg:
            ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "router", "metrics")}
            url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
            workers = [stack.enter_context(process([
                sys.executable, "-m", "tests.e2e.standin_worker", "--role", role, "--port", str(ports[role]),
                *(["--bootstrap-port", str(ports["bootstrap"])] if role == "prefill" else [])]))
                for role in ("prefill", "decode")]
            for role, proc in zip(("prefill", "decode"), workers, strict=True):
                await wait_healthy(url[role], proc)
            router = stack.enter_context(process([
                sys.executable, "-m", "smg.launch_router", "--pd-disaggregation",
                "--prefill", url["prefill"], str(ports["bootstrap"]), "--decode", url["decode"],
                "--host", "127.0.0.1", "--port", str(ports["router"]), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(ports["metrics"]), "--log-level", "warn"]))
            await wait_healthy(url["router"], router, path="/readiness")
            upstream, upstream_name = url["router"], "smg"
            pids.update(smg=[router.pid], workers=[w.pid for w in workers])
        else:
            up_port = free_port()
            upstream, upstream_name = f"http://127.0.0.1:{up_port}", "stand-in"
            up_proc = stack.enter_context(process([sys.executable, __file__, "--serve-upstream", str(up_port)]))
            await wait_healthy(upstream, up_proc)
            pids["workers"] = [up_proc.pid]
        config: dict[str, Any] = {"admin_token": admin_token}  # the token in a 0600 file, not on the command line
        if args.state == "redis":
            from tests.redis_server import RedisServer

            redis = RedisServer(Path(log_dir))
            redis.start()
            stack.callback(redis.kill)
            assert redis.process is not None
            config["state"] = redis.url
            pids["redis"] = [redis.process.pid]
        config_path = Path(log_dir) / "gateway.yaml"
        config_path.write_text(json.dumps(config), encoding="utf-8")
        config_path.chmod(0o600)
        gw_port = free_port()
        gateway = f"http://127.0.0.1:{gw_port}"
        if args.gateway == "basin":
            command = ["-m", "basin_runtime.gateway", "--upstream", upstream, "--port", str(gw_port),
                       "--model", str(MODEL_FILE), "--budget-tokens", str(10**12), "--log-level", "warning",
                       "--config", str(config_path),
                       "--session-log", str(Path(log_dir) / "sessions.jsonl")]
        else:  # the floor: forwarding alone (`bare_relay.py`)
            command = [str(ROOT / "benchmarks" / "bare_relay.py"), "--mode", args.gateway.removeprefix("bare-"),
                       "--upstream", upstream, "--port", str(gw_port)]
        gw_proc = stack.enter_context(process([sys.executable, *command]))
        await wait_healthy(gateway, gw_proc)
        pids["gateway"] = [gw_proc.pid]
        yield Deployment(upstream, gateway, pids, upstream_name)


def per_call(before: dict[str, float], after: dict[str, float], calls: int, names: list[str]) -> str:
    return ", ".join(f"{name} {(after[name] - before[name]) / calls * 1000:.3f}" for name in names if name in after)


async def big_conversation_cpu(gateway: str, pids: dict[str, list[int]], tokens: int,
                               calls: int) -> tuple[dict[str, float], int]:
    """CPU seconds per later call of a `tokens` conversation (grown by one turn a call), by process."""
    from bench_big_prompt import conversation, text_of

    # tool output as user turns: smg refuses a `tool` message without a `tool_call_id`
    history = [{**m, "role": "user"} if m["role"] == "tool" else m for m in conversation(tokens)]
    host, port = gateway.removeprefix("http://").split(":")
    conn = Connection(host, int(port))
    sid, key = "bench-big", None
    body = json.dumps({"model": MODEL_NAME, "messages": history, "max_tokens": 1}).encode()
    try:
        status, headers, _ = await conn.post("/v1/chat/completions", body, {"x-session-id": sid})
        key = headers.get(SESSION_KEY_HEADER.lower())
        bodies = []
        for k in range(calls):  # encoded ahead of time: the client's own JSON work is not the gateway's
            history = [*history, {"role": "assistant", "content": text_of(300, 7000 + k)},
                       {"role": "user", "content": text_of(2000, 8000 + k)}]
            bodies.append(json.dumps({"model": MODEL_NAME, "messages": history, "max_tokens": 1}).encode())
        before = cpu_of(pids)
        for body in bodies:
            status, _, answer = await conn.post("/v1/chat/completions", body, {"x-session-id": sid})
            if status != 200:
                raise RuntimeError(f"big call failed: {status} {answer[:200]!r}")
        after = cpu_of(pids)
        await conn.post(f"/basin/sessions/{sid}/end", b"", {SESSION_KEY_HEADER: key} if key else {})
        return {name: (after[name] - before[name]) / calls for name in after}, len(bodies[-1])
    finally:
        conn.close()


async def stage_profile(session: int, turn: int, stream: bool, repeat: int = 2000) -> dict[str, float]:
    """Microseconds of each of the gateway's own steps for one call (see the module docstring, item 4)."""
    from stage_profile import profile_call

    return await profile_call(chat_body(session, turn - 1, stream), chat_body(session, turn, stream), stream, repeat)


async def bench(args: argparse.Namespace) -> None:
    admin_token = secrets.token_hex(16)
    stream = args.stream
    is_basin = args.gateway == "basin"
    with tempfile.TemporaryDirectory() as log_dir:
        async with servers(log_dir, args, admin_token) as deployment, \
                httpx.AsyncClient(trust_env=False, timeout=60) as client:
            upstream, gateway, gw_pid = deployment.direct, deployment.gateway, deployment.pids["gateway"][0]
            # warm-up (tokenizer, model, connections)
            await run_sessions(gateway, 10**6, 50, 2, 50, True, [], stream)
            await run_sessions(upstream, 10**6, 50, 2, 50, False, [], stream)

            direct_1, via_1 = [], []
            unloaded_cpu = cpu_s(gw_pid)
            for k in range(args.unloaded_calls):
                await run_sessions(upstream, 2 * 10**6 + k, 1, 1, 1, False, direct_1, stream)
                await run_sessions(gateway, 2 * 10**6 + k, 1, 1, 1, True, via_1, stream)
            unloaded_cpu = (cpu_s(gw_pid) - unloaded_cpu) / args.unloaded_calls
            added_1 = [v - d for v, d in zip(via_1, direct_1, strict=True)]

            # Direct and via the gateway in turns, `--rounds` times: the other work on a shared machine comes
            # and goes, and alternating spreads it over both sides.
            n = args.concurrency * 2
            direct, via = [], []
            direct_s = via_s = 0.0
            loads = []
            cpu_direct = cpu_via = dict.fromkeys(cpu_of(deployment.pids), 0.0)
            for round_ in range(args.rounds):
                loads.append(load_average())
                cpu_0 = cpu_of(deployment.pids)
                direct_s += await run_sessions(upstream, round_ * n, n, args.calls, args.concurrency, False, direct,
                                               stream)
                cpu_1 = cpu_of(deployment.pids)
                via_s += await run_sessions(gateway, round_ * n, n, args.calls, args.concurrency, True, via, stream)
                cpu_2 = cpu_of(deployment.pids)
                cpu_direct = {k: v + cpu_1[k] - cpu_0[k] for k, v in cpu_direct.items()}
                cpu_via = {k: v + cpu_2[k] - cpu_1[k] for k, v in cpu_via.items()}
            own = await gateway_added_quantiles(client, gateway) if is_basin else None

            big_cpu, big_bytes = ({}, 0) if args.big_calls == 0 else await big_conversation_cpu(
                gateway, deployment.pids, args.big_tokens, args.big_calls)

            rss = [(0, rss_mib(gw_pid))]
            done, batch = 0, 1000
            while done < args.sessions and is_basin:
                await run_sessions(gateway, 10**7 + done, batch, 2, args.concurrency, True, [], stream)
                done += batch
                rss.append((done, rss_mib(gw_pid)))
            admin = {"Authorization": f"Bearer {admin_token}"}
            state = (await client.get(gateway + "/basin/state", headers=admin)).json()["policy"] if is_basin else {}

    stages = await stage_profile(n - 1, args.calls - 1, stream) if is_basin else {}
    ms = 1000.0
    what = "time to first chunk" if stream else "latency"
    names = ["client", "gateway", deployment.upstream_name if deployment.upstream_name == "smg" else "", "workers",
             "redis"]
    names = [name for name in names if name]
    print(f"machine: {os.cpu_count()} cpus; upstream: {deployment.upstream_name}"
          f"{' (PD mode) in front of a prefill and a decode stand-in' if args.via_smg else ': raw ASGI on uvicorn'}; "
          + (f"gateway: basin_runtime.gateway (state {args.state}), "
             f"session log on"
             if is_basin else f"in the gateway's place: bare_relay.py --mode {args.gateway.removeprefix('bare-')} "
                              f"(forwarding alone)")
          + f"; calls {'streamed' if stream else 'not streamed'}")
    print(f"unloaded ({args.unloaded_calls} calls, one at a time, {what}): added p50 {pct(added_1, .5) * ms:.2f} ms, "
          f"p99 {pct(added_1, .99) * ms:.2f} ms (direct p50 {pct(direct_1, .5) * ms:.2f} ms); gateway CPU "
          f"{unloaded_cpu * ms:.2f} ms per call (each a new session's first call, and its end)")
    print(f"{args.concurrency} concurrent sessions x {args.calls} calls ({len(via)} calls), {what}:")
    print(f"  direct  p50 {pct(direct, .5) * ms:7.2f} ms  p99 {pct(direct, .99) * ms:7.2f} ms  "
          f"{len(direct) / direct_s:8.1f} calls/s")
    print(f"  gateway p50 {pct(via, .5) * ms:7.2f} ms  p99 {pct(via, .99) * ms:7.2f} ms  "
          f"{len(via) / via_s:8.1f} calls/s  ({args.rounds} rounds of direct then via; load average before each: "
          f"{'; '.join(loads)})")
    print(f"  added (difference of percentiles): p50 {(pct(via, .5) - pct(direct, .5)) * ms:.2f} ms, "
          f"p99 {(pct(via, .99) - pct(direct, .99)) * ms:.2f} ms")
    if own is not None:
        print(f"  gateway's own pre-forward time (histogram bucket bounds, {own[2]} calls): p50 <= {own[0] * ms:g} ms, "
              f"p99 <= {own[1] * ms:g} ms")
    print(f"  throughput via gateway / direct: {(len(via) / via_s) / (len(direct) / direct_s):.2f}x")
    zero = dict.fromkeys(cpu_direct, 0.0)
    print(f"  CPU ms per call, direct:      {per_call(zero, cpu_direct, len(direct), names)}")
    print(f"  CPU ms per call, via gateway: {per_call(zero, cpu_via, len(via), names)}  (its session ends included)")
    gateway_us = cpu_via["gateway"] / len(via) * 1e6
    if stages:
        print(f"stage profile of one call (session's call {args.calls}, in-process, us): "
              + ", ".join(f"{name} {us:.1f}" for name, us in stages.items())
              + f"; sum {sum(stages.values()):.1f}; the rest of the gateway's {gateway_us:.0f} us per call (HTTP "
                f"server, upstream client, event loop): {gateway_us - sum(stages.values()):.0f}")
    if args.big_calls:
        others = ", ".join(f"{name} {big_cpu[name] * ms:.2f}" for name in names
                           if name != "gateway" and name in big_cpu)
        print(f"{args.big_tokens}-token conversation, later calls ({big_bytes / 1e6:.1f} MB body): gateway CPU "
              f"{big_cpu['gateway'] * ms:.2f} ms per call over {args.big_calls} calls ({others} ms)")
    print(f"load average at the end: {load_average()}")
    if args.sessions == 0 or not is_basin:
        return
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
    parser.add_argument("--gateway", choices=("basin", "bare-asgi", "bare-protocol"), default="basin",
                        help="what runs in the gateway's place: basin's gateway, or a bare relay (`bare_relay.py`: "
                             "forwarding alone, on uvicorn or on a raw asyncio protocol) to measure the floor")
    parser.add_argument("--via-smg", action="store_true", help="smg (PD mode) and stand-in workers as the upstream")
    parser.add_argument("--stream", action="store_true", help="streamed chat calls (times to the first chunk)")
    parser.add_argument("--state", choices=("memory", "redis"), default="memory")
    parser.add_argument("--rounds", type=int, default=1, help="load phases, direct then via the gateway")
    parser.add_argument("--big-tokens", type=int, default=300_000)
    parser.add_argument("--big-calls", type=int, default=20, help="later calls of the big conversation (0: none)")
    args = parser.parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return 0
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

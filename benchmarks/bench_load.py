"""Benchmark the whole stack under load and through an engine kill: client -> gateway -> smg (PD) -> emulators.

Starts a loopback stack with `basin_stack.stack.LocalStack`: one prefill and `--num-decode` decode emulators
(`python -m basin_emulate`, a small profile written here: prefill 10 ms + 0.1 ms/token, decode 20 ms
per step, so the engines are cheap and the gateway and router are what is measured), the real `smg` in PD
mode and the Basin gateway (a budget nobody reaches: admission never holds a session). Then:

0. Unloaded: one call at a time, `--unloaded-calls` rounds of a direct call and a call through the
   gateway (two growing sessions, the order alternating), after a warm-up; added = the per-round
   difference (p50, p99), for the time to first token and end to end.
1. Load, direct: `--sessions` concurrent sessions, each `--calls` streamed chat calls of a growing
   conversation (official `openai` client, no retries), sent straight to smg.
2. Load, via the gateway: the same shape (new texts, so no cache is shared with phase 1).
   Per phase: calls/s, TTFT and end-to-end latency p50/p99, errors by kind. "Added" is the difference
   between the phases' percentiles (not paired; first calls and later calls apart), beside the
   gateway's own histogram of the time it spends before forwarding (`basin_gateway_added_latency_seconds`,
   bucket bounds so "<="). Under load the two paths differ in more than overhead: the gateway stamps
   every call with its session's priority and the engines (priority scheduling on) serve in that
   order, so the via-gateway tail can be longer and its median shorter; the histogram is the overhead.
3. Kill under load, via the gateway: `--kill-sessions` sessions at a time call in closed loops (a
   session ends itself after `--kill-session-calls` calls, with the end key its first answer carried,
   and a new one takes its place); after `--warmup-s` one decode engine is SIGKILLed, restarted
   `--outage-s` later. Printed: errors by kind (what the clients saw), how the sessions' own ends
   were answered, when smg marked the engine unhealthy and healthy again, when the last call failed
   (service back), when the restarted engine served its first call; then the gateway's accounting is
   checked (reserved and working-set tokens = sums over its live sessions; zero once they end).
4. Memory and lag: RSS (and peak RSS) of the gateway, smg and each engine (their whole process groups,
   from /proc), and each emulator's scheduler lag (`LocalStack.lag()`, wall seconds, last 60 s).

The gateway runs with an admin token (random per run, `LocalStack.admin_headers`): the benchmark's
operator reads (state, sessions) and end-of-phase sweeps use it; sessions never do.

smg runs with its defaults (health checks every 60 s, circuit breaker open 60 s), which is what a
deployment gets; `--smg-fast-recovery` passes a 1 s health check and a 2 s circuit-breaker timeout.

    .venv/bin/python benchmarks/bench_load.py [--sessions 300] [--calls 4] [--kill-sessions 100]
        [--outage-s 10] [--recover-timeout-s 150] [--num-decode 2] [--smg-fast-recovery] [--logs DIR]

Loopback only; every phase is bounded in time; every process started is stopped at the end (the stack's
context manager, also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from basin_runtime.session_keys import SESSION_KEY_HEADER
from basin_stack.stack import LocalStack, StackSpec

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
MODEL = "bench-tiny"
PROFILE = {  # the round-number profile of the tests (tests/sim/builders.py TINY), named for this benchmark
    "name": MODEL, "kv_pool_tokens": 2_000_000, "kv_bytes_per_token": 1000.0, "state_bytes_per_request": 0.0,
    "prefill_batch_fixed_s": 0.01, "prefill_token_s": 1e-4, "prefill_attention_pair_s": 0.0,
    "chunked_prefill_tokens": 4096, "decode_step_fixed_s": 0.02, "dense_weight_bytes": 0.0,
    "expert_weight_bytes": 0.0, "experts_total": 8, "experts_per_token": 1, "kv_read_bytes_per_token": 0.0,
    "hbm_bytes_per_s": 1e12, "transfer_fixed_s": 0.005, "transfer_bytes_per_s": 1e9, "host_load_bytes_per_s": 1e9,
    "host_cache_ratio": 2.0, "pd_request_overhead_s": 0.0,
}
SMG_FAST_RECOVERY = ("--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "2")
SYSTEM = "You are an autonomous coding agent. Follow the repository's conventions. " * 20  # shared by every session


# --- one session's calls ---------------------------------------------------------------------------


@dataclass
class Call:
    """One streamed call as the client saw it (perf_counter seconds)."""

    started: float
    ended: float = math.nan
    ttft_s: float | None = None
    kind: str = "ok"  # ok | http <status> <type> | stream_error | connection | other
    message: str = ""
    served_by: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def total_s(self) -> float:
        return self.ended - self.started


@dataclass
class Session:
    """A growing conversation: each successful call appends the answer and a tool output."""

    session_id: str
    max_tokens: int
    calls: list[Call] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    end_key: str | None = None  # from the gateway's first answer: what the session is ended with

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Task {self.session_id}: " + "make the build green " * 60}]

    async def call(self, client: openai.AsyncOpenAI) -> Call:
        call = Call(time.perf_counter())
        parts: list[str] = []
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[], extra_body={"messages": self.messages}, max_tokens=self.max_tokens,
                stream=True, extra_headers={"X-Session-ID": self.session_id})
            call.served_by = raw.headers.get("x-smg-routed-worker-id")
            self.end_key = self.end_key or raw.headers.get(SESSION_KEY_HEADER)
            async with raw.parse() as stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        if choice.delta.content and call.ttft_s is None:
                            call.ttft_s = time.perf_counter() - call.started
                        parts.append(choice.delta.content or "")
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            call.kind = f"http {exc.status_code} {body.get('type', '')}".strip()
            call.message = str(body.get("message", exc.message))
        except openai.APIConnectionError as exc:
            call.kind, call.message = "connection", f"{exc} ({type(exc.__cause__).__name__})"
        except openai.APIError as exc:
            call.kind = "stream_error" if exc.message.startswith("Stream error") else "other"
            call.message = exc.message
        call.ended = time.perf_counter()
        self.calls.append(call)
        if call.ok:
            self.messages += [{"role": "assistant", "content": "".join(parts)},
                              {"role": "user", "content": f"output {len(self.calls)}: " + "test passed " * 40}]
        return call


def make_client(base_url: str, connections: int, timeout_s: float = 120.0) -> openai.AsyncOpenAI:
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=connections,
                                                    max_keepalive_connections=connections)
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0,
                              timeout=openai.Timeout(timeout_s, connect=10.0),
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits))


# --- measuring --------------------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); NaN without values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value * 1000:.1f} ms" if abs(value) < 0.1 else f"{value * 1000:.0f} ms"


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Prometheus samples by `name{labels}`."""
    response = await http.get(url)
    response.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return samples


def histogram_quantile(after: dict[str, float], before: dict[str, float], name: str, q: float) -> float:
    """Upper bucket bound holding the q quantile of the observations between two scrapes."""
    buckets = []
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{le="):
            bound = key[len(name) + 11:-1]
            buckets.append((math.inf if bound == "+Inf" else float(bound), value - before.get(key, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    return next(bound for bound, count in buckets if count >= q * total)


def rss_mib(pgid: int) -> tuple[float, float]:
    """(RSS, peak RSS) in MiB summed over a process group's live processes."""
    rss = peak = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ":" in line)
            rss += int(fields["VmRSS"].split()[0])
            peak += int(fields["VmHWM"].split()[0])
    return rss / 1024, peak / 1024


def print_memory(stack: LocalStack) -> None:
    print("memory (process group RSS / peak RSS):")
    for name, proc in stack.procs.items():
        if proc.popen is not None and proc.alive:
            rss, peak = rss_mib(proc.popen.pid)
            print(f"  {name:9s} {rss:7.1f} MiB / {peak:7.1f} MiB")


def print_lag(stack: LocalStack) -> None:
    lags = stack.lag()
    text = ", ".join(f"{name} p50 {ms(lag['p50_s'])} p99 {ms(lag['p99_s'])} max {ms(lag['max_s'])}"
                     for name, lag in lags.items() if lag.get("count"))
    print(f"emulator lag (last 60 s, wall): {text or 'no events'}")


def error_table(calls: Sequence[Call]) -> str:
    failed = Counter((c.kind, c.message[:110]) for c in calls if not c.ok)
    if not failed:
        return "  errors: none"
    return "\n".join(f"  {count:5d} x {kind}: {message}" for (kind, message), count in failed.most_common())


# --- phases ----------------------------------------------------------------------------------------


async def load_phase(label: str, base_url: str, tag: str, sessions: int, calls: int, max_tokens: int,
                     timeout_s: float) -> tuple[list[Session], float]:
    """`sessions` concurrent sessions of `calls` streamed calls each; (the sessions, wall seconds)."""
    runs = [Session(f"{tag}-{k:04d}", max_tokens) for k in range(sessions)]

    async def one(session: Session, client: openai.AsyncOpenAI) -> None:
        for _ in range(calls):
            if not (await session.call(client)).ok:
                return
            await asyncio.sleep(0.05)

    async with make_client(base_url, sessions + 16) as client:
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(s, client) for s in runs)), timeout=timeout_s)
        wall = time.perf_counter() - started
    done = [c for s in runs for c in s.calls]
    ok = [c for c in done if c.ok]
    print(f"{label}: {len(done)} calls of {sessions} sessions in {wall:.1f} s = {len(ok) / wall:.1f} calls/s; "
          f"TTFT p50 {ms(pct([c.ttft_s for c in ok if c.ttft_s is not None], 50))} "
          f"p99 {ms(pct([c.ttft_s for c in ok if c.ttft_s is not None], 99))}; "
          f"end to end p50 {ms(pct([c.total_s for c in ok], 50))} p99 {ms(pct([c.total_s for c in ok], 99))}")
    print(error_table(done))
    return runs, wall


async def unloaded_phase(stack: LocalStack, http: httpx.AsyncClient, rounds: int, max_tokens: int) -> None:
    """One call at a time, direct and via the gateway in turn; the per-round differences."""
    assert stack.gateway_url is not None
    async with make_client(stack.router_url, 4) as direct, make_client(stack.gateway_url, 4) as via:
        for k in range(3):  # warm-up: connections, the shared system prompt in the prefix cache
            await Session(f"warm-{k}", max_tokens).call(direct)
            await Session(f"warm-via-{k}", max_tokens).call(via)
        await end_sessions(http, stack)
        before = await scrape(http, f"{stack.gateway_url}/metrics")
        sessions = {"direct": Session("unloaded-direct", max_tokens), "via": Session("unloaded-via", max_tokens)}
        pairs: list[tuple[Call, Call]] = []
        for k in range(rounds):
            order = ("direct", "via") if k % 2 == 0 else ("via", "direct")
            got = {path: await sessions[path].call(direct if path == "direct" else via) for path in order}
            pairs.append((got["direct"], got["via"]))
        after = await scrape(http, f"{stack.gateway_url}/metrics")
    good = [(d, v) for d, v in pairs if d.ok and v.ok and d.ttft_s is not None and v.ttft_s is not None]
    ttft = [v.ttft_s - d.ttft_s for d, v in good]  # type: ignore[operator]
    total = [v.total_s - d.total_s for d, v in good]
    own = [histogram_quantile(after, before, "basin_gateway_added_latency_seconds", q) for q in (0.5, 0.99)]
    print(f"unloaded, {len(good)} of {rounds} rounds ok: direct end to end p50 "
          f"{ms(pct([d.total_s for d, _ in good], 50))}; added by the gateway: TTFT p50 {ms(pct(ttft, 50))} "
          f"p99 {ms(pct(ttft, 99))}, end to end p50 {ms(pct(total, 50))} p99 {ms(pct(total, 99))}; "
          f"its own time before forwarding p50 <= {ms(own[0])} p99 <= {ms(own[1])}")
    await end_sessions(http, stack)


async def end_sessions(http: httpx.AsyncClient, stack: LocalStack) -> int:
    """End every session the gateway holds (the operator's sweep, with the admin token); how many."""
    gateway, admin = stack.gateway_url, stack.admin_headers
    ids = [s["session_id"] for s in (await http.get(f"{gateway}/basin/sessions", headers=admin)).json()["sessions"]]
    await asyncio.gather(*(http.post(f"{gateway}/basin/sessions/{sid}/end", headers=admin) for sid in ids))
    return len(ids)


async def check_accounting(http: httpx.AsyncClient, stack: LocalStack) -> str:
    """Compare the policy's sums with the sums over the sessions the gateway lists."""
    gateway, admin = stack.gateway_url, stack.admin_headers
    policy = (await http.get(f"{gateway}/basin/state", headers=admin)).json()["policy"]
    sessions = (await http.get(f"{gateway}/basin/sessions", headers=admin)).json()["sessions"]
    working = sum(s["last_prompt_tokens"] for s in sessions)
    reserved = sum(max(math.ceil(s["predicted_peak_tokens"]), s["last_prompt_tokens"]) for s in sessions)
    in_flight = sum(s["in_flight"] for s in sessions)
    same = (set(policy["live"]) == {s["session_id"] for s in sessions} and policy["queued"] == []
            and policy["working_set_tokens"] == working and policy["reserved_tokens"] == reserved and in_flight == 0)
    return (f"{'OK' if same else 'MISMATCH'}: {len(sessions)} live, {in_flight} in flight, working set "
            f"{policy['working_set_tokens']} (sum {working}), reserved {policy['reserved_tokens']} (sum {reserved})")


async def kill_phase(stack: LocalStack, http: httpx.AsyncClient, slots: int, session_calls: int, max_tokens: int,
                     warmup_s: float, outage_s: float, recover_timeout_s: float) -> None:
    """`slots` closed loops of sessions (each `session_calls` calls, then ended and replaced by a new one, as
    agents finish tasks); one decode killed, then restarted; what the clients saw and when."""
    gateway = stack.gateway_url
    assert gateway is not None
    name = f"decode{len(stack.decode_urls) - 1}"
    dead = stack.decode_urls[-1]
    runs: list[Session] = []
    stop = asyncio.Event()
    marks: dict[str, float] = {}
    end_status: Counter[int] = Counter()

    async def loop(slot: int, client: openai.AsyncOpenAI) -> None:
        for k in range(1_000_000):
            session = Session(f"kill-{slot:04d}-{k:04d}", max_tokens)
            runs.append(session)
            for _ in range(session_calls):
                call = await session.call(client)
                await asyncio.sleep(0.05 if call.ok else 0.5)
                if stop.is_set():
                    return
            # as an agent: its own end key, no admin token (a session whose first call failed has none)
            key = {} if session.end_key is None else {SESSION_KEY_HEADER: session.end_key}
            with contextlib.suppress(httpx.HTTPError):
                response = await http.post(f"{gateway}/basin/sessions/{session.session_id}/end", headers=key)
                end_status[response.status_code] += 1

    async def watch_health() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                workers = (await http.get(f"{stack.router_url}/workers")).json()["workers"]
                healthy = next(w["is_healthy"] for w in workers if w["url"] == dead)
                if not healthy and "killed" in marks and "unhealthy" not in marks:
                    marks["unhealthy"] = time.perf_counter()
                if healthy and "restarted" in marks and "unhealthy" in marks and "healthy_again" not in marks:
                    marks["healthy_again"] = time.perf_counter()
            await asyncio.sleep(0.2)

    before = await scrape(http, f"{stack.gateway_url}/metrics")
    async with make_client(gateway, slots + 16) as client:
        tasks = [asyncio.create_task(loop(k, client)) for k in range(slots)] + [asyncio.create_task(watch_health())]
        try:
            await asyncio.sleep(warmup_s)
            marks["killed"] = time.perf_counter()
            await asyncio.to_thread(stack.kill, name)
            await asyncio.sleep(outage_s)
            await asyncio.to_thread(stack.restart, name)
            marks["restarted"] = time.perf_counter()
            deadline = marks["restarted"] + recover_timeout_s
            while time.perf_counter() < deadline:
                if any(c.ok and c.served_by == dead and c.started > marks["restarted"] for s in runs for c in s.calls):
                    marks["served_again"] = time.perf_counter()
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(3.0)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    after = await scrape(http, f"{stack.gateway_url}/metrics")

    calls = [c for s in runs for c in s.calls]
    killed, restarted = marks["killed"], marks["restarted"]
    before_kill = [c for c in calls if c.ended < killed]
    failed = [c for c in calls if not c.ok]
    last_failed = max((c.ended for c in failed), default=killed)
    outage = [c for c in calls if killed <= c.ended <= last_failed]
    print(f"kill under load: {slots} sessions at a time in closed loops ({len(runs)} sessions of up to "
          f"{session_calls} calls), {name} ({dead}) killed after {warmup_s:g} s, restarted {outage_s:g} s later")
    print(f"  before the kill: {sum(c.ok for c in before_kill) / warmup_s:.1f} calls/s, "
          f"{sum(not c.ok for c in before_kill)} failed")
    print(f"  from the kill to the last failure: {len(outage)} calls ended, {sum(not c.ok for c in outage)} failed, "
          f"{sum(c.ok for c in outage)} served")
    print(error_table(calls))
    if "unhealthy" in marks:
        print(f"  smg marked it unhealthy {marks['unhealthy'] - killed:.1f} s after the kill, healthy again "
              + (f"{marks['healthy_again'] - restarted:.1f} s after the restart" if "healthy_again" in marks
                 else "(not seen)"))
    else:
        print("  smg never marked it unhealthy (health checks did not notice it before the restart)")
    if failed:
        print(f"  service back (last failed call ended): {last_failed - killed:.1f} s after the kill, "
              f"{last_failed - restarted:+.1f} s from the restart")
    if "served_again" in marks:
        print(f"  restarted engine serving again (its first call): {marks['served_again'] - restarted:.1f} s after "
              f"its restart (engine ready), {marks['served_again'] - killed:.1f} s after the kill")
    else:
        print(f"  restarted engine serving again: no call served by it within {recover_timeout_s:g} s")
    outcomes = {k.split("=")[1][:-1]: after[k] - before.get(k, 0.0) for k in after
                if k.startswith("basin_calls_total{")}
    print(f"  gateway calls by outcome: {outcomes}; clients saw {len(failed)} failures")
    print(f"  sessions ended by their own keys, by status: {dict(sorted(end_status.items()))}")
    print(f"  gateway accounting before ending the sessions: {await check_accounting(http, stack)}")


async def bench(args: argparse.Namespace, stack: LocalStack) -> None:
    assert stack.gateway_url is not None
    async with httpx.AsyncClient(timeout=30) as http:
        await unloaded_phase(stack, http, args.unloaded_calls, args.max_tokens)
        direct, direct_s = await load_phase("load, direct to smg", stack.router_url, "direct", args.sessions,
                                            args.calls, args.max_tokens, args.phase_timeout_s)
        print_lag(stack)
        before = await scrape(http, f"{stack.gateway_url}/metrics")
        via, via_s = await load_phase("load, via the gateway", stack.gateway_url, "via", args.sessions, args.calls,
                                      args.max_tokens, args.phase_timeout_s)
        after = await scrape(http, f"{stack.gateway_url}/metrics")
        print_lag(stack)
        for what, of in (("TTFT", lambda c: c.ttft_s), ("end to end", lambda c: c.total_s)):
            for calls, label in ((slice(None), "all calls"), (slice(0, 1), "first calls"),
                                 (slice(1, None), "later calls")):
                d = [of(c) for s in direct for c in s.calls[calls] if c.ok and of(c) is not None]
                v = [of(c) for s in via for c in s.calls[calls] if c.ok and of(c) is not None]
                print(f"latency added by the gateway under load, {what}, {label}: p50 {ms(pct(v, 50) - pct(d, 50))}, "
                      f"p99 {ms(pct(v, 99) - pct(d, 99))} (via minus direct percentiles)")
        name = "basin_gateway_added_latency_seconds"
        print(f"gateway's own time before forwarding: p50 <= {ms(histogram_quantile(after, before, name, 0.5))}, "
              f"p99 <= {ms(histogram_quantile(after, before, name, 0.99))}")
        ok_via = sum(c.ok for s in via for c in s.calls)
        ok_direct = sum(c.ok for s in direct for c in s.calls)
        print(f"throughput via / direct: {ok_via / via_s:.1f} / {ok_direct / direct_s:.1f} calls/s "
              f"= {ok_via / via_s / (ok_direct / direct_s):.2f}x")
        print(f"gateway accounting after the load: {await check_accounting(http, stack)}")
        print(f"ended {await end_sessions(http, stack)} sessions; after: {await check_accounting(http, stack)}")
        print_memory(stack)

        await kill_phase(stack, http, args.kill_sessions, args.kill_session_calls, args.max_tokens, args.warmup_s,
                         args.outage_s, args.recover_timeout_s)
        print(f"ended {await end_sessions(http, stack)} sessions; after: {await check_accounting(http, stack)}")
        busy = {}
        for url in stack.engine_urls:
            samples = await scrape(http, f"{url}/metrics")
            busy[url] = sum(v for k, v in samples.items() if k.startswith(("sglang:num_running_reqs",
                                                                              "sglang:num_queue_reqs")))
        print(f"engines' running + queued requests at the end: {busy}")
        print_lag(stack)
        print_memory(stack)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=300, help="concurrent sessions in the load phases")
    parser.add_argument("--calls", type=int, default=4, help="calls per session in the load phases")
    parser.add_argument("--max-tokens", type=int, default=16, help="completion tokens per call")
    parser.add_argument("--unloaded-calls", type=int, default=40, help="rounds of the unloaded comparison")
    parser.add_argument("--kill-sessions", type=int, default=100, help="closed-loop sessions in the kill phase")
    parser.add_argument("--kill-session-calls", type=int, default=8,
                        help="kill phase: calls per session before it ends and a new one takes its place")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="kill phase: seconds before the kill")
    parser.add_argument("--outage-s", type=float, default=10.0, help="kill phase: seconds the engine stays dead")
    parser.add_argument("--recover-timeout-s", type=float, default=150.0,
                        help="kill phase: longest wait after the restart for a call served by the engine")
    parser.add_argument("--num-decode", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--phase-timeout-s", type=float, default=300.0)
    parser.add_argument("--smg-fast-recovery", action="store_true",
                        help=f"run smg with {' '.join(SMG_FAST_RECOVERY)} (default: smg's own defaults)")
    parser.add_argument("--logs", type=Path, help="folder for the processes' logs (default: a temporary folder)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-load-") as scratch:
        folder = args.logs or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        profile = folder / "bench-tiny.yaml"
        profile.write_text(yaml.safe_dump(PROFILE), encoding="utf-8")
        gateway = {"model": [str(MODEL_FILE)], "budget_tokens": 10**12, "upstream_timeout_s": 60.0,
                   "log_level": "warning", "admin_token": secrets.token_hex(16)}
        router_args = SMG_FAST_RECOVERY if args.smg_fast_recovery else ()
        spec = StackSpec(folder / "logs", num_prefill=1, num_decode=args.num_decode, time_scale=args.time_scale,
                         profile=str(profile), gateway=gateway, router_args=router_args, startup_timeout_s=90.0)
        print(f"stack: 1 prefill + {args.num_decode} decode emulators (profile {MODEL}, time scale "
              f"{args.time_scale:g}), smg {'with ' + ' '.join(router_args) if router_args else 'with its defaults'}, "
              f"the gateway; {os.cpu_count()} CPUs; logs in {folder / 'logs'}")
        started = time.perf_counter()
        with LocalStack(spec) as stack:
            print(f"started in {time.perf_counter() - started:.1f} s")
            asyncio.run(bench(args, stack))
        print(f"total {time.perf_counter() - started:.0f} s")
        if args.logs is None:
            print(f"(logs in {folder} were removed; pass --logs to keep them)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

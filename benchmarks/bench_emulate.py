"""Benchmark one basin-emulate pair (prefill + decode) behind the real router: sustained requests/s and lag.

Starts, as subprocesses on loopback, a prefill and a decode emulator (`python -m basin_emulate`,
--time-scale 20 by default) and `smg` in PD mode in front of them (or, with --direct, sends each
request to both halves itself with the bootstrap fields, as smg does). Then, for each concurrency
level, `level` agent sessions run closed-loop for `--seconds`: each session's conversation starts at
about `--context-tokens` tokens (a 2k-token system prompt shared by all, the rest its own) and every
call appends the previous answer and a tool output of `--grow-tokens` tokens, asking `--max-tokens`
completion tokens; a session sends its next call as soon as the answer arrives. Sessions that reach
`--max-context-tokens` start over as a new conversation.

Per level it prints: completed calls/s, client-side latency p50/p99, the prefix hit rate the prefill
reported, and the emulators' scheduler lag (how late timed events ran against the wall, from the
`basin_emulate_lag_seconds` histogram over the level: bucket bounds, so "<="; and the window max).

First (in-process, no HTTP), memory over ended sessions: one PrefillEngine (the prefill half, on the
default profile with HiCache) serves sessions that each make `--memory-calls` calls and end, and after
each count in `--memory-sessions` it prints the traced memory (tracemalloc) and the chains its prefix
cache holds: both must stay flat, since an ended session's chain is dropped once evicted. It also
prints what the identity LRUs (chain book, token memo) hold when full: they are bounded by entry count.

    .venv/bin/python benchmarks/bench_emulate.py [--time-scale 20] [--levels 2 4 8 16] [--seconds 20]
        [--context-tokens 30000] [--direct] [--memory-sessions 1000,5000,20000] [--memory-only]

Loopback only; every request loop is bounded in time; every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from basin_emulate.clock import LagWindow, ModelClock
from basin_emulate.config import DEFAULT_PROFILE
from basin_emulate.identity import MAX_BOOK_ENTRIES, MAX_MEMO_ENTRIES, ChainBook, Prompt, PromptCounter, digest
from basin_emulate.prefill_engine import PrefillEngine
from basin_runtime.tokenizer import DEFAULT_TOKENIZER, get_tokenizer
from basin_sim import catalog

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench-emulated"
WORDS = [f"{a}{b}" for a in ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")
         for b in ("", "s", "ed", "ing", "er", "ly", "ion", "al")]
TOKENIZER = get_tokenizer(DEFAULT_TOKENIZER)
ROOMS = itertools.count(1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def text_of(tokens: int, rng: random.Random) -> str:
    """Random words of about `tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(tokens)]
    text = " ".join(words)
    return text[: int(len(text) * tokens / max(1, TOKENIZER.count_text(text)))]


class Texts:
    """Texts of a given size, unique per call but cheap for the client: a tagged chunk from a fixed pool.

    The tag makes every message new to the emulators (which tokenize each one once, as SGLang would), while
    the client only generates and counts the pool once.
    """

    def __init__(self, chunk_tokens: int, size: int = 64) -> None:
        rng = random.Random(7)
        self.chunk_tokens = chunk_tokens
        self.pool = [text_of(chunk_tokens, rng) for _ in range(size)]
        self.serial = itertools.count()

    def take(self, tokens: int, rng: random.Random) -> str:
        """About `tokens` tokens of text no other call sent."""
        chunks = [rng.choice(self.pool) for _ in range(max(1, tokens // self.chunk_tokens))]
        return f"[{next(self.serial)}] " + "\n".join(chunks)


@contextlib.contextmanager
def started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


async def wait_ok(session: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise SystemExit(f"{url} not ready within {timeout_s} s")


async def wait_registered(session: aiohttp.ClientSession, router: str, timeout_s: float = 60) -> None:
    """Until smg lists both emulators as ready workers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(f"{router}/workers") as response:
            workers = (await response.json())["workers"]
        if sorted((w["worker_type"], w["status"]) for w in workers) == [("decode", "ready"), ("prefill", "ready")]:
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"smg did not register both emulators within {timeout_s} s")


@dataclass
class Level:
    """What one concurrency level measured."""

    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0


class Target:
    """Where calls go: the router, or both emulators directly (smg's dual dispatch done here)."""

    def __init__(self, session: aiohttp.ClientSession, urls: dict[str, str], bootstrap_port: int, direct: bool):
        self.session, self.urls, self.bootstrap_port, self.direct = session, urls, bootstrap_port, direct

    async def chat(self, body: dict[str, Any]) -> bool:
        if not self.direct:
            async with self.session.post(f"{self.urls['router']}/v1/chat/completions", json=body) as response:
                await response.read()
                return response.status == 200
        routed = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                  "bootstrap_room": next(ROOMS)}

        async def post(url: str) -> int:
            async with self.session.post(f"{url}/v1/chat/completions", json=routed) as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(post(self.urls["prefill"]), post(self.urls["decode"]))
        return list(statuses) == [200, 200]


async def run_session(target: Target, args: argparse.Namespace, texts: Texts, seed: int, stop_at: float,
                      level: Level) -> None:
    rng = random.Random(seed)
    system = {"role": "system", "content": text_of(2_000, random.Random(0))}
    while time.monotonic() < stop_at:
        messages: list[dict[str, Any]] = [system, {"role": "user",
                                                   "content": texts.take(args.context_tokens - 2_000, rng)}]
        tokens = args.context_tokens
        while time.monotonic() < stop_at and tokens < args.max_context_tokens:
            started_s = time.monotonic()
            ok = await target.chat({"model": MODEL, "messages": messages, "max_tokens": args.max_tokens})
            if not ok:
                level.errors += 1
                break
            if time.monotonic() <= stop_at:
                level.latencies_s.append(time.monotonic() - started_s)
            messages += [{"role": "assistant", "content": "ran a command"},
                         {"role": "user", "content": texts.take(args.grow_tokens, rng)}]
            tokens += args.grow_tokens + args.max_tokens


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Counter and histogram samples of one emulator's /metrics, keyed by name and labels."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def lag_quantile(before: dict[str, float], after: dict[str, float], q: float) -> str:
    """The smallest lag-histogram bucket bound holding quantile q of the level's timed events."""
    buckets = sorted((float(key.split("le=")[1].rstrip("}")), after[key] - before.get(key, 0.0))
                     for key in after if key.startswith("basin_emulate_lag_seconds_bucket"))
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return "n/a"
    bound = next(b for b, count in buckets if count >= q * total)
    return "> 2.5 s" if bound == float("inf") else f"<= {bound * 1e3:g} ms"


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    return sum(value - before.get(key, 0.0) for key, value in after.items() if key.startswith(prefix))


async def bench(args: argparse.Namespace, urls: dict[str, str], bootstrap_port: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name in ("prefill", "decode"):
            await wait_ok(session, f"{urls[name]}/health")
        if not args.direct:
            await wait_ok(session, f"{urls['router']}/readiness")
            await wait_registered(session, urls["router"])
        target = Target(session, urls, bootstrap_port, args.direct)
        print(f"machine: {os.cpu_count()} cpus; time scale {args.time_scale:g}; sessions of "
              f"{args.context_tokens}..{args.max_context_tokens} tokens growing {args.grow_tokens}/call, "
              f"{args.max_tokens} tokens out; via {'direct dual dispatch' if args.direct else 'smg'}")
        seeds, texts = itertools.count(1), Texts(args.grow_tokens)
        for level_size in args.levels:
            before = {name: await scrape(session, urls[name]) for name in ("prefill", "decode")}
            level = Level()
            started_s = time.monotonic()
            stop_at = started_s + args.seconds
            await asyncio.gather(*(run_session(target, args, texts, next(seeds), stop_at, level)
                                   for _ in range(level_size)))
            elapsed_s = time.monotonic() - started_s
            after = {name: await scrape(session, urls[name]) for name in ("prefill", "decode")}
            infos = {}
            for name in ("prefill", "decode"):
                async with session.get(f"{urls[name]}/server_info") as response:
                    infos[name] = (await response.json())["basin_emulate"]["lag"]
            lat = sorted(level.latencies_s)
            hit = delta(before["prefill"], after["prefill"], "sglang:cached_tokens_total")
            total = delta(before["prefill"], after["prefill"], "sglang:prefill_effective_tokens_total")
            print(f"{level_size:4d} sessions: {len(lat) / args.seconds:6.2f} calls/s ({len(lat)} calls, "
                  f"{level.errors} errors, {elapsed_s:.1f} s), latency p50 {lat[len(lat) // 2] if lat else 0:.3f} s "
                  f"p99 {lat[int(len(lat) * 0.99)] if lat else 0:.3f} s, hit rate {hit / total if total else 0:.3f}")
            for name in ("prefill", "decode"):
                b, a = before[name], after[name]
                print(f"      {name:7s} lag p50 {lag_quantile(b, a, 0.5)}, p99 {lag_quantile(b, a, 0.99)}, "
                      f"window max {infos[name]['max_s'] * 1e3:.1f} ms over {infos[name]['count']} events")
            if lat:
                mean_s = statistics.fmean(lat)
                print(f"      mean latency {mean_s:.3f} s wall = {mean_s * args.time_scale:.2f} s model")


MEMORY_TIME_SCALE = 1e5  # model seconds per wall second: prefill and transfer timers are due at once
MEMORY_GROUPS = 4  # system prompts the sessions share
MEMORY_CONCURRENCY = 32  # sessions in flight


def traced_mib() -> float:
    gc.collect()
    return tracemalloc.get_traced_memory()[0] / 2**20


async def prefill_memory(checkpoints: list[int], calls: int) -> None:
    """Sessions of `calls` calls through an in-process PrefillEngine; memory and cache records per checkpoint."""
    profile = catalog.load_profile(DEFAULT_PROFILE)
    clock = ModelClock(MEMORY_TIME_SCALE, LagWindow(max_samples=1_000))  # bounded anyway; small not to mask the engine
    clock.start()
    engine = PrefillEngine(profile, clock, profile.kv_pool_tokens, profile.host_tier_tokens())
    print(f"prefill memory over ended sessions: in-process PrefillEngine, {profile.name}, device "
          f"{profile.kv_pool_tokens:,} + host {profile.host_tier_tokens():,} tokens; {calls} calls per session "
          f"(8k tokens + 1k per call, {MEMORY_GROUPS} shared 2k system prompts), {MEMORY_CONCURRENCY} at a time")

    async def session(index: int) -> None:
        for call in range(calls):
            prompt_tokens = 8_000 + 1_000 * call + 97 * (index % 11)
            await engine.prefill(f"chat:{index:08x}", f"group:{index % MEMORY_GROUPS}", 2_000, prompt_tokens, 0.0,
                                 clock.catch_up())

    async def worker(indices: Iterator[int]) -> None:
        for index in indices:
            await session(index)

    started_s, done = time.monotonic(), 0
    tracemalloc.start()
    baseline_mib = traced_mib()
    for stop in checkpoints:
        indices = iter(range(done, stop))
        await asyncio.gather(*(worker(indices) for _ in range(MEMORY_CONCURRENCY)))
        done = stop
        cache = engine.cache
        assert engine.is_idle and cache.pinned_tokens == 0
        print(f"  {stop:>7,} sessions ended: cache holds {cache.num_chains:,} chains ({cache.num_groups} groups, "
              f"{cache.num_heap_entries:,} heap entries), traced memory {traced_mib() - baseline_mib:6.2f} MiB, "
              f"{time.monotonic() - started_s:5.1f} s")
    tracemalloc.stop()


def constant(value: bytes) -> Callable[[int], bytes]:
    """A prompt's prefix digests, all `value` (one conversation per value, never extended)."""
    return lambda _: value


async def identity_ceilings() -> None:
    """Memory of the chain book and the token memo when full (each is an LRU bounded by entry count)."""
    tracemalloc.start()
    before = traced_mib()
    book = ChainBook()
    for index in range(MAX_BOOK_ENTRIES):
        fingerprint = digest(index.to_bytes(8, "little"))
        book.chain_key(Prompt(f"chat:{fingerprint.hex()}", "group:0", 2_000, 9_000, 2, constant(fingerprint)))
    book_mib = traced_mib() - before
    counter = PromptCounter(TOKENIZER)
    for index in range(MAX_MEMO_ENTRIES):
        await counter.text(f"conversation {index}")  # shorter than GROUP_CHARS: one memo entry
    memo_mib = traced_mib() - before - book_mib
    tracemalloc.stop()
    print(f"identity LRUs when full (bounded by count, not driven above): chain book {MAX_BOOK_ENTRIES:,} entries "
          f"{book_mib:.1f} MiB, token memo {MAX_MEMO_ENTRIES:,} entries {memo_mib:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--levels", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--context-tokens", type=int, default=30_000)
    parser.add_argument("--max-context-tokens", type=int, default=60_000)
    parser.add_argument("--grow-tokens", type=int, default=1_000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--direct", action="store_true", help="skip smg: dual-dispatch from the benchmark")
    parser.add_argument("--memory-sessions", default="1000,5000,20000",
                        help="checkpoints of the in-process memory run ('' for none)")
    parser.add_argument("--memory-calls", type=int, default=3, help="calls per session in the memory run")
    parser.add_argument("--memory-only", action="store_true", help="only the in-process memory run")
    args = parser.parse_args(argv)
    checkpoints = sorted(int(n) for n in filter(None, args.memory_sessions.split(",")))
    if checkpoints:
        asyncio.run(prefill_memory(checkpoints, args.memory_calls))
        asyncio.run(identity_ceilings())
    if args.memory_only:
        return 0
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "router", "metrics")}
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("prefill", "decode", "router")}
    common = ["--time-scale", str(args.time_scale), "--enable-metrics", "--enable-cache-report",
              "--served-model-name", MODEL, "--log-level", "warning"]
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(started([sys.executable, "-m", "basin_emulate", "--role", "prefill", "--port",
                                     str(ports["prefill"]), "--disaggregation-bootstrap-port", str(ports["bootstrap"]),
                                     *common], logs / "bench_emulate_prefill.log"))
        stack.enter_context(started([sys.executable, "-m", "basin_emulate", "--role", "decode", "--port",
                                     str(ports["decode"]), *common], logs / "bench_emulate_decode.log"))
        if not args.direct:
            stack.enter_context(started([
                sys.executable, "-m", "smg.launch_router", "--pd-disaggregation", "--prefill", urls["prefill"],
                str(ports["bootstrap"]), "--decode", urls["decode"], "--host", "127.0.0.1", "--port",
                str(ports["router"]), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["metrics"]),
                "--log-level", "warn"], logs / "bench_emulate_router.log"))
        asyncio.run(bench(args, urls, ports["bootstrap"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Simulator speed: one simulated hour of a deployment at the pre-surge load, cost against the number of
sessions, whole scenario runs as the CLI does them (target: 1 h of 1P3D in < 30 s; a run < 2 min), and
the prefix cache's admission cost against the number of chains it holds (target: flat).

    python benchmarks/bench_sim.py [--deployment 1p3d-h100] [--cache gpu] [--hours 1,2,4] [--sessions PATH]
        [--cache-chains 2000,60000]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from pathlib import Path

from basin_runtime.logs import configure_logging
from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.experiments.calibrate.rates import RateCache, overload_rate_for
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.profile import CacheKind, Deployment
from basin_sim.radix_cache import RadixCache
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import DEFAULT_SESSIONS, load_pool, workload_pool
from basin_sim.workload.scenarios import RateStep, Scenario, generate_sessions


def engine_hours(deployment: Deployment, pool: list[Session], rate_per_s: float,
                 hours: float) -> tuple[float, int, int]:
    """Wall seconds to simulate `hours` of steady arrivals (no drain, no unloaded times), sessions, calls."""
    duration = hours * 3600.0
    scenario = Scenario("bench", duration_s=duration, warmup_s=0.0, goodput_from_s=0.0, goodput_to_s=duration,
                        rate=(RateStep(0.0, 1.0),))
    sessions = generate_sessions(scenario, pool, rate_per_s, seed=1)
    policy = "hicache" if deployment.has_host_tier else "sglang"
    started = time.perf_counter()
    engine = Engine(deployment, make_policy(policy, PolicyContext(deployment)))
    for spec in sessions:
        engine.add(spec)
    engine.run_until(duration)
    wall = time.perf_counter() - started
    calls = sum(run.next_call for run in engine.runs.values())
    return wall, len(sessions), calls


CHAIN_GROUPS = 8  # shared system prompts (benchmarks)
GROUP_TOKENS = 500
CALL_TOKENS = (1_000, 1_500)  # a chain's two segments: what its two calls added past the group


def cache_admit_us(num_chains: int, num_admits: int = 20_000) -> float:
    """Mean wall microseconds of one `RadixCache.admit` in a full cache holding `num_chains` session chains.

    Every chain is a session's two calls (two segments). The cache is filled with `num_chains` of them,
    then new sessions make their two calls: each call must evict (the least recently used chain's
    segments) to fit, so the cache keeps holding `num_chains` chains of the same shape. Only the admits
    are timed, not their releases.
    """
    cache = RadixCache(CHAIN_GROUPS * GROUP_TOKENS + num_chains * sum(CALL_TOKENS))
    clock = itertools.count(1)
    spent_s = 0.0
    for index in range(num_chains + num_admits // len(CALL_TOKENS)):
        key, group = f"s{index}", f"g{index % CHAIN_GROUPS}"
        for call in range(len(CALL_TOKENS)):
            prompt, now = GROUP_TOKENS + sum(CALL_TOKENS[:call + 1]), float(next(clock))
            started = time.perf_counter()
            cache.admit(key, group, GROUP_TOKENS, prompt, now)
            if index >= num_chains:
                spent_s += time.perf_counter() - started
            cache.release(key, now)
    assert cache.num_chains == num_chains and cache.evicted_tokens == num_admits // 2 * sum(CALL_TOKENS)
    return 1e6 * spent_s / num_admits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", default="1p3d-h100")
    parser.add_argument("--cache", choices=("gpu", "host"), default="gpu")
    parser.add_argument("--hours", default="1,2,4", help="simulated hours for the scaling rows ('' for none)")
    parser.add_argument("--sessions", type=Path, default=DEFAULT_SESSIONS)
    parser.add_argument("--scenarios", default="steady,surge-100", help="whole runs to time ('' for none)")
    parser.add_argument("--cache-chains", default="2000,60000", help="chains held for the admit cost ('' for none)")
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING)
    cache: CacheKind = args.cache
    spec = catalog.load_deployment(args.deployment)
    base, workload = load_pool(args.sessions, use_synthetic=False)
    steady = catalog.load_scenario("steady")
    pool = workload_pool(base, steady.workload)
    deployment = spec.build(cache)
    overload, _ = overload_rate_for(deployment, pool, steady.workload, steady.clients, RateCache())
    rate = 0.5 * overload
    print(f"{spec.name} ({cache} cache), workload {workload} ({len(pool)} sessions), pre-surge load "
          f"{rate:.4f} sessions/s (half of the calibrated {overload:.4f})")
    print(f"{'simulated':>10} {'sessions':>9} {'calls':>8} {'wall s':>8} {'ms/session':>11} {'sim s per wall s':>17}")
    for hours in (float(h) for h in filter(None, args.hours.split(","))):
        wall, sessions, calls = engine_hours(deployment, pool, rate, hours)
        print(f"{hours:>9.1f}h {sessions:>9d} {calls:>8d} {wall:>8.2f} {1000 * wall / sessions:>11.2f} "
              f"{hours * 3600 / wall:>17.0f}")
    for name in filter(None, args.scenarios.split(",")):
        scenario = catalog.load_scenario(name)
        policy = "hicache" if cache == "host" else "sglang"
        started = time.perf_counter()
        result = run_scenario(RunSpec(scenario, deployment, policy, 1, overload), pool)
        wall = time.perf_counter() - started
        print(f"whole run {name}/{policy}: {wall:.1f} s wall for {result.run_summary.simulated_s / 3600:.2f} "
              f"simulated h, {len(result.outcomes)} sessions (with unloaded times and drain)")
    sizes = [int(n) for n in filter(None, args.cache_chains.split(","))]
    if sizes:
        costs = "; ".join(f"{n:,} chains {cache_admit_us(n):.1f} us/admit" for n in sizes)
        print(f"cache admit: {costs} (a new session evicting the LRU chain each time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

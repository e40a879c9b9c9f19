"""Cost per event of the policy core at scale (default: 2,000 live and 20,000 queued sessions).

Builds a policy whose live sessions reserve the whole budget and queues the rest behind them
(arrivals one second apart, so priorities mix arrival time and predicted peak), then times each
`arrive`, `observe`, `finish` (which admits queue heads into the freed room), withdraw (`finish` of
a queued session) and `tick` (hit-rate budget moves and the shedding check) one call at a time with
`time.perf_counter_ns`, and prints the median and p99 in microseconds. A `finish` costs more when it
admits several sessions, so its cost per session moved (the finished one plus those admitted) is
printed too. The `calibration` row times a fixed bit of pure Python (`sum(range(250))`, about as
long as one event) the same way: its p99/median ratio shows how much of every tail is the machine
(preemption, timer interrupts) rather than the policy.

    python benchmarks/bench_policy.py [--live 2000] [--queued 20000] [--events 5000] [--seed 0]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from basin_runtime.policy import Policy, PolicyConfig


def build(num_live: int, num_queued: int, rng: random.Random, clock: Iterator[float]) -> Policy:
    """A policy with `num_live` sessions filling the budget exactly and `num_queued` waiting."""
    peaks = [rng.randint(10_000, 90_000) for _ in range(num_live)]
    config = PolicyConfig(
        budget_tokens=sum(peaks),
        always_engaged=True,
        budget_move_interval_s=1.0,
        peak_completion_rate_per_s=1e9,  # the shedding check runs on every tick, never sheds
    )
    policy = Policy(config)
    for i, peak in enumerate(peaks):
        assert policy.arrive(f"live-{i}", 0.0, peak, rng.randint(1_000, 5_000))
    for i in range(num_queued):
        assert not policy.arrive(f"queued-{i}", next(clock), rng.randint(10_000, 90_000), 2_000)
    return policy


def timed(event: Callable[..., object], calls: list[tuple[Any, ...]]) -> tuple[list[float], list[Any]]:
    """The duration of `event(*args)` for each args tuple, in microseconds, and its results."""
    durations: list[float] = []
    results: list[Any] = []
    for args in calls:
        start = time.perf_counter_ns()
        result = event(*args)
        durations.append((time.perf_counter_ns() - start) / 1000.0)
        results.append(result)
    return durations, results


def run(num_live: int, num_queued: int, num_events: int, seed: int) -> dict[str, list[float]]:
    """Time every kind of event against one policy, in a fixed order, with time moving on."""
    rng = random.Random(seed)
    arrivals_clock = (float(t) for t in itertools.count(start=1))
    policy = build(num_live, num_queued, rng, arrivals_clock)
    events_clock = (next(arrivals_clock) + t / 100.0 for t in itertools.count())
    snap = policy.snapshot()
    print(f"start state: {len(snap.live)} live, {len(snap.queued)} queued, budget {snap.budget_tokens}")

    results: dict[str, list[float]] = {}
    calls: list[tuple[Any, ...]] = [
        (f"new-{i}", next(events_clock), rng.randint(10_000, 90_000), 2_000) for i in range(num_events)
    ]
    results["arrive"], _ = timed(policy.arrive, calls)
    live = list(policy.snapshot().live)
    calls = [(rng.choice(live), next(events_clock), rng.randint(1_000, 100_000)) for _ in range(num_events)]
    results["observe"], _ = timed(policy.observe, calls)
    live = list(policy.snapshot().live)
    calls = [(s, next(events_clock)) for s in rng.sample(live, min(num_events, len(live)))]
    results["finish"], admitted = timed(policy.finish, calls)
    moved = [1 + len(ids) for ids in admitted]
    results["finish per session moved"] = [d / n for d, n in zip(results["finish"], moved, strict=True)]
    print(f"finish admitted {sum(moved) - len(moved)} sessions over {len(moved)} calls (max {max(moved) - 1})")
    queued = list(policy.snapshot().queued)
    calls = [(s, next(events_clock)) for s in rng.sample(queued, min(num_events, len(queued)) // 2)]
    results["withdraw"], _ = timed(policy.finish, calls)
    calls = [(next(events_clock), rng.choice([None, 0.5, 0.95])) for _ in range(num_events)]
    results["tick"], _ = timed(policy.tick, calls)
    results["calibration"], _ = timed(sum, [(range(250),)] * num_events)
    snap = policy.snapshot()
    print(f"end state: {len(snap.live)} live, {len(snap.queued)} queued, budget {snap.budget_tokens}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print median and p99 per event kind."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=2_000, help="live sessions (default 2000)")
    parser.add_argument("--queued", type=int, default=20_000, help="queued sessions (default 20000)")
    parser.add_argument("--events", type=int, default=5_000, help="events timed per kind (default 5000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"policy core: {args.live} live, {args.queued} queued, {args.events} events per kind")
    results = run(args.live, args.queued, args.events, args.seed)
    print(f"{'event':<26} {'n':>6} {'median µs':>10} {'p99 µs':>10} {'max µs':>10}")
    for name, durations in results.items():
        p99 = statistics.quantiles(durations, n=100, method="inclusive")[98]
        median = statistics.median(durations)
        print(f"{name:<26} {len(durations):>6} {median:>10.2f} {p99:>10.2f} {max(durations):>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

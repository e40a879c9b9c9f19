"""The overload rate: the rate at which a deployment overloads without a surge, by steady-load trials.

The scenarios' load is half of it, as the paper chooses its load.

Rules:
- A trial: steady Poisson arrivals at one rate on an empty deployment for `horizon_s` (30 min by
  default, the surges' length; rates.py sets the timed workloads' own), under the FCFS baseline. A
  minute is overloaded when its median TTFT exceeds `ttft_limit_s`, or requests wait and none gets
  its first token; the trial overloads when `sustained_minutes` minutes in a row are (one huge prompt
  can stall prefill for a minute or two without the deployment being overloaded).
- A rate overloads when at least `min_overloaded` of the seeds' trials overload. Near the cache knee
  the healthy state survives for a random time (a noise-driven escape), so the rate is the one at
  which most trials fall over within the horizon, not the first at which any ever could.
- The search doubles the rate from `start_rate_per_s` until it overloads, then bisects down to
  `resolution_per_s`; it assumes overloading is monotone in the rate (true of the majority rule in
  practice, not guaranteed).
- No I/O: rates.py caches the result under data/.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from basin_runtime.session_table import Session
from basin_sim.engine import Engine
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.profile import Deployment
from basin_sim.timeline import Timeline
from basin_sim.workload.scenarios import RateStep, Scenario, generate_sessions


@dataclass(frozen=True)
class CalibrationSettings:
    """How overload is judged and searched for."""

    horizon_s: float = 1800.0
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    min_overloaded: int = 4
    ttft_limit_s: float = 10.0
    sustained_minutes: int = 5
    start_rate_per_s: float = 0.05
    resolution_per_s: float = 0.01


@dataclass(frozen=True)
class Calibration:
    """The overload rate found and every rate tried (rate, trials overloaded)."""

    overload_rate_per_s: float
    tried: tuple[tuple[float, int], ...]


def trial_overloads(deployment: Deployment, policy_name: str, pool: Sequence[Session], rate_per_s: float,
                    seed: int, settings: CalibrationSettings) -> bool:
    """One steady trial: True if it overloads within the horizon."""
    scenario = Scenario("calibration", duration_s=settings.horizon_s, warmup_s=0.0, goodput_from_s=0.0,
                        goodput_to_s=settings.horizon_s, rate=(RateStep(0.0, 1.0),))
    engine = Engine(deployment, make_policy(policy_name, PolicyContext(deployment)), timeline=Timeline(60.0))
    for spec in generate_sessions(scenario, pool, rate_per_s, seed):
        engine.add(spec)
    minute, streak = 60.0, 0
    while engine.now < settings.horizon_s:
        engine.run_until(engine.now + minute)
        ttfts = engine.timeline.ttfts(engine.now - minute, engine.now)
        sample = engine.sample()
        waiting = sample.prefill_waiting + sample.decode_queued
        is_overloaded = (ttfts and statistics.median(ttfts) > settings.ttft_limit_s) or (not ttfts and waiting > 0)
        streak = streak + 1 if is_overloaded else 0
        if streak >= settings.sustained_minutes:
            return True
    return False


def find_overload_rate(deployment: Deployment, policy_name: str, pool: Sequence[Session],
                       settings: CalibrationSettings = CalibrationSettings(),
                       report: Callable[[float, int], None] | None = None) -> Calibration:
    """The lowest rate (to `resolution_per_s`) at which most steady trials overload."""
    tried: list[tuple[float, int]] = []

    def overloads(rate: float) -> bool:
        count = sum(trial_overloads(deployment, policy_name, pool, rate, seed, settings) for seed in settings.seeds)
        tried.append((rate, count))
        if report is not None:
            report(rate, count)
        return count >= settings.min_overloaded

    low, high = 0.0, settings.start_rate_per_s
    while not overloads(high):
        low, high = high, 2 * high
    while high - low > settings.resolution_per_s:
        middle = round((low + high) / 2, 6)
        low, high = (low, middle) if overloads(middle) else (middle, high)
    return Calibration(round(high, 4), tuple(tried))

# Workloads: which sessions arrive when.
#
# Rules:
# - Sessions are drawn uniformly with replacement from a pool (a session table, or the synthetic
#   corpus) and replayed call by call: per-call prompt and completion tokens, tool gaps from the
#   trace. A gap the trace did not record (tau-bench has no timestamps) is DEFAULT_GAP_S.
# - Arrivals are Poisson at rate lambda(t): base_rate_per_s, times `surge.rate_factor` inside the surge
#   window. Interarrival times are drawn segment by segment (exact for a piecewise-constant rate).
# - The intervention (`burst`): extra Poisson arrivals at `rate_factor` x base_rate_per_s inside the
#   burst window, of *short* sessions (pool sessions cut to their first `max_calls` calls); when
#   `kill` is true every burst session still running at the end of the window is killed then.
# - Sessions of one benchmark share a system-prompt prefix: the smallest first prompt of that
#   benchmark in the pool (so it is a prefix of every session's first prompt).
# - Base arrivals and burst arrivals use separate random streams of the seed, so adding a burst does
#   not move the base arrivals. Same pool, scenario, rate and seed -> the same sessions.
# Windows: `pre` = [warmup_s, first disturbance); `post` = [window_start_s, duration_s); goodput counts
# sessions arriving in `post`. A steady scenario uses the same window as the surge scenarios.
"""Scenarios (surges, kill-bursts) and the session arrivals they generate."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from basin_runtime.session_table import Session
from basin_sim.lifecycle import SessionSpec

DEFAULT_GAP_S = 4.5  # a customer's reply takes a few seconds (the synthetic tau family's median, exp(1.5))


class ScenarioError(ValueError):
    """A scenario whose windows or rates do not make sense."""


@dataclass(frozen=True)
class Surge:
    """Arrivals at `rate_factor` x the base rate inside [start_s, end_s)."""

    start_s: float
    end_s: float
    rate_factor: float


@dataclass(frozen=True)
class Burst:
    """Extra short sessions at `rate_factor` x the base rate inside [start_s, end_s); killed at end_s if `kill`."""

    start_s: float
    end_s: float
    rate_factor: float
    max_calls: int
    kill: bool


@dataclass(frozen=True)
class Scenario:
    """A load pattern; times in seconds from the start of the run."""

    name: str
    description: str
    duration_s: float  # arrivals stop here
    warmup_s: float  # the `pre` window starts here
    window_start_s: float  # goodput and the `post` window start here
    load_fraction: float = 0.5  # base rate = load_fraction x the deployment's overload rate
    surge: Surge | None = None
    burst: Burst | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.warmup_s < self.pre_end_s <= self.window_start_s < self.duration_s:
            raise ScenarioError(f"scenario {self.name!r}: need 0 <= warmup_s < disturbance start <= window_start_s "
                                f"< duration_s, got {self.warmup_s}, {self.pre_end_s}, {self.window_start_s}, "
                                f"{self.duration_s}")
        if self.load_fraction <= 0:
            raise ScenarioError(f"scenario {self.name!r}: load_fraction must be > 0, got {self.load_fraction}")
        for part in (self.surge, self.burst):
            if part is not None and not (part.start_s < part.end_s <= self.window_start_s and part.rate_factor >= 0):
                raise ScenarioError(f"scenario {self.name!r}: {part} must end by window_start_s, with rate_factor >= 0")
        if self.burst is not None and self.burst.max_calls < 1:
            raise ScenarioError(f"scenario {self.name!r}: burst.max_calls must be >= 1")

    @property
    def pre_end_s(self) -> float:
        """End of the `pre` window: the first disturbance, or the goodput window for a steady run."""
        starts = [p.start_s for p in (self.surge, self.burst) if p is not None]
        return min(starts, default=self.window_start_s)

    def rate_factor_at(self, time_s: float) -> float:
        """lambda(t) / base rate for the base arrivals."""
        surge = self.surge
        if surge is not None and surge.start_s <= time_s < surge.end_s:
            return surge.rate_factor
        return 1.0


def shared_prefix_tokens(pool: Sequence[Session]) -> dict[str, int]:
    """Per benchmark, the shared system-prompt prefix: the smallest first prompt in the pool."""
    shared: dict[str, int] = {}
    for session in pool:
        current = shared.get(session.benchmark)
        if current is None or session.first_prompt_tokens < current:
            shared[session.benchmark] = session.first_prompt_tokens
    return shared


def to_spec(session_id: str, session: Session, arrival_s: float, shared: dict[str, int],
            is_burst: bool = False) -> SessionSpec:
    """A replayable session: its shared prefix and tool gaps resolved."""
    gaps = tuple(DEFAULT_GAP_S if c.gap_s is None else c.gap_s for c in session.calls[:-1])
    return SessionSpec(session_id, session, arrival_s, session.benchmark, shared[session.benchmark], gaps, is_burst)


def _poisson(rng: random.Random, start_s: float, end_s: float, rate_per_s: float) -> list[float]:
    times: list[float] = []
    if rate_per_s <= 0:
        return times
    t = start_s + rng.expovariate(rate_per_s)
    while t < end_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def _segments(scenario: Scenario) -> list[tuple[float, float, float]]:
    cuts = sorted({0.0, scenario.duration_s, *([scenario.surge.start_s, scenario.surge.end_s]
                                               if scenario.surge else [])})
    return [(a, b, scenario.rate_factor_at(a)) for a, b in itertools.pairwise(cuts)]


def generate_sessions(scenario: Scenario, pool: Sequence[Session], base_rate_per_s: float,
                      seed: int) -> list[SessionSpec]:
    """Every session of one run, in arrival order (burst sessions flagged)."""
    if not pool:
        raise ScenarioError("the session pool is empty")
    if base_rate_per_s <= 0:
        raise ScenarioError(f"base_rate_per_s must be > 0, got {base_rate_per_s}")
    shared = shared_prefix_tokens(pool)
    rng = random.Random(seed * 7919 + 1)
    specs: list[SessionSpec] = []
    for start, end, factor in _segments(scenario):
        for t in _poisson(rng, start, end, base_rate_per_s * factor):
            base = pool[rng.randrange(len(pool))]
            specs.append(to_spec(f"{len(specs):06d}:{base.session_id}", base, t, shared))
    burst = scenario.burst
    if burst is not None:
        burst_rng = random.Random(seed * 7919 + 2)
        for k, t in enumerate(_poisson(burst_rng, burst.start_s, burst.end_s, base_rate_per_s * burst.rate_factor)):
            base = pool[burst_rng.randrange(len(pool))]
            short = replace(base, calls=base.calls[:burst.max_calls])
            specs.append(to_spec(f"burst{k:06d}:{base.session_id}", short, t, shared, is_burst=True))
    specs.sort(key=lambda s: (s.arrival_s, s.session_id))
    return specs

"""Scenarios: which sessions arrive when, as a user writes them (`scenarios/*.yaml`, or any file).

Rate segments, bursts, closed populations, and the session arrivals they generate.

Rules (time):
- Times count from the end of warm-up: t = 0 there. Warm-up, [-warmup_s, 0), runs at the first
  rate segment and is excluded from every metric and from the timeline. The engine's clock starts
  at the start of warm-up, so engine time = t + warmup_s (`engine_s`).
- Arrivals stop at `duration_s`; the run then drains (simulate.py).

Rules (arrivals):
- Open population (`rate`): piecewise-constant Poisson arrivals, segment k from `from_s` to the
  next segment (or `duration_s`) at exactly one of: `x_overload` x the overload rate of the
  deployment's shape with a GPU-only cache, measured for this workload (calibrate/rates.py), so
  every policy and cache tier sees the same absolute arrivals; or `per_min` sessions per minute,
  absolute (no overload rate needed: a scenario whose segments are all `per_min` never
  calibrates, `needs_overload_rate` is False). The first segment starts at 0. Interarrival times
  are drawn segment by segment (exact for a piecewise-constant rate).
- Closed population (`population`): N agents, each starting its next session `think_s` after its
  previous one is over (clients.py); exactly one of `rate` and `population` is given.
- Sessions are drawn uniformly with replacement from the pool (workload/pool.py: benchmarks or a
  preset, tool time resolved, optionally scaled to a median peak) and replayed call by call.
- Bursts: extra Poisson arrivals at `x_base` x the first segment's rate (however it is given)
  inside [from_s, to_s), each burst on its own random stream, so regular arrivals depend only on
  the seed. Burst sessions are drawn uniformly, with replacement, from the pool sessions whose
  unloaded time (tool time included) is <= `max_unloaded_s`, never truncated; fewer than
  MIN_BURST_CANDIDATES candidates is an error. `kill_at_s` (optional) aborts every live or queued
  session of that burst then.
- Sessions of one benchmark share a system-prompt prefix: the smallest first prompt of that
  benchmark in the pool (so it is a prefix of every session's first prompt).

Rules (windows):
- `pre` = [0, first rate change or burst) (the whole run if there is none); the goodput window is
  [goodput_window.from_s, goodput_window.to_s) with to_s <= duration_s; goodput counts non-burst
  sessions arriving in it. `last_change_s` = the last rate change or burst end (0 if none).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from basin_runtime.session_table import Session
from basin_sim.clients import ClientPolicy
from basin_sim.lifecycle import SessionSpec

DEFAULT_GAP_S = 4.5  # a customer's reply takes a few seconds (the synthetic tau family's median, exp(1.5))
MIN_BURST_CANDIDATES = 10


class ScenarioError(ValueError):
    """A scenario whose times, rates or sessions do not make sense; the message names the field."""


@dataclass(frozen=True)
class RateStep:
    """From `from_s` on (until the next step), arrivals at `x_overload` x the overload rate or `per_min`/min.

    Exactly one of the two is given (the scenario checks it, naming the segment).
    """

    from_s: float
    x_overload: float | None = None
    per_min: float | None = None

    def rate_per_s(self, overload_rate_per_s: float) -> float:
        """Sessions per second of this segment (`overload_rate_per_s` is read only for `x_overload`)."""
        if self.per_min is not None:
            return self.per_min / 60.0
        assert self.x_overload is not None, "a RateStep outside a Scenario gives neither x_overload nor per_min"
        return self.x_overload * overload_rate_per_s


@dataclass(frozen=True)
class BurstSpec:
    """Extra sessions of unloaded time <= `max_unloaded_s` at `x_base` x the first rate in [from_s, to_s)."""

    from_s: float
    to_s: float
    x_base: float
    max_unloaded_s: float
    kill_at_s: float | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """Which sessions: some benchmarks of the pool (None: all) or a synthetic preset; tool time (`sourced`:
    published distributions where a corpus does not measure it, `recorded`: the recorded gaps;
    workload/tool_time.py) and its scale; the serving model's timing (workload/serving.py: `recorded`, or a
    named timing with its reasoning scale, None = the timing's fitted value); `median_peak_tokens`: every
    prompt of the pool's sessions scaled by one factor so their median peak is this (workload/pool.py; not
    with a preset)."""

    benchmarks: tuple[str, ...] | None = None
    preset: str | None = None
    tool_time: str = "sourced"
    tool_time_scale: float = 1.0
    timing: str = "recorded"
    reasoning_scale: float | None = None
    median_peak_tokens: float | None = None


@dataclass(frozen=True)
class PopulationSpec:
    """A closed population: `agents` agents, each starting a new session `think_s` after the last one."""

    agents: int
    think_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """A load pattern; times in seconds from the end of warm-up (see the rules above)."""

    name: str
    duration_s: float
    warmup_s: float
    goodput_from_s: float
    goodput_to_s: float
    rate: tuple[RateStep, ...] = ()
    population: PopulationSpec | None = None
    bursts: tuple[BurstSpec, ...] = ()
    workload: WorkloadSpec = WorkloadSpec()
    clients: ClientPolicy = field(default_factory=ClientPolicy)  # sourced defaults unless the file sets fields
    description: str = ""

    def __post_init__(self) -> None:
        where = f"scenario {self.name!r}"
        if not self.duration_s > 0 or not self.warmup_s >= 0:
            raise ScenarioError(f"{where}: need duration_s > 0 and warmup_s >= 0, got {self.duration_s}, "
                                f"{self.warmup_s}")
        if self.warmup_s % 60:
            raise ScenarioError(f"{where}: warmup_s must be whole minutes (the timeline's minutes start at its end), "
                                f"got {self.warmup_s}")
        if (not self.rate) == (self.population is None):
            raise ScenarioError(f"{where}: give exactly one of `rate` (open arrivals) and `population` (closed)")
        self._check_rate(where)
        if self.population is not None and (self.population.agents < 1 or self.population.think_s < 0):
            raise ScenarioError(f"{where}: population needs agents >= 1 and think_s >= 0, got {self.population}")
        if not 0 <= self.goodput_from_s < self.goodput_to_s <= self.duration_s:
            raise ScenarioError(f"{where}: goodput_window needs 0 <= from_s < to_s <= duration_s, got "
                                f"{self.goodput_from_s}, {self.goodput_to_s} with duration_s {self.duration_s}")
        for k, burst in enumerate(self.bursts):
            _check_burst(f"{where}: bursts[{k}]", burst, self.duration_s)
        if self.workload.tool_time not in ("sourced", "recorded"):
            raise ScenarioError(f"{where}: workload.tool_time must be `sourced` or `recorded`, got "
                                f"{self.workload.tool_time!r}")
        if self.workload.tool_time_scale < 0:
            raise ScenarioError(f"{where}: workload.tool_time_scale must be >= 0, got {self.workload.tool_time_scale}")
        if self.workload.preset is not None and self.workload.benchmarks is not None:
            raise ScenarioError(f"{where}: workload takes `benchmarks` or `preset`, not both")
        peak = self.workload.median_peak_tokens
        if peak is not None and (self.workload.preset is not None or not math.isfinite(peak) or peak < 1):
            raise ScenarioError(f"{where}: workload.median_peak_tokens must be a number >= 1 on recorded sessions "
                                f"(not a preset), got {peak!r}")

    def _check_rate(self, where: str) -> None:
        if not self.rate:
            return
        if self.rate[0].from_s != 0:
            raise ScenarioError(f"{where}: rate[0].from_s must be 0, got {self.rate[0].from_s}")
        for k, step in enumerate(self.rate):
            if (step.x_overload is None) == (step.per_min is None):
                raise ScenarioError(f"{where}: rate[{k}] needs exactly one of x_overload (x the overload rate) and "
                                    f"per_min (sessions per minute), got x_overload={step.x_overload}, "
                                    f"per_min={step.per_min}")
            key, value = ("per_min", step.per_min) if step.x_overload is None else ("x_overload", step.x_overload)
            if value is None or not value >= 0:  # also refuses NaN
                raise ScenarioError(f"{where}: rate[{k}].{key} must be >= 0, got {value}")
            if k and not self.rate[k - 1].from_s < step.from_s < self.duration_s:
                raise ScenarioError(f"{where}: rate[{k}].from_s must grow and stay below duration_s, got {step.from_s}")

    @property
    def needs_overload_rate(self) -> bool:
        """True if some segment is an `x_overload` multiple (False: absolute rates, or a closed population)."""
        return any(step.x_overload is not None for step in self.rate)

    def base_rate_per_s(self, overload_rate_per_s: float) -> float:
        """The first segment's sessions per second (warm-up runs at it; bursts multiply it); 0 if closed."""
        return self.rate[0].rate_per_s(overload_rate_per_s) if self.rate else 0.0

    @property
    def pre_end_s(self) -> float:
        """End of the `pre` window: the first rate change or burst; `duration_s` when there is none."""
        starts = [s.from_s for s in self.rate[1:]] + [b.from_s for b in self.bursts]
        return min(starts, default=self.duration_s)

    @property
    def last_change_s(self) -> float:
        """The last rate change or burst end (0 when the load never changes)."""
        ends = [s.from_s for s in self.rate[1:]] + [b.to_s for b in self.bursts]
        return max(ends, default=0.0)

    def engine_s(self, t_s: float) -> float:
        """Engine time of scenario time `t_s` (the engine starts at the start of warm-up)."""
        return t_s + self.warmup_s

    def segments(self, overload_rate_per_s: float) -> list[tuple[float, float, float]]:
        """(start, end, sessions per second) in scenario time, warm-up included as (-warmup_s, 0, first rate)."""
        base = self.base_rate_per_s(overload_rate_per_s)
        parts = [(-self.warmup_s, 0.0, base)] if self.warmup_s > 0 else []
        for k, step in enumerate(self.rate):
            end = self.rate[k + 1].from_s if k + 1 < len(self.rate) else self.duration_s
            parts.append((step.from_s, end, step.rate_per_s(overload_rate_per_s)))
        return parts


def _check_burst(where: str, burst: BurstSpec, duration_s: float) -> None:
    if not 0 <= burst.from_s < burst.to_s <= duration_s:
        raise ScenarioError(f"{where}: need 0 <= from_s < to_s <= duration_s, got {burst.from_s}, {burst.to_s}")
    if burst.x_base < 0 or burst.max_unloaded_s <= 0:
        raise ScenarioError(f"{where}: need x_base >= 0 and max_unloaded_s > 0, got {burst.x_base}, "
                            f"{burst.max_unloaded_s}")
    if burst.kill_at_s is not None and not burst.from_s <= burst.kill_at_s <= duration_s:
        raise ScenarioError(f"{where}: kill_at_s must be in [from_s, duration_s], got {burst.kill_at_s}")


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


def _rng(seed: int, stream: int) -> random.Random:
    return random.Random(seed * 7919 + stream)


def generate_sessions(scenario: Scenario, pool: Sequence[Session], overload_rate_per_s: float, seed: int,
                      unloaded_s: Callable[[Session], float] | None = None) -> list[SessionSpec]:
    """Every open-arrival and burst session of one run, in arrival order, arrival times in engine time.

    `overload_rate_per_s` is what `x_overload` segments multiply (ignored when there are none: pass 0).
    `unloaded_s` gives a pool session's unloaded time; it is needed only when there are bursts.
    """
    if not pool:
        raise ScenarioError("the session pool is empty")
    if scenario.needs_overload_rate and not overload_rate_per_s > 0:
        raise ScenarioError(f"scenario {scenario.name!r} has x_overload segments: overload_rate_per_s must be > 0, "
                            f"got {overload_rate_per_s}")
    shared = shared_prefix_tokens(pool)
    rng = _rng(seed, 1)
    specs: list[SessionSpec] = []
    for start, end, rate_per_s in scenario.segments(overload_rate_per_s):
        for t in _poisson(rng, start, end, rate_per_s):
            base = pool[rng.randrange(len(pool))]
            specs.append(to_spec(f"{len(specs):06d}:{base.session_id}", base, scenario.engine_s(t), shared))
    base_rate = scenario.base_rate_per_s(overload_rate_per_s)
    for b, burst in enumerate(scenario.bursts):
        candidates = burst_candidates(scenario.name, b, burst, pool, unloaded_s)
        burst_rng = _rng(seed, 2 + b)
        for k, t in enumerate(_poisson(burst_rng, burst.from_s, burst.to_s, base_rate * burst.x_base)):
            base = candidates[burst_rng.randrange(len(candidates))]
            specs.append(to_spec(f"burst{b}-{k:06d}:{base.session_id}", base, scenario.engine_s(t), shared,
                                 is_burst=True))
    specs.sort(key=lambda s: (s.arrival_s, s.session_id))
    return specs


def burst_candidates(name: str, index: int, burst: BurstSpec, pool: Sequence[Session],
                     unloaded_s: Callable[[Session], float] | None) -> list[Session]:
    """The pool sessions a burst draws from: unloaded time <= max_unloaded_s; at least MIN_BURST_CANDIDATES."""
    if unloaded_s is None:
        raise ScenarioError(f"scenario {name!r}: bursts[{index}] needs the pool's unloaded times")
    candidates = [s for s in pool if unloaded_s(s) <= burst.max_unloaded_s]
    if len(candidates) < MIN_BURST_CANDIDATES:
        raise ScenarioError(f"scenario {name!r}: bursts[{index}]: only {len(candidates)} pool sessions have an "
                            f"unloaded time <= max_unloaded_s={burst.max_unloaded_s:g} s (need "
                            f">= {MIN_BURST_CANDIDATES}); raise max_unloaded_s or use a larger pool")
    return candidates


def burst_kills(scenario: Scenario, specs: Sequence[SessionSpec]) -> list[tuple[float, list[str]]]:
    """(engine time, burst session ids) for every burst with a `kill_at_s`."""
    kills = []
    for b, burst in enumerate(scenario.bursts):
        if burst.kill_at_s is not None:
            ids = [s.session_id for s in specs if s.is_burst and s.session_id.startswith(f"burst{b}-")]
            kills.append((scenario.engine_s(burst.kill_at_s), ids))
    return kills

"""One run of a scenario on a deployment under a policy: sessions, engine, drain, outcomes, the summary.

Rules:
- Arrival rates: each `rate` segment is `x_overload` x `overload_rate_per_s` or an absolute
  `per_min`; a scenario with no `x_overload` segment (`Scenario.needs_overload_rate` False) runs
  with `overload_rate_per_s` = 0, and callers must not calibrate for it.
- The engine's clock starts at the start of warm-up; the scenario's times count from its end
  (workload/scenarios.py). Warm-up is excluded from every metric (run_summary.py).
- Open arrivals are added to the engine one progress step (`step_s`) ahead of its clock, in arrival
  order (`ArrivalFeed`), so its heap holds only the sessions due soon; an event scheduled before an
  arrival was added runs first when both fall at the same instant (arrival times are continuous:
  never seen in practice), and a burst's kill lists only the sessions arrived by then.
- Arrivals stop at `duration_s`. The run then drains (no new arrivals) until every session that
  arrived in the goodput window has ended or passed its deadline (arrival + 4 x unloaded time), so
  late arrivals are judged fairly; `max_drain_s` caps that tail.
- Unloaded times are computed for every goodput-window session and, for bursts, every pool
  session (memoized per pool session): tool time included, alone on the same deployment.
- Bursts with `kill_at_s` abort their live or queued sessions then (`Engine.kill_at`).
- Clients: the scenario's `clients` (a basin_sim.clients.ClientPolicy; the sourced defaults unless
  the file sets fields) time out, retry and give up; their jitter, the routers' tie-breaks and a closed
  population's draws all come from the run's seed.
- A closed population starts its agents at the start of warm-up; each agent's next session
  starts when its last one is over, until arrivals stop (`duration_s`).
- The summary (`RunSummary`; `RunResult.summary` is its JSON) depends only on the inputs: same inputs, same
  summary.
- No I/O: progress is reported through a callback with the simulated time.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from basin_runtime.policy.deadline import goodput_deadline_s
from basin_runtime.session_table import Session
from basin_sim.clients import ClosedPopulation
from basin_sim.engine import Engine
from basin_sim.goodput import SessionOutcome
from basin_sim.lifecycle import SessionRun, SessionSpec
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.run_spec import RunSpec
from basin_sim.run_summary import RunSummary, summarize
from basin_sim.timeline import Timeline
from basin_sim.unloaded import UnloadedTimes
from basin_sim.workload.scenarios import (
    Scenario,
    burst_kills,
    generate_sessions,
    shared_prefix_tokens,
    to_spec,
)

ProgressCallback = Callable[[float], None]


GC_THRESHOLDS = (200_000, 1_000, 1_000)  # gen0, gen1, gen2 (CPython's defaults: 700, 10, 10)


@dataclass(frozen=True)
class RunResult:
    """A run's spec, summary, timeline and per-session outcomes."""

    spec: RunSpec
    run_summary: RunSummary
    timeline: Timeline
    outcomes: tuple[SessionOutcome, ...]

    @property
    def summary(self) -> dict[str, Any]:
        """The run summary's JSON object (`RunSummary.to_json`)."""
        return self.run_summary.to_json()


def pool_unloaded_s(pool: Sequence[Session], unloaded: UnloadedTimes) -> Callable[[Session], float]:
    """A pool session's unloaded time (alone on the deployment, tool time included)."""
    shared = shared_prefix_tokens(pool)
    return lambda session: unloaded.of(to_spec(session.session_id, session, 0.0, shared))


@contextlib.contextmanager
def sparse_gc() -> Iterator[None]:
    """Run the block with Python's cyclic collector triggered far less often, then restore it.

    A run creates millions of short-lived objects next to hundreds of thousands of long-lived ones
    (sessions, cache chains, router trees); with the default thresholds the collector's full passes
    scan all of them again and again, a cost that grows with the deployment (measured with
    `benchmarks/bench_scale.py --large <a 10P30D file> --scale 10`: 10P30D's cost per session 1.50x 1P3D's with
    the defaults, 1.17x with these, 1.10x with no collection at all). The model makes no reference
    cycles it relies on the collector for.
    """
    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_scenario(spec: RunSpec, pool: Sequence[Session], progress: ProgressCallback | None = None,
                 unloaded: UnloadedTimes | None = None) -> RunResult:
    """Simulate one scenario run (with `sparse_gc`)."""
    with sparse_gc():
        return _run_scenario(spec, pool, progress, unloaded)


def _run_scenario(spec: RunSpec, pool: Sequence[Session], progress: ProgressCallback | None,
                  unloaded: UnloadedTimes | None) -> RunResult:
    scenario = spec.scenario
    unloaded = unloaded if unloaded is not None and unloaded.deployment == spec.deployment \
        else UnloadedTimes(spec.deployment)
    sessions = generate_sessions(scenario, pool, spec.overload_rate_per_s, spec.seed, pool_unloaded_s(pool, unloaded))
    window = (scenario.engine_s(scenario.goodput_from_s), scenario.engine_s(scenario.goodput_to_s))
    timeline = Timeline(spec.bin_s)
    end_s = scenario.engine_s(scenario.duration_s)
    population = _population(scenario, pool, spec.seed, end_s)
    engine = Engine(spec.deployment, make_policy(spec.policy_name, policy_context(spec)),
                    timeline=timeline, tick_s=spec.tick_s, router_seed=spec.seed, clients=scenario.clients,
                    client_seed=spec.seed, on_session_over=None if population is None else population.session_over)
    if population is not None:
        population.start(engine, 0.0)
    arrivals_s = {s.session_id: s.arrival_s for s in sessions}
    for at_s, ids in burst_kills(scenario, sessions):  # a session arriving after its kill is never killed
        engine.kill_at(at_s, [sid for sid in ids if arrivals_s[sid] <= at_s])
    feed = ArrivalFeed(engine, sessions)
    advance(engine, end_s, spec.step_s, progress, feed)
    assert feed.is_done, "an open arrival at or after duration_s"
    in_window = {sid: unloaded.of(run.spec) for sid, run in engine.runs.items()
                 if not run.spec.is_burst and window[0] <= run.spec.arrival_s < window[1]}
    deadlines = {sid: goodput_deadline_s(engine.runs[sid].spec.arrival_s, t) for sid, t in in_window.items()}
    stop_s = min(max(deadlines.values(), default=end_s), end_s + spec.max_drain_s)
    pending = [sid for sid in deadlines if not engine.runs[sid].is_over]
    while pending and engine.now < stop_s:
        advance(engine, min(engine.now + spec.step_s, stop_s), spec.step_s, progress)
        pending = [sid for sid in pending if not engine.runs[sid].is_over and deadlines[sid] >= engine.now]
    outcomes = tuple(_outcome(run, in_window.get(sid)) for sid, run in engine.runs.items())
    return RunResult(spec, summarize(spec, engine, outcomes, len(pool)), timeline, outcomes)


def _population(scenario: Scenario, pool: Sequence[Session], seed: int, stop_s: float) -> ClosedPopulation | None:
    if scenario.population is None:
        return None
    shared = shared_prefix_tokens(pool)
    return ClosedPopulation(scenario.population.agents, pool, random.Random(seed * 7919 + 5),
                            lambda sid, s, t: to_spec(sid, s, t, shared), think_time_s=scenario.population.think_s,
                            stop_s=stop_s)


def policy_context(spec: RunSpec) -> PolicyContext:
    """What the run's policy is told."""
    return PolicyContext(spec.deployment, spec.predicted_peak_tokens, spec.reservation_scale,
                         calibration=spec.calibration, pin_ttl_s=spec.pin_ttl_s,
                         reservation_multipliers=spec.reservation_multipliers, revisions=spec.revisions,
                         policy_overrides=spec.policy_overrides, latency_gate=spec.latency_gate,
                         task_memory=spec.task_memory)


class ArrivalFeed:
    """Hands the engine its open arrivals one step ahead of its clock, so its event heap holds only the
    sessions due soon (a heap of every future arrival makes each event cost more as the run grows)."""

    def __init__(self, engine: Engine, sessions: Sequence[SessionSpec]) -> None:
        self.engine = engine
        self._sessions = sessions  # in arrival order
        self._next = 0

    @property
    def is_done(self) -> bool:
        """True once every session has been added."""
        return self._next == len(self._sessions)

    def add_until(self, until_s: float) -> None:
        """Add every session arriving at or before `until_s` not added yet."""
        sessions, engine = self._sessions, self.engine
        while self._next < len(sessions) and sessions[self._next].arrival_s <= until_s:
            engine.add(sessions[self._next])
            self._next += 1


def advance(engine: Engine, until_s: float, step_s: float, progress: ProgressCallback | None = None,
            feed: ArrivalFeed | None = None) -> None:
    """Run the engine to `until_s` in steps of `step_s`, feeding it arrivals one step ahead."""
    while engine.now < until_s:
        step_end_s = min(engine.now + step_s, until_s)
        if feed is not None:
            feed.add_until(step_end_s)
        engine.run_until(step_end_s)
        if progress is not None:
            progress(engine.now)


def _outcome(run: SessionRun, unloaded_s: float | None) -> SessionOutcome:
    spec = run.spec
    return SessionOutcome(spec.session_id, spec.arrival_s, run.ended_s, run.status.value, unloaded_s,
                          run.steps, run.good_steps, spec.is_burst, run.first_token_s)

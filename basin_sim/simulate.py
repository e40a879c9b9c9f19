# One run of a scenario on a deployment under a policy, and its summary.
#
# Rules:
# - Arrivals stop at `duration_s`. The run then goes on (no new arrivals) until every session that
#   arrived in the goodput window has finished or passed its deadline (arrival + 4 x unloaded time),
#   so late arrivals are judged fairly; `max_drain_s` caps that tail.
# - Unloaded times are computed for every non-burst session (memoized per base session), so goodput
#   can be read for any window; the summary's goodput uses the `post` window.
# - The summary is plain JSON types and depends only on the inputs: same inputs, same summary.
#   Hit rates are token-weighted over whole timeline bins: `pre` [warmup, first disturbance), `surge`
#   (the disturbance), `post` [window start, duration), `last` (the last quarter of `post`).
#   `collapse_after_s`: from the disturbance's start to the first minute with a hit rate below 0.5;
#   `recovered_after_s`: from its end until no minute before the end of arrivals is below 0.8 (None:
#   never recovered). A steady run measures both from the start of the goodput window.
#   `prefill_share`: by prefill index, its share of all calls the prefill router sent (whole run).
# No I/O: progress is reported through a callback with the simulated time.
"""Run a scenario end to end and summarize it (goodput, hit rates, TTFT, live sessions)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from basin_runtime.policy.calibrated import Calibration
from basin_runtime.session_table import Session
from basin_sim.engine import Engine
from basin_sim.goodput import SLOWDOWN_LIMIT, SessionOutcome, goodput
from basin_sim.lifecycle import SessionRun, SessionSpec
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.profile import Deployment
from basin_sim.timeline import Timeline
from basin_sim.unloaded import UnloadedTimes
from basin_sim.workload.scenarios import Scenario, generate_sessions

ProgressCallback = Callable[[float], None]


@dataclass(frozen=True)
class RunSpec:
    """Everything one run depends on (besides the session pool)."""

    scenario: Scenario
    deployment: Deployment
    policy_name: str
    seed: int
    overload_rate_per_s: float  # the deployment's measured overload rate; base rate = load_fraction x this
    tick_s: float = 10.0
    bin_s: float = 60.0
    step_s: float = 60.0  # how often the progress callback is called (simulated seconds)
    max_drain_s: float = 3 * 3600.0
    predicted_peak_tokens: Mapping[str, float] = field(default_factory=dict)  # pool session id -> peak (basin)
    reservation_scale: float = 1.0  # basin: reserve this multiple of each predicted peak
    calibration: Calibration | None = None  # basin: what the operator measured; None: knee = capacity
    pin_ttl_s: float | None = None  # continuum TTL; None: the p90 of the run's tool gaps

    @property
    def base_rate_per_s(self) -> float:
        """Arrival rate outside surges."""
        return self.scenario.load_fraction * self.overload_rate_per_s


@dataclass(frozen=True)
class RunResult:
    """A run's spec, summary, timeline and per-session outcomes."""

    spec: RunSpec
    summary: dict[str, Any]
    timeline: Timeline
    outcomes: tuple[SessionOutcome, ...]


def run_scenario(spec: RunSpec, pool: Sequence[Session], progress: ProgressCallback | None = None,
                 unloaded: UnloadedTimes | None = None) -> RunResult:
    """Simulate one scenario run."""
    scenario = spec.scenario
    sessions = generate_sessions(scenario, pool, spec.base_rate_per_s, spec.seed)
    unloaded = unloaded if unloaded is not None and unloaded.deployment == spec.deployment \
        else UnloadedTimes(spec.deployment)
    unloaded_s = {s.session_id: unloaded.of(s) for s in sessions if not s.is_burst}
    in_window = {s.session_id: unloaded_s[s.session_id] for s in sessions
                 if not s.is_burst and scenario.window_start_s <= s.arrival_s < scenario.duration_s}
    timeline = Timeline(spec.bin_s)
    engine = Engine(spec.deployment, make_policy(spec.policy_name, policy_context(spec, sessions)),
                    timeline=timeline, tick_s=spec.tick_s)
    for session in sessions:
        engine.add(session)
    if scenario.burst is not None and scenario.burst.kill:
        engine.kill_at(scenario.burst.end_s, [s.session_id for s in sessions if s.is_burst])
    _advance(engine, scenario.duration_s, spec.step_s, progress)
    deadlines = {sid: engine.runs[sid].spec.arrival_s + SLOWDOWN_LIMIT * t for sid, t in in_window.items()}
    stop_s = min(max(deadlines.values(), default=scenario.duration_s), scenario.duration_s + spec.max_drain_s)
    pending = [sid for sid in deadlines if not engine.runs[sid].is_over]
    while pending and engine.now < stop_s:
        _advance(engine, min(engine.now + spec.step_s, stop_s), spec.step_s, progress)
        pending = [sid for sid in pending if not engine.runs[sid].is_over and deadlines[sid] >= engine.now]
    outcomes = tuple(_outcome(run, unloaded_s.get(sid)) for sid, run in engine.runs.items())
    return RunResult(spec, summarize(spec, engine, outcomes, len(pool)), timeline, outcomes)


def tool_gap_quantile_s(sessions: Sequence[SessionSpec], q: int = 90) -> float | None:
    """The q-th percentile of the tool gaps of these sessions (None: no gaps)."""
    gaps = [g for s in sessions for g in s.gaps_s]
    return _percentile(gaps, q)


def policy_context(spec: RunSpec, sessions: Sequence[SessionSpec]) -> PolicyContext:
    """What the run's policy is told (Continuum's TTL: the p90 of the tool gaps unless set)."""
    ttl = spec.pin_ttl_s if spec.pin_ttl_s is not None else tool_gap_quantile_s(sessions)
    return PolicyContext(spec.deployment, spec.predicted_peak_tokens, spec.reservation_scale,
                         calibration=spec.calibration, pin_ttl_s=ttl if ttl is None or ttl > 0 else None)


def _advance(engine: Engine, until_s: float, step_s: float, progress: ProgressCallback | None) -> None:
    while engine.now < until_s:
        engine.run_until(min(engine.now + step_s, until_s))
        if progress is not None:
            progress(engine.now)


def _outcome(run: SessionRun, unloaded_s: float | None) -> SessionOutcome:
    spec = run.spec
    return SessionOutcome(spec.session_id, spec.arrival_s, run.ended_s, run.status.value, unloaded_s,
                          run.steps, run.good_steps, spec.is_burst)


def _shares(counts: Sequence[int]) -> list[float] | None:
    """Each count's share of the total, by index (None: nothing counted)."""
    total = sum(counts)
    return None if total == 0 else [count / total for count in counts]


def _percentile(values: Sequence[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(spec: RunSpec, engine: Engine, outcomes: Sequence[SessionOutcome], pool_size: int) -> dict[str, Any]:
    """The one-line JSON summary of a run."""
    scenario, timeline = spec.scenario, engine.timeline
    pre, post = (scenario.warmup_s, scenario.pre_end_s), (scenario.window_start_s, scenario.duration_s)
    last = (post[1] - (post[1] - post[0]) / 4, post[1])
    result = goodput(outcomes, *post)
    statuses = [o.status for o in outcomes]
    summary: dict[str, Any] = {
        "scenario": scenario.name, "deployment": spec.deployment.name, "cache": spec.deployment.cache_kind,
        "policy": spec.policy_name, "seed": spec.seed, "pool_sessions": pool_size,
        "base_rate_per_s": spec.base_rate_per_s, "overload_rate_per_s": spec.overload_rate_per_s,
        "goodput_per_hour": result.per_hour, "sessions_arrived": result.arrived, "sessions_good": result.good,
        "sessions_finished": result.finished, "sessions_total": len(outcomes),
        "sessions_killed": statuses.count("killed"), "sessions_aborted": statuses.count("aborted"),
        "sessions_shed": statuses.count("shed"),
        "hit_rate_pre": timeline.hit_rate(*pre), "hit_rate_surge": timeline.hit_rate(scenario.pre_end_s, post[0]),
        "hit_rate_post": timeline.hit_rate(*post), "hit_rate_last": timeline.hit_rate(*last),
        "ttft_p50_pre_s": _percentile(timeline.ttfts(*pre), 50),
        "ttft_p50_post_s": _percentile(timeline.ttfts(*post), 50),
        "ttft_p90_post_s": _percentile(timeline.ttfts(*post), 90),
        "live_sessions_pre": timeline.mean_sample("live_sessions", *pre),
        "live_sessions_post": timeline.mean_sample("live_sessions", *post),
        "working_set_pre_tokens": timeline.mean_sample("working_set_tokens", *pre),
        "working_set_post_tokens": timeline.mean_sample("working_set_tokens", *post),
        "cache_tokens": spec.deployment.prefill_cache_tokens * spec.deployment.num_prefill,
        "host_cache_tokens": spec.deployment.host_cache_tokens * spec.deployment.num_prefill,
        "simulated_s": engine.now,
        "written_back_tokens": sum(p.written_back_tokens for p in engine.prefill),
        "prefill_share": _shares(engine.prefill_router.num_routed),
        "reservation_scale": spec.reservation_scale,
        "knee_tokens": None if spec.calibration is None else spec.calibration.knee_tokens,
        "reservation_ratio": 1.0 if spec.calibration is None else spec.calibration.reservation_ratio,
    }
    summary.update(_collapse(timeline, scenario))
    return summary


COLLAPSED_HIT_RATE = 0.5  # a minute with a hit rate below this is a collapsed minute
RECOVERED_HIT_RATE = 0.8  # recovered once no minute falls below this until the end of arrivals


def _collapse(timeline: Timeline, scenario: Scenario) -> dict[str, float | None]:
    """Seconds from the disturbance's start to the first collapsed minute, and from its end to recovery."""
    start, end = scenario.pre_end_s, scenario.window_start_s
    collapsed = timeline.first_collapse_s(COLLAPSED_HIT_RATE, start, scenario.duration_s)
    recovered = timeline.recovered_s(RECOVERED_HIT_RATE, end, scenario.duration_s)
    return {"collapse_after_s": None if collapsed is None else collapsed - start,
            "recovered_after_s": None if recovered is None else recovered - end}

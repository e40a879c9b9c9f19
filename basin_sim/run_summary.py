"""The run's one-line JSON: what a user compares across policies, seeds and deployments.

Goodput, hit rates, waits, recovery, the per-minute timeline, prefill shares.

Rules:
- Times in the summary are scenario times (0 = end of warm-up); warm-up is in no metric and no
  timeline entry. Hit rates are (device + host + storage hit tokens) / prompt tokens over whole
  minutes, as SGLang counts prefill hits (timeline.py).
- `hit_rate_pre` over [0, first rate change or burst); `hit_rate_post` over the goodput window.
- Window sessions: non-burst sessions arriving in the goodput window. `sessions_arrived`,
  `sessions_good`, `sessions_shed`, `sessions_abandoned` count them; goodput per hour of window;
  `shed_share` = shed / window sessions (0 with none), reported beside every goodput.
- `first_call_wait_p50_s`: the median over window sessions of arrival -> first token of call 1; a
  session shed or abandoned before that counts until it was shed or gave up; one still waiting
  when the run stopped counts until then.
- `prefill_busy_fraction`: the prefill instances' batch time over the goodput window, per instance.
- `recovered_after_s`: seconds from the last rate change or burst end to the start of the first
  minute from which every later minute's hit rate (up to the end of arrivals) is within
  RECOVERY_TOLERANCE of `hit_rate_pre`; null if none. `is_stuck` (issue 44's definition): the hit rate
  over the window's last STUCK_MINUTES minutes (token-weighted, as one window) is under STUCK_CEILING
  and more than STUCK_DROP below `hit_rate_pre` (one minute alone is too noisy at a few sessions a
  minute).
- `backlog_drained_after_s`: the backlog of a minute is the sessions held at the door plus the calls
  queued for prefill at its end; seconds from the last rate change or burst end to the start of the
  first minute from which every later minute's backlog (up to the end of arrivals) is at most the
  largest backlog of the `pre` window; null if none (0 when nothing ever piled up past it).
- `timeline`: one entry per simulated minute after warm-up (t_s its start), states read at the
  minute's end, counts over the minute (`retries`: attempts after a call's first); `ttft_p50_s` is
  from a call's first send, so a call retried after a timeout counts its whole wait;
  `first_call_wait_p50_s` is the median first-call wait (as below) of the regular sessions that
  arrived in that minute, by arrival minute (null when none arrived), so a wait paid minutes after a
  surge shows at the minute its sessions came.
- `prefill_share`: by prefill index, its share of the requests the prefill router sent (attempts).
- Pins between calls (Continuum): `held_tokens_mean`, the device tokens held for a TTL after an answer
  (not those held while the call decodes) averaged over the goodput window's ticks, and
  `held_cache_share`, that over the prefill caches' capacity; the policy's `PinReport` (`PIN_KEYS`:
  answers, the share pinned, the mean TTL, the share of tool time pinned, the mean T the choices
  read, eta at the end, evicted re-entries measured), None for a policy that never pins; Continuum's
  public code (`continuum-fixed-ttl`) adds its `FixedTtlReport` (the share of answers skipped for a
  slow tool, the mean time a pin was held), keys written after `timeline` and absent for every other
  policy.
- Session radix cache (`session_radix_cache` false | faithful | true, radix_cache.py): with the key on,
  `session_cache` (`SessionCacheReport`) says what it did, summed over the prefill instances and the
  whole run: the mode, references taken (normal finishes that registered), sessions closed, late
  finishes of closed sessions (no reference taken), device tokens evicted while referenced and
  unreferenced, and the referenced share of them (null without evictions). With the key off the key
  is absent, so every earlier run's JSON is unchanged.
- Pauses (ThunderAgent): the policy's `PauseReport` (pauses, marks, new programs held, resumes,
  forced resumes, soft-demote windows, programs paused or held and their time so, in all and the mean),
  its keys written only for a policy that pauses (every other policy's JSON keeps its keys as before).
- Admission window (Concur): the policy's `AdmissionReport` (the window's min, mean and max over its
  per-minute series, the series itself by engine minute, warm-up included, increases, decreases, sessions
  deferred at the door and their wait there, in all and the mean), keys written after `session_cache`
  and only for a policy with a window (every other policy's JSON keeps its keys as before).
- Recovery (Basin with its recovery on, basin mode): the policy's `RecoveryReport` (holds at tool
  boundaries, sessions ever held, resumes and of them those the bound forced, sheds after a hold, the time
  held in all and the mean per hold ended), keys written last and only for such a run (every other
  policy's JSON keeps its keys as before).
- Memory of finished tasks (Basin with the memory on): `TaskMemoryReport` (sessions told a peak, memory
  hits), keys written last and only with the memory on (every other run's JSON keeps its keys as before).
- A run's summary is a frozen `RunSummary`; `to_json` is the one place it becomes the JSON object the
  CLI prints and the golden files hold (a policy without a reservation report shows its two counts as
  null; one that never pins, every pin key as null).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from basin_sim.engine import Engine
from basin_sim.goodput import Goodput, SessionOutcome, goodput
from basin_sim.policies.base import (
    AdmissionReport,
    FixedTtlReport,
    PauseReport,
    PinReport,
    RecoveryReport,
    ReservationReport,
    TaskMemoryReport,
)
from basin_sim.run_spec import RunSpec
from basin_sim.timeline import Timeline

RECOVERY_TOLERANCE = 0.05
STUCK_MINUTES = 20
STUCK_DROP = 0.3
STUCK_CEILING = 0.6
PIN_KEYS = tuple(f.name for f in dataclasses.fields(PinReport))  # null for a policy that never pins
FIXED_TTL_KEYS = tuple(f.name for f in dataclasses.fields(FixedTtlReport))  # absent but for continuum-fixed-ttl


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class SessionCacheReport:
    """What SGLang's session-aware radix cache did over a run (all prefill instances)."""

    mode: str  # "faithful" (as SGLang's PD prefill runs it: no reference) or "true" (intended, hypothetical)
    references_taken: int
    sessions_closed: int
    late_finishes_ignored: int
    evicted_referenced_tokens: int
    evicted_unreferenced_tokens: int
    evicted_referenced_share: float | None

    @classmethod
    def of(cls, engine: Engine) -> SessionCacheReport | None:
        """The report of a run with the key on; None with it off."""
        mode = engine.deployment.session_radix_cache
        if mode is False:
            return None
        caches = [p.cache for p in engine.prefill]
        referenced = sum(c.evicted_referenced_tokens for c in caches)
        evicted = sum(c.evicted_tokens for c in caches)
        return cls(mode="true" if mode is True else str(mode),
                   references_taken=sum(c.references_taken for c in caches),
                   sessions_closed=sum(c.sessions_closed for c in caches),
                   late_finishes_ignored=sum(c.late_finishes for c in caches),
                   evicted_referenced_tokens=referenced, evicted_unreferenced_tokens=evicted - referenced,
                   evicted_referenced_share=referenced / evicted if evicted else None)


@dataclass(frozen=True)
class RunSummary:
    """What a user compares across policies, seeds and deployments (see the rules above); JSON by `to_json`."""

    scenario: str
    deployment: str
    cache: str
    lending: str
    policy: str
    seed: int
    pool_sessions: int
    base_rate_per_s: float
    overload_rate_per_s: float
    goodput: Goodput  # JSON: goodput_per_hour, sessions_arrived, sessions_good
    sessions_shed: int
    sessions_abandoned: int
    shed_share: float
    sessions_killed: int
    hit_rate_pre: float | None
    hit_rate_post: float | None
    first_call_wait_p50_s: float | None
    ttft_p50_post_s: float | None
    prefill_busy_fraction: float
    recovered_after_s: float | None
    is_stuck: bool
    backlog_drained_after_s: float | None
    cache_tokens: int
    simulated_s: float
    written_back_tokens: int
    prefill_share: tuple[float, ...] | None
    timeouts: int
    retries: int
    suspensions: int
    reservation_scale: float
    reservation_quantile: float | None
    knee_tokens: float | None
    reservation_ratio: float
    reservations: ReservationReport | None  # Basin's; None for every other policy
    held_tokens_mean: float | None
    held_cache_share: float | None
    pins: PinReport | None  # Continuum's; None for a policy that never pins
    pauses: PauseReport | None  # ThunderAgent's; None (no keys written) for a policy that never pauses
    timeline: tuple[dict[str, Any], ...]
    fixed_ttl: FixedTtlReport | None = None  # Continuum's public code only; its keys are absent otherwise
    session_cache: SessionCacheReport | None = None  # absent from the JSON with the key off
    admission: AdmissionReport | None = None  # Concur's; its keys are absent for every other policy
    recovery: RecoveryReport | None = None  # Basin's recovery; its keys are absent for every other policy
    task_memory: TaskMemoryReport | None = None  # Basin's with the memory on; its keys are absent otherwise

    @property
    def goodput_per_hour(self) -> float:
        """Good sessions per hour of the goodput window."""
        return self.goodput.per_hour

    def to_json(self) -> dict[str, Any]:
        """The run's JSON object, keys in the order they were always written."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "goodput":
                out.update(goodput_per_hour=value.per_hour, sessions_arrived=value.arrived, sessions_good=value.good)
            elif f.name == "reservations":
                out.update({"sessions_admitted": None, "sessions_overflowed": None} if value is None
                           else dataclasses.asdict(value))
            elif f.name == "session_cache":
                if value is not None:
                    out[f.name] = dataclasses.asdict(value)
            elif f.name == "pins":
                out.update(dict.fromkeys(PIN_KEYS) if value is None else dataclasses.asdict(value))
            elif f.name == "fixed_ttl":
                if value is not None:
                    out.update(dataclasses.asdict(value))
            elif f.name in ("pauses", "admission", "recovery", "task_memory"):
                out.update({} if value is None else _listed(dataclasses.asdict(value)))
            elif isinstance(value, tuple):
                out[f.name] = list(value)
            else:
                out[f.name] = value
        return out


def summarize(spec: RunSpec, engine: Engine, outcomes: Sequence[SessionOutcome], pool_size: int) -> RunSummary:
    """The summary of a run."""
    scenario, timeline = spec.scenario, engine.timeline
    at = scenario.engine_s
    window = (at(scenario.goodput_from_s), at(scenario.goodput_to_s))
    in_window = [o for o in outcomes if not o.is_burst and window[0] <= o.arrival_s < window[1]]
    shed = sum(o.status == "shed" for o in in_window)
    hit_pre = timeline.hit_rate(at(0.0), at(scenario.pre_end_s))
    cache_tokens = spec.deployment.cache_capacity_tokens
    held = timeline.mean_sample("cache_held_tokens", *window)
    minutes = minute_timeline(spec, engine, outcomes)
    report = engine.policy.report()
    shares = _shares(engine.prefill_router.num_routed)
    return RunSummary(
        scenario=scenario.name, deployment=spec.deployment.name, cache=spec.deployment.cache_kind,
        lending=spec.deployment.lending, policy=spec.policy_name, seed=spec.seed, pool_sessions=pool_size,
        base_rate_per_s=spec.base_rate_per_s, overload_rate_per_s=spec.overload_rate_per_s,
        goodput=goodput(outcomes, *window), sessions_shed=shed,
        sessions_abandoned=sum(o.status == "abandoned" for o in in_window),
        shed_share=shed / len(in_window) if in_window else 0.0,
        sessions_killed=sum(o.status == "killed" for o in outcomes),
        hit_rate_pre=hit_pre, hit_rate_post=timeline.hit_rate(*window),
        first_call_wait_p50_s=_first_call_wait_p50_s(in_window, engine.now),
        ttft_p50_post_s=_median(timeline.ttfts(*window)),
        prefill_busy_fraction=sum(p.busy_s(*window) for p in engine.prefill)
        / ((window[1] - window[0]) * len(engine.prefill)),
        recovered_after_s=_recovered_after_s(timeline, spec, hit_pre),
        is_stuck=_is_stuck(timeline, window, hit_pre),
        backlog_drained_after_s=_backlog_drained_after_s(minutes, spec),
        cache_tokens=cache_tokens, simulated_s=engine.now - scenario.warmup_s,
        written_back_tokens=sum(p.written_back_tokens for p in engine.prefill),
        prefill_share=None if shares is None else tuple(shares),
        timeouts=sum(timeline.count_series("timeouts")), retries=sum(timeline.count_series("retries")),
        suspensions=engine.suspensions,
        reservation_scale=spec.reservation_scale, reservation_quantile=spec.reservation_quantile,
        knee_tokens=None if spec.calibration is None else spec.calibration.knee_tokens,
        reservation_ratio=1.0 if spec.calibration is None else spec.calibration.reservation_ratio,
        reservations=report.reservations, held_tokens_mean=held,
        held_cache_share=None if held is None else held / cache_tokens, pins=report.pins, pauses=report.pauses,
        timeline=tuple(minutes), fixed_ttl=report.fixed_ttl, session_cache=SessionCacheReport.of(engine),
        admission=report.admission, recovery=report.recovery, task_memory=report.task_memory)


def _listed(fields: dict[str, Any]) -> dict[str, Any]:
    """A report's fields with its tuples as JSON lists."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def _recovered_after_s(timeline: Timeline, spec: RunSpec, hit_pre: float | None) -> float | None:
    scenario = spec.scenario
    if hit_pre is None:
        return None
    change, end = scenario.engine_s(scenario.last_change_s), scenario.engine_s(scenario.duration_s)
    bins = timeline.bin_hit_rates(change, end)
    recovered: float | None = None
    for time_s, rate in bins:
        is_near = rate is None or abs(rate - hit_pre) <= RECOVERY_TOLERANCE
        if not is_near:
            recovered = None
        elif recovered is None:
            recovered = time_s
    return None if recovered is None else recovered - change


def _is_stuck(timeline: Timeline, window: tuple[float, float], hit_pre: float | None) -> bool:
    if hit_pre is None:
        return False
    start = max(window[0], window[1] - STUCK_MINUTES * 60.0)
    rate = timeline.hit_rate(start, window[1])
    return rate is not None and rate < min(STUCK_CEILING, hit_pre - STUCK_DROP)


def _backlog_drained_after_s(entries: Sequence[dict[str, Any]], spec: RunSpec) -> float | None:
    scenario = spec.scenario
    backlog = [(e["t_s"], e["held_sessions"] + e["queued"]) for e in entries if e["t_s"] < scenario.duration_s]
    pre = [b for t, b in backlog if t < scenario.pre_end_s]
    if not pre:
        return None
    ceiling, drained = max(pre), None
    for t, b in backlog:
        if t < scenario.last_change_s:
            continue
        if b > ceiling:
            drained = None
        elif drained is None:
            drained = t
    return None if drained is None else drained - scenario.last_change_s


def _waits_by_minute(outcomes: Sequence[SessionOutcome], end_s: float, bin_s: float) -> dict[int, float | None]:
    """Median first-call wait of the regular sessions arriving in each minute (engine-time bin index)."""
    by_bin: dict[int, list[SessionOutcome]] = {}
    for o in outcomes:
        if not o.is_burst:
            by_bin.setdefault(int(o.arrival_s // bin_s), []).append(o)
    return {k: _first_call_wait_p50_s(group, end_s) for k, group in by_bin.items()}


def minute_timeline(spec: RunSpec, engine: Engine, outcomes: Sequence[SessionOutcome] = ()) -> list[dict[str, Any]]:
    """One entry per simulated minute after warm-up (see the rules above)."""
    timeline, warmup = engine.timeline, spec.scenario.warmup_s
    waits = _waits_by_minute(outcomes, engine.now, timeline.bin_s)
    cache_tokens = spec.deployment.cache_capacity_tokens
    first = round(warmup / timeline.bin_s)
    counts = {name: timeline.count_series(name) for name in ("arrivals", "completions", "timeouts", "retries")}
    states = {name: timeline.bin_state_series(name) for name in
              ("live_sessions", "live_burst_sessions", "held_sessions", "working_set_tokens", "prefill_queued")}
    entries = []
    for k in range(first, len(timeline.bin_states)):
        start = k * timeline.bin_s
        entry: dict[str, Any] = {"t_s": start - warmup, "hit_rate": timeline.hit_rate(start, start + timeline.bin_s)}
        entry.update({name: int(series[k]) for name, series in states.items()})
        entry["queued"] = entry.pop("prefill_queued")
        entry["cache_tokens"] = cache_tokens
        entry["ttft_p50_s"] = _median(timeline.ttfts(start, start + timeline.bin_s))
        entry["first_call_wait_p50_s"] = waits.get(k)
        entry.update({name: _at(series, k) for name, series in counts.items()})
        entries.append(entry)
    return entries


def _at(series: Sequence[int], index: int) -> int:
    return series[index] if index < len(series) else 0


def _first_call_wait_p50_s(outcomes: Sequence[SessionOutcome], end_s: float) -> float | None:
    """Median of arrival -> first token of call 1 (until shed, given up or the run's end without one)."""
    waits = []
    for o in outcomes:
        until = o.first_token_s if o.first_token_s is not None else (o.ended_s if o.ended_s is not None else end_s)
        waits.append(until - o.arrival_s)
    return _median(waits)


def _shares(counts: Sequence[int]) -> list[float] | None:
    """Each count's share of the total, by index (None: nothing counted)."""
    total = sum(counts)
    return None if total == 0 else [count / total for count in counts]

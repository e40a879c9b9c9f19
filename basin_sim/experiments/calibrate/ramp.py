"""A stepped load ramp on the simulator: steady arrivals at rising rates under plain SGLang, one point per step.

Rules:
- Each step is long enough to settle; no admission control. Per step, over its second half: mean
  working set / cache capacity, token-weighted hit rate, mean live sessions, calls completed per
  second (first tokens seen), decode memory in use / all decode memory, requests waiting for decode
  memory (the pre-allocation queue, retracted requests too), and the decode holding share: requests
  holding decode memory (stage past the pre-allocation queue: waiting for or under prefill,
  transferring, decoding) / live sessions, counted every `sample_s`.
- The knee (knee.py) and X(N) for the fluid model (fluid.py) are read off these points; so is the
  completion peak (completion_peak.py: the working set at which calls completed per second stop
  rising beyond the step-to-step noise, each step's noise the standard error of its per-minute rates).
- With reservations (pool session id -> the tokens Basin would reserve for it: scale x predicted
  peak), each step also records the reservation ratio: sum over live sessions of max(reservation,
  context) / sum of their contexts, sampled every `sample_s` of the step's second half. It converts
  the knee (a working set) into the unit Basin's admission sums (reservations).
- Which limit a ramp hits first (`ramp_limits`): cache, the first step off the hit-rate plateau
  (knee.py's detection, `first_off_index`); decode, the first step whose decode memory is >=
  DECODE_FULL_SHARE in use, or whose pre-allocation queue holds >= QUEUED_PER_DECODE requests per
  decode instance on average (SGLang's admission keeps memory in use a few percent below 100%, so
  95% is reached only when admission is blocked). The earlier step wins; in the same step, the
  earlier minute in which the condition holds for two minutes in a row (the knee's `confirm`);
  still tied: `decode` (cache-first must be shown); neither: `none`.
- No I/O.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from basin_runtime.session_table import Session
from basin_sim.engine import Engine
from basin_sim.experiments.calibrate.completion_peak import CompletionPeak, find_completion_peak, rate_standard_error
from basin_sim.experiments.calibrate.knee import Knee, find_knee
from basin_sim.lifecycle import SessionRun, Stage, Status
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.profile import Deployment
from basin_sim.timeline import Timeline
from basin_sim.workload.scenarios import shared_prefix_tokens, to_spec


@dataclass(frozen=True)
class RampStep:
    """What one step of the ramp settled at."""

    rate_per_s: float
    load: float  # mean working set / cache capacity
    hit_rate: float
    live_sessions: float
    calls_per_s: float
    sessions_finished_per_s: float
    decode_busy_share: float  # mean decoding requests / mean live sessions
    reservation_ratio: float | None = None  # sum of max(reservation, context) / sum of context, live sessions
    decode_memory_share: float = 0.0  # mean decode memory in use / all decode memory
    prealloc_queued: float = 0.0  # mean requests waiting for decode memory (all decode instances)
    decode_holding_share: float | None = None  # mean requests holding decode memory / mean live (None: unmeasured)
    ttft_p50_s: float | None = None  # median time to first token of the calls in the step's second half
    call_cycle_p50_s: float | None = None  # median over sessions finished then of their duration / their calls
    calls_per_s_se: float | None = None  # standard error of calls_per_s from its per-minute rates (completion_peak.py)


HOLDING_STAGES = frozenset({Stage.PREFILL_WAIT, Stage.PREFILLING, Stage.TRANSFER, Stage.DECODING})
DECODE_FULL_SHARE = 0.95
QUEUED_PER_DECODE = 1.0
LIMITS = ("cache", "decode", "none")


def run_ramp(deployment: Deployment, pool: Sequence[Session], rates_per_s: Sequence[float], step_s: float,
             seed: int = 1, reservations: Mapping[str, float] | None = None, sample_s: float = 60.0,
             timeline: Timeline | None = None,
             revised: Mapping[str, Mapping[int, float]] | None = None) -> list[RampStep]:
    """Run the rates one after another on one engine; one `RampStep` per rate (into `timeline` if given).
    `revised` (pool session id -> call k -> what it reserves from call k on): the reservation a run holds
    follows its calls, as Basin's revisions move it (`held_reservation`)."""
    policy = "hicache" if deployment.has_host_tier else "sglang"
    timeline = Timeline(60.0) if timeline is None else timeline
    engine = Engine(deployment, make_policy(policy, PolicyContext(deployment)), timeline=timeline)
    shared = shared_prefix_tokens(pool)
    rng = random.Random(seed)
    capacity = deployment.cache_capacity_tokens
    decode_tokens = deployment.decode_capacity_tokens
    steps: list[RampStep] = []
    count = 0
    reserved: dict[str, tuple[float, Mapping[int, float]]] = {}  # run id -> its reservation, its revisions
    for k, rate in enumerate(rates_per_s):
        start, end = k * step_s, (k + 1) * step_s
        t = start + rng.expovariate(rate)
        while t < end:
            session = pool[rng.randrange(len(pool))]
            engine.add(to_spec(f"{count:06d}:r", session, t, shared))
            if reservations is not None:
                reserved[f"{count:06d}:r"] = (reservations[session.session_id],
                                              (revised or {}).get(session.session_id, {}))
            count += 1
            t += rng.expovariate(rate)
        half = start + step_s / 2
        engine.run_until(half)
        sampled = _sample_second_half(engine, reserved if reservations is not None else None, half, end, sample_s)
        ended = [r for r in engine.runs.values() if r.ended_s is not None and half <= r.ended_s < end]
        finished = len(ended)
        cycles = [(r.ended_s - r.spec.arrival_s) / r.spec.session.n_calls for r in ended
                  if r.ended_s is not None and r.status is Status.FINISHED]
        hit = timeline.hit_rate(half, end)
        live = timeline.mean_sample("live_sessions", half, end) or 0.0
        decoding = timeline.mean_sample("decode_running", half, end) or 0.0
        ttfts = timeline.ttfts(half, end)
        in_use = timeline.mean_sample("decode_reserved_tokens", half, end) or 0.0
        steps.append(RampStep(rate, (timeline.mean_sample("working_set_tokens", half, end) or 0.0) / capacity,
                              0.0 if hit is None else hit, live, len(ttfts) / (end - half),
                              finished / (end - half), decoding / live if live > 0 else 0.0, sampled.ratio,
                              in_use / decode_tokens, timeline.mean_sample("decode_queued", half, end) or 0.0,
                              sampled.holding_share, statistics.median(ttfts) if ttfts else None,
                              statistics.median(cycles) if cycles else None,
                              rate_standard_error(timeline.ttft_time_s, half, end)))
    return steps


@dataclass(frozen=True)
class _Sampled:
    holding_share: float | None  # requests holding decode memory / live sessions, over the samples
    ratio: float | None  # the reservation ratio (None without reservations)


def held_reservation(first: float, revised: Mapping[int, float], run: SessionRun) -> float:
    """What a run reserves now: its latest revision at a call it has sent (calls sent: `next_call`, plus the one
    in flight), else its first reservation."""
    if not revised:
        return first
    sent = run.next_call + (1 if run.request is not None else 0)
    slots = [k for k in revised if k <= sent]
    return revised[max(slots)] if slots else first


def _sample_second_half(engine: Engine, reserved: Mapping[str, tuple[float, Mapping[int, float]]] | None,
                        start: float, end: float, sample_s: float) -> _Sampled:
    """Run the engine from `start` to `end`, counting every `sample_s` the live runs, those holding decode
    memory and, with reservations, sum(max(reservation, context)) / sum(context)."""
    held = contexts = 0.0
    live = holding = 0
    t = start
    while t < end:
        t = min(t + sample_s, end)
        engine.run_until(t)
        for run in engine.runs.values():
            if run.status is not Status.LIVE:
                continue
            live += 1
            holding += run.request is not None and run.request.stage in HOLDING_STAGES
            if reserved is not None and run.context_tokens > 0:
                held += max(held_reservation(*reserved[run.spec.session_id], run), run.context_tokens)
                contexts += run.context_tokens
    return _Sampled(holding / live if live else None, held / contexts if contexts > 0 else None)


def calibration_record(steps: Sequence[RampStep], capacity_tokens: float, source: str) -> dict[str, Any]:
    """The gateway's calibration file (basin_runtime/gateway/calibration.py keys only) from a ramp's steps:
    the knee, the plateau hit rate, the best completion rate on the plateau, the plateau's median time to
    first token and call cycle (a session's duration over its calls), the completion peak (working-set
    tokens at which calls completed per second stop rising) and, when measured, the reservation
    ratio; `source` says how the ramp was run (the notes)."""
    knee = ramp_knee(steps)
    plateau = [s for s in steps if s.load <= knee.load]
    peak_rate = max((s.sessions_finished_per_s for s in plateau), default=0.0)
    record: dict[str, Any] = {"knee_tokens": round(knee.load * capacity_tokens),
                              "cache_capacity_tokens": round(capacity_tokens),
                              "hit_rate_plateau": round(knee.plateau_hit_rate, 4)}
    if peak_rate > 0:
        record["peak_completion_rate_per_s"] = round(peak_rate, 5)
    ratio = plateau_reservation_ratio(steps, knee)
    if ratio is not None:
        record["reservation_ratio"] = round(ratio, 4)
    peak = ramp_completion_peak(steps)
    if peak.load > 0:
        record["completion_peak_tokens"] = round(peak.load * capacity_tokens)
    ttfts = [s.ttft_p50_s for s in plateau if s.ttft_p50_s is not None]
    cycles = [s.call_cycle_p50_s for s in plateau if s.call_cycle_p50_s is not None]
    if ttfts and cycles:
        record["ttft_plateau_s"] = round(statistics.median(ttfts), 4)
        record["call_cycle_plateau_s"] = round(statistics.median(cycles), 4)
    censored = ("; knee censored: beyond the last step" if knee.is_censored else "") + \
        ("; completion peak censored: completions still rose at the last step" if peak.is_censored else "")
    record["notes"] = f"{source}{censored}"
    return record


def ramp_completion_peak(steps: Sequence[RampStep]) -> CompletionPeak:
    """Where a ramp's completed calls per second stop rising, in units of cache capacity."""
    return find_completion_peak([(s.load, s.calls_per_s, s.calls_per_s_se) for s in steps])


def plateau_reservation_ratio(steps: Sequence[RampStep], knee: Knee) -> float | None:
    """The reservation ratio on the plateau (steps up to the knee), weighted by their working sets."""
    plateau = [s for s in steps if s.load <= knee.load and s.reservation_ratio is not None] or \
        [s for s in steps[:1] if s.reservation_ratio is not None]
    weight = sum(s.load for s in plateau)
    if not plateau or weight <= 0:
        return None
    return max(1.0, sum(s.load * (s.reservation_ratio or 1.0) for s in plateau) / weight)


def ramp_knee(steps: Sequence[RampStep], tolerance: float = 0.05, confirm: int = 2) -> Knee:
    """The knee of a ramp, in units of cache capacity."""
    return find_knee([(s.load, s.hit_rate) for s in steps], tolerance, confirm)


@dataclass(frozen=True)
class RampLimits:
    """Which limit a ramp hit first, and at which steps (indices into the ramp) each was hit."""

    first_limit: str  # one of LIMITS
    cache_step: int | None
    decode_step: int | None
    knee: Knee
    is_tie_broken_by_minute: bool = False


def is_decode_full(step: RampStep, num_decode: int) -> bool:
    """Decode memory binds in this step (the thresholds in the rules above)."""
    return step.decode_memory_share >= DECODE_FULL_SHARE or step.prealloc_queued >= QUEUED_PER_DECODE * num_decode


def ramp_limits(steps: Sequence[RampStep], deployment: Deployment, timeline: Timeline | None = None,
                step_s: float | None = None, tolerance: float = 0.05, confirm: int = 2) -> RampLimits:
    """The first limit of a ramp (rules above); `timeline` and `step_s` break a same-step tie by minute."""
    knee = ramp_knee(steps, tolerance, confirm)
    cache = knee.first_off_index
    decode = next((k for k, s in enumerate(steps) if is_decode_full(s, deployment.num_decode)), None)
    if cache is None or decode is None:
        first = "none" if cache is None and decode is None else "cache" if decode is None else "decode"
        return RampLimits(first, cache, decode, knee)
    if cache != decode:
        return RampLimits("cache" if cache < decode else "decode", cache, decode, knee)
    if timeline is None or step_s is None:
        return RampLimits("decode", cache, decode, knee)
    is_cache = _cache_minute_first(timeline, deployment, cache * step_s, (cache + 1) * step_s,
                                   knee.plateau_hit_rate - tolerance, confirm)
    return RampLimits("cache" if is_cache else "decode", cache, decode, knee, is_tie_broken_by_minute=True)


def _cache_minute_first(timeline: Timeline, deployment: Deployment, start_s: float, end_s: float, floor: float,
                        confirm: int) -> bool:
    """True if, minute by minute in [start_s, end_s), the hit rate stays below `floor` (for `confirm`
    minutes) strictly before decode memory is full (for `confirm` minutes)."""
    decode_tokens = deployment.decode_capacity_tokens
    is_low, is_full = [], []
    for t, hit in timeline.bin_hit_rates(start_s, end_s):
        is_low.append(hit is not None and hit < floor)
        in_use = timeline.mean_sample("decode_reserved_tokens", t, t + timeline.bin_s) or 0.0
        queued = timeline.mean_sample("decode_queued", t, t + timeline.bin_s) or 0.0
        is_full.append(in_use / decode_tokens >= DECODE_FULL_SHARE
                       or queued >= QUEUED_PER_DECODE * deployment.num_decode)
    cache_minute, decode_minute = _first_run(is_low, confirm), _first_run(is_full, confirm)
    return cache_minute is not None and (decode_minute is None or cache_minute < decode_minute)


def _first_run(flags: Sequence[bool], length: int) -> int | None:
    """The first index from which `length` flags in a row are true (fewer at the end count), or None."""
    for i, flag in enumerate(flags):
        if flag and all(flags[i:i + length]):
            return i
    return None

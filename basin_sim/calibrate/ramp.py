# A stepped load ramp: steady arrivals at rising rates, each step long enough to settle, under plain
# SGLang (no admission control). Per step, over its second half: mean working set / cache capacity,
# token-weighted hit rate, mean live sessions, and calls completed per second (first tokens seen).
# The knee (knee.py) and X(N) for the fluid model (fluid.py) are read off these points.
# With reservations (pool session id -> the tokens Basin would reserve for it: scale x predicted
# peak), each step also records the reservation ratio: sum over live sessions of max(reservation,
# context) / sum of their contexts, sampled every `sample_s` of the step's second half. It converts
# the knee (a working set) into the unit Basin's admission sums (reservations).
# No I/O.
"""Stepped load ramp on the simulator: (load, hit rate, live sessions, calls/s) per step."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from basin_runtime.session_table import Session
from basin_sim.calibrate.knee import Knee, find_knee
from basin_sim.engine import Engine
from basin_sim.lifecycle import Status
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


def run_ramp(deployment: Deployment, pool: Sequence[Session], rates_per_s: Sequence[float], step_s: float,
             seed: int = 1, reservations: Mapping[str, float] | None = None, sample_s: float = 60.0) -> list[RampStep]:
    """Run the rates one after another on one engine; one `RampStep` per rate."""
    policy = "hicache" if deployment.has_host_tier else "sglang"
    timeline = Timeline(60.0)
    engine = Engine(deployment, make_policy(policy, PolicyContext(deployment)), timeline=timeline)
    shared = shared_prefix_tokens(pool)
    rng = random.Random(seed)
    capacity = deployment.prefill_cache_tokens * deployment.num_prefill
    steps: list[RampStep] = []
    count = 0
    reserved: dict[str, float] = {}  # run id -> its reservation
    for k, rate in enumerate(rates_per_s):
        start, end = k * step_s, (k + 1) * step_s
        t = start + rng.expovariate(rate)
        while t < end:
            session = pool[rng.randrange(len(pool))]
            engine.add(to_spec(f"{count:06d}:r", session, t, shared))
            if reservations is not None:
                reserved[f"{count:06d}:r"] = reservations[session.session_id]
            count += 1
            t += rng.expovariate(rate)
        half = start + step_s / 2
        engine.run_until(half)
        ratio = _reservation_ratio(engine, reserved, half, end, sample_s) if reservations is not None else None
        engine.run_until(end)
        finished = sum(1 for r in engine.runs.values() if r.ended_s is not None and half <= r.ended_s < end)
        hit = timeline.hit_rate(half, end)
        live = timeline.mean_sample("live_sessions", half, end) or 0.0
        decoding = timeline.mean_sample("decode_running", half, end) or 0.0
        steps.append(RampStep(rate, (timeline.mean_sample("working_set_tokens", half, end) or 0.0) / capacity,
                              0.0 if hit is None else hit, live, len(timeline.ttfts(half, end)) / (end - half),
                              finished / (end - half), decoding / live if live > 0 else 0.0, ratio))
    return steps


def _reservation_ratio(engine: Engine, reserved: Mapping[str, float], start: float, end: float,
                       sample_s: float) -> float | None:
    """Run the engine from `start` to `end`, sampling sum(max(reservation, context)) / sum(context) of live runs."""
    held = contexts = 0.0
    t = start
    while t < end:
        t = min(t + sample_s, end)
        engine.run_until(t)
        for run_id, run in engine.runs.items():
            if run.status is Status.LIVE and run.context_tokens > 0:
                held += max(reserved[run_id], run.context_tokens)
                contexts += run.context_tokens
    return held / contexts if contexts > 0 else None


def calibration_record(steps: Sequence[RampStep], capacity_tokens: float, source: str) -> dict[str, Any]:
    """The gateway's calibration file (basin_runtime/gateway/calibration.py keys only) from a ramp's steps:
    the knee, the plateau hit rate, the best completion rate on the plateau and, when measured, the
    reservation ratio; `source` says how the ramp was run (the notes)."""
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
    record["notes"] = f"{source}{'; knee censored: beyond the last step' if knee.is_censored else ''}"
    return record


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

"""A ramp at a known overload rate, and sweeps of ramps over deployments on an executor.

Ramps as `basin-sim risk|ramp` run them: one deployment or several, each ramp a job of an executor.

Rules:
- A ramp steps through `fractions` x the overload rate of its deployment's shape and workload; at least
  2 fractions, all > 0, and steps of >= 120 s (two whole minutes in each step's second half), checked
  before anything runs.
- One workload pool for every deployment of a sweep: the executor's shared input, sent to the workers
  once (executors.py).
- Rates come from the rates file. The missing ones are measured first, one job per shape (deployments
  of one shape share it), and written by this process alone: workers never touch the file (on a
  cluster they cannot see it, and two writers would race).
- Then one job per deployment: its ramp and its record (risk or ramp: the `record` function given),
  made in the worker, so the ramp's timeline stays there. Records come back in the deployments' order.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from basin_runtime.session_table import Session
from basin_sim.experiments.calibrate.overload import Calibration, find_overload_rate
from basin_sim.experiments.calibrate.ramp import RampStep, run_ramp
from basin_sim.experiments.calibrate.rates import (
    RateCache,
    overload_shape,
    rate_key,
    record_overload_rate,
    settings_for,
)
from basin_sim.experiments.executors import ExecutorSpec, Job, open_executor
from basin_sim.profile import Deployment
from basin_sim.timeline import Timeline
from basin_sim.workload.scenarios import Scenario, WorkloadSpec

log = logging.getLogger(__name__)

RecordFn = Callable[["RampRun"], dict[str, Any]]


@dataclass(frozen=True)
class RampRun:
    """A ramp as the commands ran it: the deployment, the rates, the steps and the timeline."""

    deployment: Deployment
    overload_rate_per_s: float
    overload_rate_source: str
    fractions: tuple[float, ...]
    step_s: float
    steps: list[RampStep]
    timeline: Timeline
    calls_per_session: float


class RampError(ValueError):
    """Ramp settings that cannot be run (rates, step length); the message names the option."""


def check_ramp(fractions: Sequence[float], step_s: float) -> None:
    """Raise `RampError` naming the option unless the ramp can be run (the rules above)."""
    if len(fractions) < 2 or any(not f > 0 for f in fractions):
        raise RampError(f"--fractions needs at least 2 rates > 0 (of the overload rate), got {list(fractions)}")
    if not step_s >= 120:
        raise RampError(f"--step-s must be >= 120 (two whole minutes in each step's second half), got {step_s}")


def ramp_at(deployment: Deployment, pool: Sequence[Session], rate_per_s: float, source: str,
            fractions: tuple[float, ...], step_s: float, seed: int,
            reservations: dict[str, float] | None = None,
            revised: Mapping[str, Mapping[int, float]] | None = None) -> RampRun:
    """A ramp at `fractions` x `rate_per_s` (the overload rate, from `source`) on `deployment` (reservations
    following `revised` when given: ramp.py)."""
    check_ramp(fractions, step_s)
    timeline = Timeline(60.0)
    steps = run_ramp(deployment, pool, [f * rate_per_s for f in fractions], step_s, seed, reservations,
                     timeline=timeline, revised=revised)
    calls = statistics.fmean(s.n_calls for s in pool)
    return RampRun(deployment, rate_per_s, source, fractions, step_s, steps, timeline, calls)


@dataclass(frozen=True)
class Sweep:
    """What a sweep of ramps runs: the deployments on one scenario's workload pool, and how each ramp steps."""

    deployments: tuple[Deployment, ...]
    scenario: Scenario
    pool: tuple[Session, ...]
    fractions: tuple[float, ...]
    step_s: float
    seed: int
    kind: str  # "risk" or "ramp": what the job names say


def _ramp_job(pool: Sequence[Session], deployment: Deployment, rate_per_s: float, source: str,
              fractions: tuple[float, ...], step_s: float, seed: int, record: RecordFn) -> dict[str, Any]:
    """A job: one deployment's ramp, made into its record here (in the worker)."""
    return record(ramp_at(deployment, pool, rate_per_s, source, fractions, step_s, seed))


def _rate_job(pool: Sequence[Session], deployment: Deployment, workload: WorkloadSpec) -> Calibration:
    """A job: the overload rate of a deployment's shape on this workload (steady trials, minutes)."""
    return find_overload_rate(overload_shape(deployment), "sglang", pool, settings_for(workload))


def swept_records(sweep: Sweep, rates: RateCache, record: RecordFn, executor: ExecutorSpec, workers: int,
                  show_progress: bool) -> list[dict[str, Any]]:
    """Each deployment's record, in order: missing rates measured (and cached here), then one ramp job each."""
    check_ramp(sweep.fractions, sweep.step_s)
    scenario, pool = sweep.scenario, sweep.pool
    keys = [rate_key(overload_shape(d), scenario.workload, scenario.clients, pool) for d in sweep.deployments]
    missing = {key: d for key, d in zip(keys, sweep.deployments, strict=True) if rates.get(key) is None}
    with open_executor(executor, pool, workers, show_progress) as pooled:
        for deployment in missing.values():
            log.warning("no overload rate recorded for %s (GPU cache) on this workload in %s: calibrating now "
                        "(several minutes; cached after)", deployment.name, rates.path)
        found = pooled.run([Job(f"overload rate of {d.name}", _rate_job, (d, scenario.workload))
                            for d in missing.values()], "overload rates")
        sources = {key: "cache" for key in keys}
        for (key, deployment), calibration in zip(missing.items(), found, strict=True):
            record_overload_rate(rates, deployment, scenario.workload, scenario.clients, pool, calibration,
                                 settings_for(scenario.workload), f"basin-sim {sweep.kind} (a missing rate)")
            sources[key] = "measured now"
        jobs = [Job(f"ramp of {d.name} ({sweep.kind}, seed {sweep.seed})", _ramp_job,
                    (d, _rate(rates, key), sources[key], sweep.fractions, sweep.step_s, sweep.seed, record))
                for key, d in zip(keys, sweep.deployments, strict=True)]
        return pooled.run(jobs, "ramps")


def _rate(rates: RateCache, key: str) -> float:
    rate = rates.get(key)
    assert rate is not None, "measured and recorded above"
    return rate


def with_tool_time_scale(scenario: Scenario, scale: float | None) -> Scenario:
    """The scenario with its workload's tool_time_scale replaced (None: as it is)."""
    if scale is None:
        return scenario
    if not scale >= 0:
        raise RampError(f"--tool-time-scale must be >= 0, got {scale}")
    return dataclasses.replace(scenario, workload=dataclasses.replace(scenario.workload, tool_time_scale=scale))

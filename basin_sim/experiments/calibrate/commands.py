"""`basin-sim calibrate|knee|risk|ramp`: the overload rate; the cache knee; the risk test; which limit binds.

    basin-sim calibrate --deployment 1p3d-h100 --scenario surge-100
    basin-sim knee --deployment 1p3d-h100 --model models/peak_predictor.onnx --out calibration.json
    basin-sim risk --deployment 1p3d-h100 --json
    basin-sim ramp --deployment 1p3d-h100 --json

`risk` predicts from the knee ramp's plateau which limit live sessions meet first (fluid.py);
`ramp` runs a ramp that goes past the overload rate and reports which limit it actually hit first
(ramp.py `ramp_limits`): the ground truth the risk test is checked against (benchmarks/risk_grid.py).
Both take one deployment or several (`--deployment A B ...`: one ramp each, on `--executor`, sweep.py;
with --json one line per deployment, in the order given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from basin_runtime.model_files import file_sha256
from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.experiments.calibrate.fluid import fixed_points, risk_test
from basin_sim.experiments.calibrate.knee_ramp import RAMP_FRACTIONS, knee_calibration_record
from basin_sim.experiments.calibrate.ramp import (
    DECODE_FULL_SHARE,
    QUEUED_PER_DECODE,
    ramp_knee,
    ramp_limits,
)
from basin_sim.experiments.calibrate.rates import (
    RateCache,
    measure_overload_rate,
    overload_rate_for,
    settings_for,
)
from basin_sim.experiments.calibrate.setups import (
    LIMIT_RAMP_FRACTIONS,
    CalibrateSetup,
    KneeSetup,
    RampSetup,
    WorkloadSource,
    add_setup_flags,
)
from basin_sim.experiments.calibrate.sweep import (
    RampRun,
    RecordFn,
    Sweep,
    check_ramp,
    ramp_at,
    swept_records,
    with_tool_time_scale,
)
from basin_sim.experiments.flags import from_flags
from basin_sim.experiments.run_setup import Workload, reserving_for
from basin_sim.experiments.served import load_served
from basin_sim.profile import Deployment
from basin_sim.workload.pool import load_pool
from basin_sim.workload.scenarios import Scenario

log = logging.getLogger(__name__)


def _workload(source: WorkloadSource) -> Workload:
    """The scenario (--tool-time-scale) and its workload pool."""
    scenario = with_tool_time_scale(catalog.load_scenario(source.scenario), source.tool_time_scale)
    base, _ = load_pool(source.sessions, source.synthetic)
    return Workload.of(scenario, base)


def simulated_ramp(deployment: Deployment, pool: list[Session], scenario: Scenario, rates: RateCache,
                   fractions: tuple[float, ...], step_s: float, seed: int,
                   reservations: dict[str, float] | None = None,
                   revised: dict[str, dict[int, float]] | None = None) -> RampRun:
    """A ramp at `fractions` x the overload rate of this shape and workload (cached, else measured now)."""
    check_ramp(fractions, step_s)
    rate, source = overload_rate_for(deployment, pool, scenario.workload, scenario.clients, rates)
    return ramp_at(deployment, pool, rate, source, fractions, step_s, seed, reservations, revised)


def _swept(setup: RampSetup, command: str, default_fractions: tuple[float, ...],
           record: RecordFn) -> list[dict[str, Any]]:
    """`record` of each --deployment's ramp (risk, ramp), run on --executor."""
    steps = setup.steps
    deployments = tuple(catalog.load_deployment(name).build(steps.cache) for name in setup.deployment)
    workload = _workload(setup.source)
    fractions = default_fractions if setup.fractions is None else setup.fractions
    sweep = Sweep(deployments, workload.scenario, workload.pool, fractions, steps.step_s, steps.seed, command)
    return swept_records(sweep, RateCache(setup.source.rates_file), record, setup.executor, setup.jobs,
                         not setup.source.quiet)


def _knee_ramp(setup: KneeSetup) -> RampRun:
    """The knee ramp at RAMP_FRACTIONS, reserving the predictor's first-call reservations, revised at its online
    model's slots as the gateway revises by default (none without a predictor)."""
    workload = _workload(setup.source)
    reservations = revised = None
    if setup.model is not None:
        inputs = setup.inputs
        served = load_served(setup.model, inputs.first_call)
        told = reserving_for(served, workload.pool, workload.token_scale, inputs, inputs.reservation_quantile,
                             inputs.revise_at(served))
        reservations = told.reserved(setup.reservation_scale)
        revised = told.revised(setup.reservation_scale) or None
    deployment = catalog.load_deployment(setup.deployment).build(setup.steps.cache)
    return simulated_ramp(deployment, list(workload.pool), workload.scenario, RateCache(setup.source.rates_file),
                          RAMP_FRACTIONS, setup.steps.step_s, setup.steps.seed, reservations, revised)


def calibrate(setup: CalibrateSetup) -> int:
    """Measure the overload rate of a deployment's shape (GPU cache) on a scenario's workload; cache it."""
    deployment, workload = catalog.load_deployment(setup.deployment).build(None), _workload(setup.source)
    scenario, pool = workload.scenario, list(workload.pool)
    settings = dataclasses.replace(settings_for(scenario.workload), seeds=tuple(range(1, setup.seeds + 1)),
                                   min_overloaded=setup.min_overloaded)
    if setup.horizon_s is not None:
        settings = dataclasses.replace(settings, horizon_s=setup.horizon_s)

    def report(rate: float, count: int) -> None:
        log.info("rate %.4f/s: %d of %d trials overloaded", rate, count, len(settings.seeds))

    cache = RateCache(setup.source.rates_file)
    command = f"basin-sim calibrate --deployment {setup.deployment} --scenario {setup.source.scenario}"
    rate = measure_overload_rate(deployment, pool, scenario.workload, scenario.clients, cache, settings, command,
                                 report)
    print(f"{deployment.name} (GPU cache), workload of {scenario.name}: overload rate "
          f"{rate:.4f} sessions/s ({rate * 3600:.0f}/h)")
    log.info("recorded in %s", cache.path)
    return 0


def knee(setup: KneeSetup) -> int:
    """Run the ramp, print the points and the knee, write the calibration file."""
    ramp = _knee_ramp(setup)
    deployment, steps = ramp.deployment, ramp.steps
    for s in steps:
        ratio = "" if s.reservation_ratio is None else f"  reserved/working set {s.reservation_ratio:.2f}"
        noise = "" if s.calls_per_s_se is None else f" ± {s.calls_per_s_se:.2f}"
        print(f"rate {s.rate_per_s:.4f}/s  load {s.load:.3f}  hit {s.hit_rate:.3f}  live {s.live_sessions:.0f}"
              f"  calls/s {s.calls_per_s:.2f}{noise}{ratio}")
    quantile = setup.inputs.reservation_quantile
    model = "" if setup.model is None else (f" --model {setup.model} --reservation-quantile {quantile}"
                                            f" --reservation-scale {setup.reservation_scale:g}")
    has_model = setup.model is not None
    record = knee_calibration_record(deployment, steps, f"basin-sim knee --deployment {setup.deployment} "
                                     f"--scenario {setup.source.scenario}{model}", setup.steps.step_s,
                                     file_sha256(setup.model) if setup.model is not None else "none",
                                     quantile if has_model else None)
    print(json.dumps(record, indent=2))
    if setup.out is not None:
        setup.out.parent.mkdir(parents=True, exist_ok=True)
        setup.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def risk_record(ramp: RampRun) -> dict[str, Any]:
    """The risk test on a knee ramp: X(N), fixed points at the pre-surge rate, both limits, the verdict."""
    deployment, steps = ramp.deployment, ramp.steps
    points = sorted({round(s.live_sessions, 3): s.calls_per_s for s in steps if s.live_sessions > 0}.items())
    ns, xs = [n for n, _ in points], [x for _, x in points]
    pre_rate = 0.5 * ramp.overload_rate_per_s  # the scenarios' pre-surge load
    fixed = fixed_points(ns, xs, pre_rate, ramp.calls_per_session) if len(ns) >= 2 else []
    knee = ramp_knee(steps)
    capacity = deployment.cache_capacity_tokens
    plateau = [s for s in steps if s.load <= knee.load and s.live_sessions > 0] or \
        [s for s in steps if s.live_sessions > 0][:1]
    if not plateau:
        raise ValueError(f"{deployment.name}: no ramp step had a live session; raise the rates or --step-s")
    context = statistics.fmean(s.load * capacity / s.live_sessions for s in plateau)
    shares = [s.decode_holding_share for s in plateau if s.decode_holding_share is not None]
    holding = min(1.0, max(1e-6, statistics.fmean(shares) if shares else 1.0))
    decode_tokens = deployment.decode_capacity_tokens
    verdict = risk_test(knee.load * capacity, context, decode_tokens, holding, deployment.decode_reserved_tokens)
    # A diagnostic beside the verdict: what the simulated engine itself held per live session.
    in_engine = statistics.fmean(s.decode_memory_share * decode_tokens / s.live_sessions for s in plateau)
    return {"deployment": deployment.name, "verdict": verdict.verdict,
            "cache_limit_sessions": verdict.cache_limit_sessions,
            "decode_limit_sessions": verdict.decode_limit_sessions,
            "knee_tokens": knee.load * capacity, "knee_is_censored": knee.is_censored,
            "mean_context_tokens": context, "decode_capacity_tokens": decode_tokens,
            "decode_headroom_tokens": deployment.decode_reserved_tokens, "decode_holding_share": holding,
            "decode_tokens_per_session": verdict.decode_tokens_per_session,
            "engine_decode_tokens_per_session": in_engine,
            "engine_decode_limit_sessions": decode_tokens / in_engine if in_engine > 0 else None,
            "decode_busy_share": statistics.fmean(s.decode_busy_share for s in plateau),
            "plateau_steps": len(plateau), "overload_rate_per_s": ramp.overload_rate_per_s,
            "overload_rate_source": ramp.overload_rate_source, "pre_surge_rate_per_s": pre_rate,
            "calls_per_session": ramp.calls_per_session,
            "x_of_n": [{"live_sessions": n, "calls_per_s": x} for n, x in points],
            "fixed_points": [{"live_sessions": p.live_sessions, "is_stable": p.is_stable} for p in fixed],
            "fractions_of_overload_rate": list(ramp.fractions), "step_s": ramp.step_s}


def _report(setup: RampSetup, records: list[dict[str, Any]], show: Callable[[Mapping[str, Any]], None]) -> int:
    """Each deployment's record, in the order given: one JSON line with --json, else `show`'s text."""
    for record in records:
        if setup.json:
            print(json.dumps(record, sort_keys=True))
        else:
            show(record)
    return 0


def risk(setup: RampSetup) -> int:
    """X(N) from the knee ramp, fixed points at the pre-surge rate, and the cache-first / decode-first verdict."""
    return _report(setup, _swept(setup, "risk", RAMP_FRACTIONS, risk_record), _print_risk)


def _print_risk(record: Mapping[str, Any]) -> None:
    print("X(N): " + ", ".join(f"N={p['live_sessions']:.0f} X={p['calls_per_s']:.2f}/s" for p in record["x_of_n"]))
    for point in record["fixed_points"]:
        kind = "stable" if point["is_stable"] else "UNSTABLE"
        print(f"fixed point at N={point['live_sessions']:.0f} live sessions: {kind}")
    print(f"mean live context {record['mean_context_tokens']:.0f} tokens; a live session holds "
          f"{record['decode_tokens_per_session']:.0f} decode tokens on average ((context + "
          f"{record['decode_headroom_tokens']}) x holding share {record['decode_holding_share']:.3f}); "
          f"decode memory {record['decode_capacity_tokens']} tokens")
    censored = " (knee beyond the ramp: a low estimate)" if record["knee_is_censored"] else ""
    print(f"{record['deployment']}: cache knee reached at {record['cache_limit_sessions']:.0f} live sessions"
          f"{censored}, decode memory at {record['decode_limit_sessions']:.0f}: {record['verdict']}")


def ramp_record(ramp: RampRun) -> dict[str, Any]:
    """The limits ramp: per step hit rate, decode memory share and queue; which limit was hit first, and where."""
    deployment = ramp.deployment
    limits = ramp_limits(ramp.steps, deployment, ramp.timeline, ramp.step_s)
    steps = [{"index": k, "x_overload": f, "rate_per_s": s.rate_per_s, "hit_rate": s.hit_rate, "load": s.load,
              "live_sessions": s.live_sessions, "decode_memory_share": s.decode_memory_share,
              "prealloc_queued": s.prealloc_queued, "decode_holding_share": s.decode_holding_share,
              "calls_per_s": s.calls_per_s}
             for k, (f, s) in enumerate(zip(ramp.fractions, ramp.steps, strict=True))]
    return {"deployment": deployment.name, "first_limit": limits.first_limit, "cache_limit_step": limits.cache_step,
            "decode_limit_step": limits.decode_step, "is_tie_broken_by_minute": limits.is_tie_broken_by_minute,
            "knee_load": limits.knee.load, "knee_is_censored": limits.knee.is_censored,
            "plateau_hit_rate": limits.knee.plateau_hit_rate,
            "thresholds": {"decode_memory_share": DECODE_FULL_SHARE,
                           "prealloc_queued_per_decode_instance": QUEUED_PER_DECODE, "hit_rate_tolerance": 0.05,
                           "confirm_steps": 2},
            "num_decode": deployment.num_decode, "decode_capacity_tokens": deployment.decode_capacity_tokens,
            "overload_rate_per_s": ramp.overload_rate_per_s,
            "overload_rate_source": ramp.overload_rate_source, "step_s": ramp.step_s, "steps": steps}


def ramp(setup: RampSetup) -> int:
    """Run the limits ramp and say which limit (cache knee or decode memory) it hit first."""
    return _report(setup, _swept(setup, "ramp", LIMIT_RAMP_FRACTIONS, ramp_record), _print_ramp)


def _print_ramp(record: Mapping[str, Any]) -> None:
    for step in record["steps"]:
        print(f"step {step['index']}  {step['x_overload']:.2f}x = {step['rate_per_s']:.4f}/s  hit "
              f"{step['hit_rate']:.3f}  load {step['load']:.3f}  live {step['live_sessions']:.0f}  decode memory "
              f"{step['decode_memory_share']:.3f}  queued {step['prealloc_queued']:.1f}")
    print(f"{record['deployment']}: first limit {record['first_limit']} (cache at step {record['cache_limit_step']}, "
          f"decode at step {record['decode_limit_step']})")


def add_commands(sub: Any) -> None:
    """Add `calibrate`, `knee`, `risk` and `ramp` to the CLI's subparsers (options: setups.py)."""
    helps = {
        "calibrate": "measure a deployment shape's overload rate on a workload (cached; scenarios' x_overload "
                     "multiply it)",
        "knee": "find the cache knee on a simulated load ramp; write the calibration file the gateway reads (--out)",
        "risk": "PREDICT which limit (cache knee or decode memory) live sessions meet first: a fluid model's fixed "
                "points, fitted on a ramp below the overload rate (the fast verdict)",
        "ramp": "MEASURE which limit is hit first: a ramp run past the overload rate (slower; the ground truth "
                "`risk` is checked against)",
    }
    for command, text in helps.items():
        add_setup_flags(sub.add_parser(command, help=text), command)


def run_command(args: argparse.Namespace) -> int:
    """`basin-sim calibrate|knee|risk|ramp` from its parsed flags: the set-up built, the command run."""
    if args.command == "calibrate":
        return calibrate(from_flags(CalibrateSetup, args))
    if args.command == "knee":
        return knee(from_flags(KneeSetup, args))
    setup = from_flags(RampSetup, args, executor=args.executor, jobs=args.jobs)
    return risk(setup) if args.command == "risk" else ramp(setup)

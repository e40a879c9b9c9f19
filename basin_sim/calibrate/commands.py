"""`basin-sim calibrate|knee|risk`: the overload rate; the cache knee on a simulated ramp; the risk test.

    python -m basin_sim calibrate --deployment 1p3d --scenario surge-100
    python -m basin_sim knee --deployment 1p3d --model models/peak_predictor.onnx --out data/calibration-1p3d.json
    python -m basin_sim risk --deployment 1p3d
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.calibrate.fluid import fixed_points, risk_test
from basin_sim.calibrate.overload import CalibrationSettings
from basin_sim.calibrate.ramp import RampStep, ramp_knee, run_ramp
from basin_sim.calibrate.ramp import calibration_record as ramp_calibration_record
from basin_sim.calibrate.rates import DEFAULT_RATES_FILE, RateCache, measure_overload_rate, overload_rate_for
from basin_sim.predictions import load_predictor, predict_pool
from basin_sim.profile import Deployment
from basin_sim.workload.pool import load_pool, workload_pool
from basin_sim.workload.scenarios import Scenario

log = logging.getLogger(__name__)

RAMP_FRACTIONS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)  # of the overload rate
RAMP_STEP_S = 1200.0


def calibration_record(deployment: Deployment, steps: list[RampStep], command: str,
                       step_s: float = RAMP_STEP_S) -> dict[str, Any]:
    """The gateway's calibration file from a simulated ramp on `deployment`."""
    capacity = deployment.prefill_cache_tokens * deployment.num_prefill
    return ramp_calibration_record(steps, capacity,
                                   f"{command}: simulated stepped ramp ({len(steps)} steps of {step_s:.0f} s)")


def _workload(args: argparse.Namespace) -> tuple[Deployment, list[Session], Scenario]:
    """The deployment (with --cache if given), the scenario's workload pool, and the scenario."""
    spec = catalog.load_deployment(args.deployment)
    scenario = catalog.load_scenario(args.scenario)
    base, _ = load_pool(args.sessions, args.synthetic)
    return spec.build(getattr(args, "cache", None)), workload_pool(base, scenario.workload), scenario


def _ramp(args: argparse.Namespace) -> tuple[Deployment, list[RampStep], float]:
    deployment, pool, scenario = _workload(args)
    rate, _ = overload_rate_for(deployment, pool, scenario.workload, scenario.clients, RateCache(args.rates_file))
    reservations = None
    if getattr(args, "model", None) is not None:
        scale = args.reservation_scale
        reservations = {sid: scale * peak for sid, peak in predict_pool(load_predictor(args.model), pool).items()}
    steps = run_ramp(deployment, pool, [f * rate for f in RAMP_FRACTIONS], args.step_s, args.seed, reservations)
    calls = statistics.fmean(s.n_calls for s in pool)
    return deployment, steps, calls


def calibrate_main(args: argparse.Namespace) -> int:
    """Measure the overload rate of a deployment's shape (GPU cache) on a scenario's workload; cache it."""
    deployment, pool, scenario = _workload(args)
    settings = CalibrationSettings(horizon_s=args.horizon_s, seeds=tuple(range(1, args.seeds + 1)),
                                   min_overloaded=args.min_overloaded)

    def report(rate: float, count: int) -> None:
        log.info("rate %.4f/s: %d of %d trials overloaded", rate, count, len(settings.seeds))

    cache = RateCache(args.rates_file)
    command = f"basin-sim calibrate --deployment {args.deployment} --scenario {args.scenario}"
    rate = measure_overload_rate(deployment, pool, scenario.workload, scenario.clients, cache, settings, command,
                                 report)
    print(f"{deployment.name} (GPU cache), workload of {scenario.name}: overload rate "
          f"{rate:.4f} sessions/s ({rate * 3600:.0f}/h)")
    log.info("recorded in %s", cache.path)
    return 0


def knee_main(args: argparse.Namespace) -> int:
    """Run the ramp, print the points and the knee, write the calibration file."""
    deployment, steps, _ = _ramp(args)
    for s in steps:
        ratio = "" if s.reservation_ratio is None else f"  reserved/working set {s.reservation_ratio:.2f}"
        print(f"rate {s.rate_per_s:.4f}/s  load {s.load:.3f}  hit {s.hit_rate:.3f}  live {s.live_sessions:.0f}{ratio}")
    model = "" if args.model is None else f" --model {args.model} --reservation-scale {args.reservation_scale:g}"
    record = calibration_record(deployment, steps, f"python -m basin_sim knee --deployment {args.deployment} "
                                f"--scenario {args.scenario}{model}", args.step_s)
    print(json.dumps(record, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def risk_main(args: argparse.Namespace) -> int:
    """X(N) from the ramp, fixed points at the pre-surge rate, and the cache-first / decode-first verdict."""
    deployment, steps, calls = _ramp(args)
    points = sorted({round(s.live_sessions, 3): s.calls_per_s for s in steps if s.live_sessions > 0}.items())
    ns, xs = [n for n, _ in points], [x for _, x in points]
    pre_rate = steps[0].rate_per_s / RAMP_FRACTIONS[0] * 0.5
    print("X(N): " + ", ".join(f"N={n:.0f} X={x:.2f}/s" for n, x in points))
    for point in fixed_points(ns, xs, pre_rate, calls):
        kind = "stable" if point.is_stable else "UNSTABLE"
        print(f"fixed point at N={point.live_sessions:.0f} live sessions: {kind}")
    knee = ramp_knee(steps)
    capacity = deployment.prefill_cache_tokens * deployment.num_prefill
    plateau = [s for s in steps if s.load <= knee.load and s.live_sessions > 0] or steps[:1]
    context = statistics.fmean(s.load * capacity / s.live_sessions for s in plateau)
    busy = min(1.0, max(1e-6, statistics.fmean(s.decode_busy_share for s in plateau)))
    verdict = risk_test(knee.load * capacity, context, deployment.decode_kv_tokens * deployment.num_decode, busy)
    print(json.dumps({"pre_surge_rate_per_s": pre_rate, "calls_per_session": calls,
                      "mean_context_tokens": context, "decode_busy_share": busy, **asdict(verdict)}))
    print(f"{deployment.name}: {verdict.describe()}")
    return 0


def add_commands(sub: Any) -> None:
    """Add `calibrate`, `knee` and `risk` to the CLI's subparsers."""
    calibrate = sub.add_parser("calibrate", help="measure a deployment shape's overload rate on a workload; cache it")
    calibrate.add_argument("--seeds", type=int, default=5, help="trials per rate (seeds 1..N)")
    calibrate.add_argument("--min-overloaded", type=int, default=4, help="trials that must overload")
    calibrate.add_argument("--horizon-s", type=float, default=1800.0)
    calibrate.add_argument("--write", action="store_true", help="record the rate in the deployment file")
    knee = sub.add_parser("knee", help="find the cache knee on a simulated load ramp; write the calibration file")
    knee.add_argument("--out", type=Path, help="calibration JSON for the gateway (and for --calibration)")
    knee.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"),
                      help="the served peak predictor: measures the reservation ratio (default: the shipped pooled "
                           "model)")
    knee.add_argument("--no-model", dest="model", action="store_const", const=None,
                      help="no predictor: the calibration file holds no reservation_ratio (prototype mode)")
    knee.add_argument("--reservation-scale", type=float, default=1.0, help="reserve this x each predicted peak")
    risk = sub.add_parser("risk", help="fluid model fixed points and the cache-first / decode-first verdict")
    for command in (calibrate, knee, risk):
        command.add_argument("--deployment", required=True, help="a deployment name or .yaml file")
        command.add_argument("--scenario", default="steady",
                             help="whose workload and clients (name or .yaml; default steady)")
        command.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE, help="the overload-rate cache")
    for command in (knee, risk):
        command.add_argument("--cache", choices=("gpu", "host"), help="override the deployment file's cache kind")
        command.add_argument("--seed", type=int, default=1)
        command.add_argument("--step-s", type=float, default=RAMP_STEP_S,
                             help=f"simulated seconds per ramp step (default {RAMP_STEP_S:.0f})")

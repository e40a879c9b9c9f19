"""Command line: `python -m basin_sim run ...` (one scenario) and `python -m basin_sim calibrate ...`.

    python -m basin_sim run --scenario surge-100 --deployment 1p3d --policy sglang --seed 1 --json
    python -m basin_sim run --scenario steady --deployment 1p3d --policy hicache --plot-dir plots/
    python -m basin_sim calibrate --deployment 1p3d --cache gpu --write
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from basin_runtime.gateway.config import ConfigError
from basin_runtime.predictor import PredictorError
from basin_runtime.session_table import Session, SessionTableError, read_sessions
from basin_sim import catalog
from basin_sim.calibrate import CalibrationSettings, find_overload_rate
from basin_sim.policies import UnknownPolicyError, policy_names, policy_spec
from basin_sim.profile import CacheKind
from basin_sim.simulate import RunSpec, run_scenario
from basin_sim.synthetic import generate_corpus

log = logging.getLogger(__name__)

DEFAULT_SESSIONS = Path("data/sessions.parquet")
SYNTHETIC_SEED = 7  # the pipeline's synthetic corpus (params.yaml: ingest.synthetic)
SYNTHETIC_PER_BENCHMARK = 300


class UsageError(ValueError):
    """Bad input from the command line; the message says what and which names are known."""


def load_pool(path: Path, use_synthetic: bool) -> tuple[list[Session], str]:
    """The session pool and its workload label ('table' or 'synthetic'); warns when it falls back."""
    if not use_synthetic and path.exists():
        try:
            return read_sessions(path), "table"
        except SessionTableError as exc:
            raise UsageError(str(exc)) from exc
    if not use_synthetic:
        log.warning("no session table at %s: using the SYNTHETIC corpus (seed %d, %d sessions per benchmark); "
                    "numbers are not those of the real traces", path, SYNTHETIC_SEED, SYNTHETIC_PER_BENCHMARK)
    return generate_corpus(SYNTHETIC_SEED, SYNTHETIC_PER_BENCHMARK), "synthetic"


def _cache_for(policy: str, cache: str | None) -> CacheKind:
    spec = policy_spec(policy)
    if cache is None:
        return "host" if spec.uses_host_tier else "gpu"
    if spec.uses_host_tier and cache != "host":
        raise UsageError(f"policy {policy!r} needs the host tier; use --cache host (or leave --cache out)")
    return "host" if cache == "host" else "gpu"


class _Progress:
    """A tqdm bar over simulated minutes, on stderr."""

    def __init__(self, total_s: float, label: str, enabled: bool) -> None:
        self._bar = tqdm(total=round(total_s / 60), unit="sim-min", desc=label, file=sys.stderr,
                         disable=not enabled, leave=False)

    def __call__(self, now: float) -> None:
        minutes = round(now / 60)
        if minutes > self._bar.total:
            self._bar.total = minutes
        self._bar.update(minutes - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def _run(args: argparse.Namespace) -> int:
    scenario = catalog.load_scenario(args.scenario)
    deployment_spec = catalog.load_deployment(args.deployment)
    cache = _cache_for(args.policy, args.cache)
    pool, workload = load_pool(args.sessions, args.synthetic)
    rate = args.overload_rate or deployment_spec.overload_rate(cache, workload)
    peaks: dict[str, float] = {}
    if args.policy == "basin":
        from basin_sim.predictions import load_predictor, predict_pool

        peaks = predict_pool(load_predictor(args.model), pool)
    knee, ratio, peak_rate = args.knee_tokens, 1.0, args.peak_completion_rate
    if args.calibration is not None:
        from basin_runtime.gateway.calibration import load_calibration

        calibration = load_calibration(args.calibration)
        knee = knee if knee is not None else calibration.knee_tokens
        peak_rate = peak_rate if peak_rate is not None else calibration.peak_completion_rate_per_s
        ratio = calibration.reservation_ratio
    spec = RunSpec(scenario, deployment_spec.build(cache), args.policy, args.seed, rate, predicted_peak_tokens=peaks,
                   reservation_scale=args.reservation_scale, knee_tokens=knee, reservation_ratio=ratio,
                   peak_completion_rate_per_s=peak_rate)
    progress = _Progress(scenario.duration_s, f"{scenario.name}/{deployment_spec.name}/{args.policy}",
                         not args.quiet)
    started = time.perf_counter()
    try:
        result = run_scenario(spec, pool, progress)
    finally:
        progress.close()
    summary: dict[str, Any] = {"workload": workload, **result.summary}
    log.info("simulated %.0f s in %.1f s wall", summary["simulated_s"], time.perf_counter() - started)
    if args.plot_dir is not None:
        from basin_sim.plots import plot_run

        path = plot_run(result, args.plot_dir)
        log.info("wrote %s", path)
    print(json.dumps(summary, sort_keys=True) if args.json else _table(summary))
    return 0


def _table(summary: dict[str, Any]) -> str:
    lines = []
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:28s} {shown}")
    return "\n".join(lines)


def _calibrate(args: argparse.Namespace) -> int:
    deployment_spec = catalog.load_deployment(args.deployment)
    cache: CacheKind = args.cache
    pool, workload = load_pool(args.sessions, args.synthetic)
    settings = CalibrationSettings(horizon_s=args.horizon_s, seeds=tuple(range(1, args.seeds + 1)),
                                   min_overloaded=args.min_overloaded)
    policy = "hicache" if cache == "host" else "sglang"

    def report(rate: float, count: int) -> None:
        log.info("rate %.4f/s: %d of %d trials overloaded", rate, count, len(settings.seeds))

    found = find_overload_rate(deployment_spec.build(cache), policy, pool, settings, report)
    print(f"{deployment_spec.name} cache={cache} workload={workload}: overload rate "
          f"{found.overload_rate_per_s:.4f} sessions/s ({found.overload_rate_per_s * 3600:.0f}/h)")
    if args.write:
        command = (f"python -m basin_sim calibrate --deployment {deployment_spec.name} --cache {cache}"
                   f"{' --synthetic' if workload == 'synthetic' else ''} --write")
        note = (f"{command}; {settings.min_overloaded}/{len(settings.seeds)} trials overload within "
                f"{settings.horizon_s:.0f} s")
        catalog.write_overload_rate(deployment_spec, cache, workload, found.overload_rate_per_s, note)
        log.info("wrote %s", deployment_spec.path)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate one scenario and print its summary")
    run.add_argument("--scenario", required=True, help=f"one of {catalog.names(catalog.SCENARIOS_DIR)}, or a .yaml")
    run.add_argument("--deployment", required=True, help=f"one of {catalog.names(catalog.DEPLOYMENTS_DIR)}")
    run.add_argument("--cache", choices=("gpu", "host"), help="default: host for policies that need it, else gpu")
    run.add_argument("--policy", required=True, help=f"one of {list(policy_names())}")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--json", action="store_true", help="print one JSON line")
    run.add_argument("--plot-dir", type=Path, help="write the timeline PNG here")
    run.add_argument("--overload-rate", type=float, help="override the deployment's calibrated rate (per s)")
    run.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"),
                     help="peak predictor for policy basin (default: the shipped pooled model)")
    run.add_argument("--reservation-scale", type=float, default=1.0, help="basin: reserve this x each predicted peak")
    run.add_argument("--knee-tokens", type=float, help="basin budget: measured cache knee (default 0.9 x capacity)")
    run.add_argument("--peak-completion-rate", type=float, help="basin shedding: measured sessions/s (default off)")
    run.add_argument("--calibration", type=Path, help="basin: the knee calibration file (`knee --out`): knee, "
                     "reservation ratio, peak completion rate (the flags above win)")
    calibrate = sub.add_parser("calibrate", help="measure a deployment's overload rate")
    calibrate.add_argument("--deployment", required=True)
    calibrate.add_argument("--cache", choices=("gpu", "host"), default="gpu")
    calibrate.add_argument("--seeds", type=int, default=5, help="trials per rate (seeds 1..N)")
    calibrate.add_argument("--min-overloaded", type=int, default=4, help="trials that must overload")
    calibrate.add_argument("--horizon-s", type=float, default=1800.0)
    calibrate.add_argument("--write", action="store_true", help="record the rate in the deployment file")
    from basin_sim.operator_cli import add_commands

    add_commands(sub)
    for command in (run, calibrate, sub.choices["knee"], sub.choices["risk"]):
        command.add_argument("--sessions", type=Path, default=DEFAULT_SESSIONS, help="session table (parquet)")
        command.add_argument("--synthetic", action="store_true", help="use the synthetic corpus")
        command.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        from basin_sim.operator_cli import knee_main, risk_main

        commands = {"calibrate": _calibrate, "run": _run, "knee": knee_main, "risk": risk_main}
        return commands[args.command](args)
    except (catalog.CatalogError, UnknownPolicyError, UsageError, PredictorError, ConfigError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")

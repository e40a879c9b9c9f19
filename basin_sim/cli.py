"""`basin-sim`: the discrete-event model of a PD-disaggregated SGLang deployment, from the command line.

`basin-sim --help` lists every subcommand with one example each; `basin-sim COMMAND --help` gives every option
with its default. Subcommands: `run` (one scenario under one policy), `compare` (a grid over seeds,
basin_sim/compare.py), `calibrate`, `knee`, `risk`, `ramp` (measurements, basin_sim/calibrate/commands.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from basin_runtime.calibration import Calibration, CalibrationError, calibration_from_mapping, load_calibration
from basin_runtime.logs import configure_logging, quiet_level
from basin_runtime.model_files import file_sha256
from basin_runtime.policy import PolicyError
from basin_runtime.policy.calibrated import check_serves
from basin_runtime.policy.lending import LENDING_KINDS
from basin_runtime.predictor import PredictorError
from basin_runtime.session_table import Session
from basin_sim import catalog, compare
from basin_sim.calibrate.commands import add_commands, calibrate_main, knee_main, ramp_main, risk_main
from basin_sim.calibrate.knee_cache import DEFAULT_CALIBRATIONS_FILE, KneeCache, calibration_for
from basin_sim.calibrate.rates import DEFAULT_RATES_FILE, RateCache, RatesError, overload_rate_for
from basin_sim.calibrate.sweep import RampError
from basin_sim.executors import ExecutorError, exit_status
from basin_sim.help_format import DefaultsFormatter
from basin_sim.policies import UnknownPolicyError, policy_names, policy_spec
from basin_sim.predictions import (
    PredictionsError,
    ReservingPredictor,
    Revisions,
    add_predictions_source,
    add_reservation_quantile,
    load_out_of_fold,
    load_predictor,
    online_revisions,
    peaks_tag,
    pool_peaks,
    reservation_multipliers,
    reserved_peaks,
    revision_calls,
)
from basin_sim.profile import CacheKind, Deployment
from basin_sim.run_spec import RunSpec
from basin_sim.run_summary import PIN_KEYS
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import DEFAULT_SESSIONS, PoolError, load_pool, token_scale, workload_pool
from basin_sim.workload.scenarios import Scenario, ScenarioError

log = logging.getLogger(__name__)


class UsageError(ValueError):
    """Bad input from the command line; the message says what and which names are known."""


def _cache_for(policy: str, cache: str | None, file_cache: CacheKind) -> CacheKind:
    """--cache, else the deployment file's; `hicache` (sglang with the host tier) switches a GPU file to host."""
    spec = policy_spec(policy)
    if cache is None:
        return "host" if spec.uses_host_tier else file_cache
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


def _check_inputs(args: argparse.Namespace) -> ReservingPredictor | None:
    """Every file the run will read, read or checked before any work that takes time (an overload-rate
    measurement or a knee calibration takes minutes); returns the predictor for policy basin."""
    policy_spec(args.policy)  # an unknown name lists the known ones
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise UsageError(f"--calibration {args.calibration}: no such file")
    if args.policy != "basin":
        return None
    predictor = load_predictor(args.model)  # a missing or unusable file: PredictorError naming it
    if args.predictions == "out-of-fold":
        load_out_of_fold(args.out_of_fold)  # a missing table: PredictionsError naming it and `make repro`
    return predictor


def _run(args: argparse.Namespace) -> int:
    predictor = _check_inputs(args)
    scenario = catalog.load_scenario(args.scenario)
    deployment_spec = catalog.load_deployment(args.deployment)
    deployment = deployment_spec.build(_cache_for(args.policy, args.cache, deployment_spec.cache), args.lending)
    base, source = load_pool(args.sessions, args.synthetic)
    pool = workload_pool(base, scenario.workload)
    rate, rate_source = _overload_rate(args, deployment, pool, scenario)
    peaks: dict[str, float] = {}
    multipliers: dict[str, float] = {}
    revisions: Revisions = {}
    sources: dict[str, int] = {}
    if predictor is not None:
        peaks, sources = pool_peaks(predictor, pool, args.predictions, args.out_of_fold,
                                    token_scale(base, scenario.workload))
        multipliers = reservation_multipliers(predictor, pool, args.reservation_quantile)
        revisions = online_revisions(predictor, pool, peaks, args.reservation_quantile,
                                     revision_calls(args.predictions, args.revise_at_calls))
    calibration, calibration_source = _calibration(args, deployment), "given"
    if args.policy in ("basin", "basin-proto") and calibration is None:
        if args.no_calibration:
            calibration_source = "none (--no-calibration: knee taken as the cache capacity)"
        else:
            is_basin = args.policy == "basin"
            record, calibration_source = calibration_for(
                deployment_spec.build("gpu", args.lending), pool, scenario, rate,
                file_sha256(args.model) if is_basin else "none",
                args.reservation_quantile if is_basin else None,
                reserved_peaks(peaks, multipliers) if is_basin else None, KneeCache(args.calibrations_file),
                peaks_tag(args.predictions, args.out_of_fold) if is_basin else "")
            calibration = calibration_from_mapping(record, f"the knee calibration in {args.calibrations_file}")
            log.info("Basin calibration (%s, %s): knee %.0f tokens, reservation ratio %s", calibration_source,
                     args.calibrations_file, calibration.knee_tokens, record.get("reservation_ratio"))
    spec = RunSpec(scenario, deployment, args.policy, args.seed, rate, predicted_peak_tokens=peaks,
                   reservation_scale=args.reservation_scale, calibration=calibration,
                   reservation_multipliers=multipliers, reservation_quantile=args.reservation_quantile,
                   revisions=revisions if args.policy == "basin" else {})
    progress = _Progress(scenario.warmup_s + scenario.duration_s,
                         f"{scenario.name}/{deployment_spec.name}/{args.policy}", not args.quiet)
    started = time.perf_counter()
    try:
        result = run_scenario(spec, pool, progress)
    finally:
        progress.close()
    summary: dict[str, Any] = {"workload": source, "overload_rate_source": rate_source,
                               "calibration_source": calibration_source, "predictions": sources, **result.summary}
    log.info("simulated %.0f s in %.1f s wall", summary["simulated_s"], time.perf_counter() - started)
    if args.plot_dir is not None:
        from basin_sim.plots import plot_run

        path = plot_run(result, args.plot_dir)
        log.info("wrote %s", path)
    shown = policy_fields(summary, args.policy)
    print(json.dumps(shown, sort_keys=True) if args.json else _table(shown))
    return 0


# Summary fields only some policies have (run_summary.summarize writes them all, None or neutral elsewhere).
BASIN_FIELDS = ("knee_tokens", "reservation_ratio", "sessions_admitted", "sessions_overflowed", "calibration_source")
PREDICTOR_FIELDS = ("reservation_scale", "reservation_quantile", "predictions")  # basin alone reads a predictor
OWNERS = {**dict.fromkeys(BASIN_FIELDS, ("basin", "basin-proto")), **dict.fromkeys(PREDICTOR_FIELDS, ("basin",)),
          **dict.fromkeys(PIN_KEYS, ("continuum",)), "suspensions": ("budgeter",)}


def policy_fields(summary: dict[str, Any], policy: str) -> dict[str, Any]:
    """`summary` without the fields the policy `policy` does not have (a plain-SGLang run has no pins, budget
    or predictor)."""
    return {k: v for k, v in summary.items() if policy in OWNERS.get(k, (policy,))}


def _overload_rate(args: argparse.Namespace, deployment: Deployment, pool: Sequence[Session],
                   scenario: Scenario) -> tuple[float, str]:
    """--overload-rate, or the cached (else measured now) rate of this shape and workload."""
    if args.overload_rate is not None:
        if not args.overload_rate > 0:
            raise UsageError(f"--overload-rate must be > 0, got {args.overload_rate}")
        return args.overload_rate, "--overload-rate"
    if not scenario.needs_overload_rate:  # a closed population, or every segment in per_min: never calibrate
        return 0.0, "no x_overload segment (no overload rate)"
    return overload_rate_for(deployment, pool, scenario.workload, scenario.clients, RateCache(args.rates_file))


def _calibration(args: argparse.Namespace, deployment: Deployment) -> Calibration | None:
    """The calibration file's measurements, with --knee-tokens and --peak-completion-rate winning over them."""
    calibration = None if args.calibration is None else load_calibration(args.calibration)
    if calibration is not None:  # measured for this predictor, quantile and lending (when the file says)
        is_basin = args.policy == "basin"
        try:
            check_serves(calibration, file_sha256(args.model) if is_basin else calibration.predictor_sha256 or "none",
                         args.reservation_quantile if is_basin else calibration.reservation_quantile,
                         deployment.lending)
        except PolicyError as exc:
            raise UsageError(f"--calibration {args.calibration}: {exc}") from exc
    if args.knee_tokens is None and args.peak_completion_rate is None:
        return calibration
    if calibration is None:
        capacity = float(deployment.prefill_cache_tokens * deployment.num_prefill)
        calibration = Calibration(knee_tokens=capacity, cache_capacity_tokens=capacity)
    knee = calibration.knee_tokens if args.knee_tokens is None else args.knee_tokens
    rate = calibration.peak_completion_rate_per_s if args.peak_completion_rate is None else args.peak_completion_rate
    try:
        measured = {**asdict(calibration), "knee_tokens": knee, "peak_completion_rate_per_s": rate}
        return calibration_from_mapping(measured, "the command line (--knee-tokens / --peak-completion-rate)")
    except CalibrationError as exc:
        raise UsageError(str(exc)) from exc


def _table(summary: dict[str, Any]) -> str:
    lines = []
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        if isinstance(value, list) and len(value) > 8:  # the per-minute timeline: its plot shows it, --json holds it
            shown = f"[{len(value)} entries: --json prints them, --plot-dir draws them]"
        lines.append(f"{key:28s} {shown}")
    return "\n".join(lines)


PROG = "basin-sim"

POLICIES = """policies (--policy):
  sglang       stock SGLang PD: first come first served, no admission control, GPU prefix cache only
  hicache      the same with SGLang's HiCache host tier (prefixes evicted from GPU kept in host memory)
  continuum    Continuum: KV pinned across tool calls for a per-call TTL, program-level FCFS, no admission
  budgeter     the vLLM study's budgeter: sessions' contexts bounded by the KV pool, newest suspended
  basin-proto  Basin's hardware prototype: arrival order, admission by current context, shedding
  basin        Basin: predicted-peak admission (--model), size-aware priority, adaptive budget, shedding
"""

EXAMPLES = {
    "run": "basin-sim run --scenario paper-timed-kill-burst-keep --deployment 1p3d --policy sglang --plot-dir plots",
    "compare": "basin-sim compare --scenarios surge-100 --deployments 1p3d --policies sglang basin --seeds 1 2 3",
    "calibrate": "basin-sim calibrate --deployment 1p3d-h100 --scenario surge-100",
    "knee": "basin-sim knee --deployment 1p3d --model models/peak_predictor.onnx --out calibration.json",
    "risk": "basin-sim risk --deployment 1p3d 3p1d --json",
    "ramp": "basin-sim ramp --deployment 1p3d --json",
}


def _parser() -> argparse.ArgumentParser:
    examples = "\n".join(f"  {line}" for line in EXAMPLES.values())
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0] + "\n\n" + POLICIES,
                                     epilog="examples, one per subcommand:\n" + examples,
                                     formatter_class=DefaultsFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="subcommands (basin-sim COMMAND --help: every option and its default)")
    run = sub.add_parser("run", help="simulate one scenario on one deployment under one policy; print its summary",
                         description="Simulate one scenario on one deployment under one policy; print the run's "
                                     "summary (the fields the chosen policy has) and, with --plot-dir, its timeline "
                                     "(minutes from the end of the warm-up, as scenario files count them).")
    run.add_argument("--scenario", required=True,
                     help=f"one of {', '.join(catalog.names(catalog.SCENARIOS_DIR))}, or a scenario .yaml file")
    run.add_argument("--deployment", required=True,
                     help=f"one of {', '.join(catalog.names(catalog.DEPLOYMENTS_DIR))}, or a deployment .yaml file")
    run.add_argument("--cache", choices=("gpu", "host"),
                     help="override the deployment file's cache kind (host: the HiCache host tier)")
    run.add_argument("--lending", choices=LENDING_KINDS,
                     help="override the deployment file's lending switch (none: stock SGLang; decode-memory: "
                          "idle decode memory lent to the prefix cache)")
    run.add_argument("--policy", required=True, help=f"one of {', '.join(policy_names())} (basin-sim --help says "
                                                     "what each does)")
    run.add_argument("--seed", type=int, default=1,
                     help="seed of the run's arrivals and session draws: the same seed gives every policy the same "
                          "arrivals")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    run.add_argument("--plot-dir", type=Path, help="write the timeline PNG here")
    run.add_argument("--overload-rate", type=float,
                     help="sessions/s that x_overload multiplies (default: measured for this shape and workload, "
                          "cached in --rates-file)")
    run.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE, help="the overload-rate cache")
    run.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"),
                     help="peak predictor for policy basin (the shipped pooled model by default)")
    add_reservation_quantile(run)
    add_predictions_source(run)
    run.add_argument("--reservation-scale", type=float, default=1.0,
                     help="basin: a further factor on each reservation (ablations)")
    run.add_argument("--knee-tokens", type=float,
                     help="basin budget: measured cache knee (default: the calibration's, else 0.9 x capacity)")
    run.add_argument("--peak-completion-rate", type=float, help="basin shedding: measured sessions/s (default off)")
    run.add_argument("--calibration", type=Path, help="basin: the knee calibration file (`knee --out`): knee, "
                     "reservation ratio, peak completion rate (the flags above win); without it, the calibration "
                     "cached for this deployment, workload, predictor and quantile, measured on first use")
    run.add_argument("--calibrations-file", type=Path, default=DEFAULT_CALIBRATIONS_FILE,
                     help="the cache of measured Basin calibrations")
    run.add_argument("--no-calibration", action="store_true",
                     help="basin: run uncalibrated on purpose (knee = cache capacity, no reservation ratio)")
    add_commands(sub)
    sub.add_parser("compare", add_help=False, help="the scenario x deployment x policy grid over seeds: goodput "
                   "mean and sd, ratios paired by seed")
    for command in (run, *(sub.choices[name] for name in ("calibrate", "knee", "risk", "ramp"))):
        command.add_argument("--sessions", type=Path, default=DEFAULT_SESSIONS, help="session table (parquet)")
        command.add_argument("--synthetic", action="store_true", help="use the synthetic corpus")
        command.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    for name, command in sub.choices.items():
        command.formatter_class = DefaultsFormatter
        command.epilog = f"example:\n  {EXAMPLES[name]}"
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["compare"]:
        return compare.main(words[1:])
    parser = _parser()
    args = parser.parse_args(words)
    configure_logging(quiet_level(args.quiet))
    try:
        commands = {"calibrate": calibrate_main, "run": _run, "knee": knee_main, "risk": risk_main, "ramp": ramp_main}
        return commands[args.command](args)
    except (catalog.CatalogError, UnknownPolicyError, UsageError, PoolError, PredictorError, CalibrationError,
            RatesError, ScenarioError, RampError, PredictionsError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except ExecutorError as exc:  # no Ray; a ramp that failed twice (named); Ctrl-C (the outstanding cancelled)
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return exit_status(exc)

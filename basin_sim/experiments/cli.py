"""`basin-sim`: the discrete-event model of a PD-disaggregated SGLang deployment, from the command line.

`basin-sim --help` lists every subcommand with one example each; `basin-sim COMMAND --help` gives every option
with its default. Subcommands: `run` (one scenario under one policy), `compare` (a grid over seeds,
basin_sim/experiments/compare.py), `calibrate`, `knee`, `risk`, `ramp` (measurements,
basin_sim/experiments/calibrate/commands.py).
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

from basin_runtime.calibration import CalibrationError
from basin_runtime.logs import configure_logging, quiet_level
from basin_runtime.predictor import PredictorError
from basin_sim import catalog
from basin_sim.experiments import compare
from basin_sim.experiments.calibrate.commands import add_commands, run_command
from basin_sim.experiments.calibrate.rates import RatesError
from basin_sim.experiments.calibrate.sweep import RampError
from basin_sim.experiments.executors import ExecutorError, exit_status
from basin_sim.experiments.flags import add_flags, from_flags
from basin_sim.experiments.help_format import DefaultsFormatter
from basin_sim.experiments.predictions import PredictionsError
from basin_sim.experiments.run_setup import RunSetup, UsageError, prepare_run
from basin_sim.policies import UnknownPolicyError
from basin_sim.run_summary import FIXED_TTL_KEYS, PIN_KEYS
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import PoolError
from basin_sim.workload.scenarios import ScenarioError

log = logging.getLogger(__name__)


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
    """`basin-sim run`: the set-up from the flags, prepared (every input read), simulated, its summary printed."""
    prepared = prepare_run(from_flags(RunSetup, args))
    spec = prepared.spec
    progress = _Progress(spec.scenario.warmup_s + spec.scenario.duration_s,
                         f"{spec.scenario.name}/{spec.deployment.name}/{spec.policy_name}", not args.quiet)
    started = time.perf_counter()
    try:
        result = run_scenario(spec, prepared.pool, progress)
    finally:
        progress.close()
    summary: dict[str, Any] = {"workload": prepared.workload_source,
                               "overload_rate_source": prepared.overload_rate_source,
                               "calibration_source": prepared.calibration_source,
                               "predictions": prepared.prediction_sources, **result.summary}
    log.info("simulated %.0f s in %.1f s wall", result.run_summary.simulated_s, time.perf_counter() - started)
    if args.plot_dir is not None:
        from basin_sim.experiments.plots import plot_run

        path = plot_run(result, args.plot_dir)
        log.info("wrote %s", path)
    shown = policy_fields(summary, spec.policy_name)
    print(json.dumps(shown, sort_keys=True) if args.json else _table(shown))
    return 0


# Summary fields only some policies have (run_summary.summarize writes them all, None or neutral elsewhere).
BASIN_FIELDS = ("knee_tokens", "reservation_ratio", "sessions_admitted", "sessions_overflowed", "calibration_source")
PREDICTOR_FIELDS = ("reservation_scale", "reservation_quantile", "predictions")  # basin alone reads a predictor
OWNERS = {**dict.fromkeys(BASIN_FIELDS, ("basin", "basin-proto")), **dict.fromkeys(PREDICTOR_FIELDS, ("basin",)),
          **dict.fromkeys(PIN_KEYS, ("continuum",)), "suspensions": ("budgeter", "thunderagent"),
          # Continuum's public code measures no T, eta or re-entries: it shares the plain pin counts only
          **dict.fromkeys(("pin_answers", "pin_answer_share", "pin_ttl_mean_s", "pin_tool_time_share"),
                          ("continuum", "continuum-fixed-ttl")),
          **dict.fromkeys(FIXED_TTL_KEYS, ("continuum-fixed-ttl",))}


def policy_fields(summary: dict[str, Any], policy: str) -> dict[str, Any]:
    """`summary` without the fields the policy `policy` does not have (a plain-SGLang run has no pins, budget
    or predictor)."""
    return {k: v for k, v in summary.items() if policy in OWNERS.get(k, (policy,))}


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
  continuum-fixed-ttl
               Continuum's public code: a fixed 2 s pin unless the tool's mean gap > 2 s, kept while the
               job's next call waits; pinned jobs first, then program-level FCFS
  budgeter     the vLLM study's budgeter: sessions' contexts bounded by the KV pool, newest suspended
  basin-proto  Basin's hardware prototype: arrival order, admission by current context, shedding
  basin        Basin: predicted-peak admission (--model), size-aware priority, adaptive budget, shedding
  thunderagent ThunderAgent (Dynamo's router): idle programs paused smallest first over 95 % of the prefill
               KV, their next call held until resumed smallest first under 85 %
  concur       Concur: whole sessions admitted up to an AIMD window moved by the prefix hit rate and the
               decode KV usage; the rest wait at the door, first come first served
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
    add_flags(run, RunSetup)
    run.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    run.add_argument("--plot-dir", type=Path, help="write the timeline PNG here")
    run.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    add_commands(sub)
    sub.add_parser("compare", add_help=False, help="the scenario x deployment x policy grid over seeds: goodput "
                   "mean and sd, ratios paired by seed")
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
        return _run(args) if args.command == "run" else run_command(args)
    except (catalog.CatalogError, UnknownPolicyError, UsageError, PoolError, PredictorError, CalibrationError,
            RatesError, ScenarioError, RampError, PredictionsError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except ExecutorError as exc:  # no Ray; a ramp that failed twice (named); Ctrl-C (the outstanding cancelled)
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return exit_status(exc)

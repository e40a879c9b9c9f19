"""What a user sets up for `basin-sim calibrate|knee|risk|ramp`, and their command lines derived from it.

Rules:
- One frozen set-up per command (`CalibrateSetup`, `KneeSetup`; `RampSetup` for both risk and ramp),
  built from sections every command shares: whose workload (`WorkloadSource`) and how a ramp steps
  (`RampSteps`). Their options are derived from the fields (flags.py); argparse stays in the CLI.
- `add_setup_flags` adds a set-up's options in the order the command's help has always listed them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from basin_sim.experiments.calibrate.knee_ramp import RAMP_FRACTIONS, RAMP_STEP_S
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE
from basin_sim.experiments.executors import LOCAL, ExecutorSpec, add_executor_options
from basin_sim.experiments.flags import add_flags, flag, section
from basin_sim.experiments.predictions import DEFAULT_MODEL
from basin_sim.experiments.run_setup import Inputs
from basin_sim.profile import CacheKind
from basin_sim.workload.pool import DEFAULT_SESSIONS

# The limits ramp (`ramp`) goes on past the overload rate, where some limit must bind: at 1x most
# 30-minute trials already overload (calibrate/overload.py), so 1.5x and 2x leave no deployment whose
# limits all hold unless neither memory is what overloads it (then `none` is the answer). Steps of
# 0.05x from 0.8x to 1x: the shipped deployments go from plateau to collapse within 0.2x there, and
# which limit comes first is decided inside that span.
LIMIT_RAMP_FRACTIONS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1, 1.2, 1.5, 2.0)
ONE_DEPLOYMENT = "a deployment name or .yaml file"


@dataclass(frozen=True)
class WorkloadSource:
    """Whose workload: the scenario, its session table, the overload-rate cache; and the progress bar."""

    scenario: str = flag("steady", "whose workload and clients (name or .yaml; default steady)")
    rates_file: Path = flag(DEFAULT_RATES_FILE, "the overload-rate cache", type=Path)
    tool_time_scale: float | None = flag(None, "override the scenario's workload.tool_time_scale", type=float)
    sessions: Path = flag(DEFAULT_SESSIONS, "session table (parquet)", type=Path)
    synthetic: bool = flag(False, "use the synthetic corpus", action="store_true")
    quiet: bool = flag(False, "no progress bar, warnings only", action="store_true")


@dataclass(frozen=True)
class RampSteps:
    """How a ramp steps: the deployment's cache kind, the seed and the simulated seconds per step."""

    cache: CacheKind | None = flag(None, "override the deployment file's cache kind", choices=("gpu", "host"))
    seed: int = flag(1, "seed of the ramp's arrivals and session draws (default 1)", type=int)
    step_s: float = flag(RAMP_STEP_S, f"simulated seconds per ramp step (default {RAMP_STEP_S:.0f})", type=float)


@dataclass(frozen=True)
class CalibrateSetup:
    """`basin-sim calibrate`: measure a deployment shape's overload rate on a scenario's workload."""

    deployment: str = flag(help=ONE_DEPLOYMENT)
    seeds: int = flag(5, "trials per rate (seeds 1..N)", type=int)
    min_overloaded: int = flag(4, "trials that must overload", type=int)
    horizon_s: float | None = flag(None, "minutes of each steady trial, in seconds (default: 1800 for recorded "
                                   "sessions, 3600 for sessions timed as a serving model runs them)", type=float)
    write: bool = flag(False, "record the rate in the deployment file", action="store_true")
    source: WorkloadSource = section(WorkloadSource)


@dataclass(frozen=True)
class KneeSetup:
    """`basin-sim knee`: the cache knee on a load ramp, with the served predictor's reservations (or none)."""

    deployment: str = flag(help=ONE_DEPLOYMENT)
    out: Path | None = flag(None, "calibration JSON for the gateway (and for --calibration)", type=Path)
    model: Path | None = flag(DEFAULT_MODEL, "the served peak predictor: measures the reservation ratio (default: "
                              "the shipped pooled model)", type=Path)
    # the ramp's reservations follow their revisions at the online model's slots (the gateway's default)
    inputs: Inputs = section(Inputs, only=("reservation_quantile", "predictions", "out_of_fold", "first_call",
                                           "revise_at_calls", "no_revisions", "online_out_of_fold"))
    reservation_scale: float = flag(1.0, "a further factor on each reservation (ablations; default 1)", type=float)
    source: WorkloadSource = section(WorkloadSource)
    steps: RampSteps = section(RampSteps)


@dataclass(frozen=True)
class RampSetup:
    """`basin-sim risk` and `basin-sim ramp`: one ramp per deployment, run on an executor."""

    deployment: tuple[str, ...] = flag(help="deployment names or .yaml files: one ramp each, run on --executor "
                                       "(--json: one line each, in this order)", nargs="+", metavar="DEPLOYMENT")
    json: bool = flag(False, "print one JSON object", action="store_true")
    fractions: tuple[float, ...] | None = flag(None, "ramp rates as multiples of the overload rate", type=float,
                                               nargs="+")
    source: WorkloadSource = section(WorkloadSource)
    steps: RampSteps = section(RampSteps)
    executor: ExecutorSpec = LOCAL  # --executor and --jobs: executors.add_executor_options
    jobs: int = 1


def add_setup_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of `basin-sim <command>` (calibrate, knee, risk, ramp), in their help's order."""
    if command == "calibrate":
        _add(parser, CalibrateSetup, "seeds", "min_overloaded", "horizon_s", "write", "deployment")
    elif command == "knee":
        _add(parser, KneeSetup, "out", "model")
        parser.add_argument("--no-model", dest="model", action="store_const", const=None,
                            help="no predictor: the calibration file holds no reservation_ratio (prototype mode)")
        _add(parser, KneeSetup, "reservation_quantile", "predictions", "out_of_fold", "first_call",
             "revise_at_calls", "no_revisions", "online_out_of_fold", "reservation_scale", "deployment")
    else:
        _add(parser, RampSetup, "deployment")
        add_executor_options(parser)
    _add(parser, WorkloadSource, "scenario", "rates_file")
    if command != "calibrate":
        _add(parser, RampSteps, "cache", "seed", "step_s")
    if command in ("risk", "ramp"):
        fractions = RAMP_FRACTIONS if command == "risk" else LIMIT_RAMP_FRACTIONS
        _add(parser, RampSetup, "json")  # --fractions: its help names the command's own default
        parser.add_argument("--fractions", type=float, nargs="+",
                            help=f"ramp rates as multiples of the overload rate (default {list(fractions)})")
        _add(parser, WorkloadSource, "tool_time_scale")
    _add(parser, WorkloadSource, "sessions", "synthetic", "quiet")


def _add(parser: argparse.ArgumentParser, cls: type[object], *names: str) -> None:
    for name in names:
        add_flags(parser, cls, only=(name,))

"""What a user sets up to run the simulator, and the one chain from that set-up to a `RunSpec`.

Rules:
- `Inputs` is what every run and grid reads besides its scenario, deployment and policy: the session
  pool, the predictor file and where its peaks come from, the reservation quantile and revision calls,
  the overload-rate and knee-calibration caches. `RunSetup` is one `basin-sim run`. Both are frozen;
  their command-line options are derived from their fields (flags.py), so argparse stays in the CLIs.
- The chain, written once: a scenario's pool (`Workload`), then the predictor's peaks, m(q)
  multipliers and online revisions for that pool (`reserving_for`), then a calibration, then
  `run_spec`. `basin-sim run` (`prepare_run`), `basin-sim compare` (compare.py), the knee/risk/ramp
  commands and the stack demo call these pieces; none rebuilds them.
- `run_spec`: only `basin` reads predictions (peaks, m(q), q, revisions, the memory of finished tasks);
  every other policy gets none.
- The memory of finished tasks is on by default, with k from the pipeline's file (`--task-memory`,
  stage task_memory); `--no-task-memory` turns it off (the `basin:no-task-memory` row of compare).
- onnxruntime is imported only when a predictor is loaded or hashed (predictions.py's rule).
- `prepare_run` reads or checks every file the run will read before any work that takes time (an
  overload-rate measurement or a knee ramp takes minutes). Bad input raises `UsageError` naming the
  option.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from basin_runtime.calibration import Calibration, CalibrationError, calibration_from_mapping, load_calibration
from basin_runtime.policy import PolicyError
from basin_runtime.policy.calibrated import check_serves, uncalibrated
from basin_runtime.policy.lending import LENDING_KINDS, LendingKind
from basin_runtime.session_table import Session
from basin_runtime.task_memory import TASK_MEMORY_FILE, Shrinkage, load_shrinkage
from basin_sim import catalog
from basin_sim.experiments.calibrate.knee_cache import DEFAULT_CALIBRATIONS_FILE, KneeCache, cached_knee_calibration
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE, RateCache, overload_rate_for
from basin_sim.experiments.flags import flag, section
from basin_sim.experiments.predictions import (
    DEFAULT_MODEL,
    DEFAULT_OUT_OF_FOLD,
    DEFAULT_RESERVATION_QUANTILE,
    PREDICTION_SOURCES,
    ReservingPredictor,
    Revised,
    Revisions,
    load_out_of_fold,
    model_sha256,
    peaks_tag,
    pool_peaks,
    reservation_multipliers,
    reservation_quantile_arg,
    reserved_peaks,
    revised_reservations,
    revised_tag,
)
from basin_sim.experiments.revisions import (
    DEFAULT_ONLINE_OUT_OF_FOLD,
    load_online_table,
    revision_calls_for,
    revisions_for,
)
from basin_sim.experiments.served import FIRST_CALL_CHOICES, load_served, out_of_fold_column, served_tag
from basin_sim.policies import policy_names, policy_spec
from basin_sim.profile import SESSION_RADIX_CACHE_CHOICES, CacheKind, Deployment
from basin_sim.run_spec import RunSpec
from basin_sim.workload.pool import DEFAULT_SESSIONS, load_pool, token_scale, workload_pool
from basin_sim.workload.scenarios import Scenario

log = logging.getLogger(__name__)


class UsageError(ValueError):
    """Bad input from the command line; the message says what and which names are known."""


@dataclass(frozen=True)
class Inputs:
    """The pool, the predictor and its peaks, the quantile and the caches every run reads (see the rules)."""

    sessions: Path = flag(DEFAULT_SESSIONS, "session table (parquet)", type=Path)
    synthetic: bool = flag(False, "use the synthetic corpus", action="store_true")
    model: Path = flag(DEFAULT_MODEL, "peak predictor for the basin runs (the shipped pooled model by default)",
                       type=Path)
    revise_at_calls: tuple[int, ...] | None = flag(
        None, "basin: re-estimate a session's peak at these calls with the online model beside the model file "
        "(default: the calls that model is trained for, its slots; issue 49 part 1, revisions.py)",
        type=int, nargs="*", metavar="K")
    no_revisions: bool = flag(False, "basin: no online revisions (the first-call reservation and the outgrowth rule "
                              "alone; the basin:no-revisions row of compare)", action="store_true")
    online_out_of_fold: Path = flag(DEFAULT_ONLINE_OUT_OF_FOLD, "the out-of-fold online re-estimates (default "
                                    f"{DEFAULT_ONLINE_OUT_OF_FOLD}, stage online)", type=Path)
    reservation_quantile: float | None = flag(
        DEFAULT_RESERVATION_QUANTILE, "basin: reserve m(Q) x each predicted peak, m from the model file for the "
        f"session's benchmark (default {DEFAULT_RESERVATION_QUANTILE}, as the gateway; 'none': the bare prediction)",
        type=reservation_quantile_arg, metavar="Q")
    predictions: str = flag(
        "out-of-fold", "basin: each session's peak from a model that never saw its task (out-of-fold, the default: "
        "the nested stage's table) or from the shipped model trained on it (in-sample: a near-oracle ablation)",
        choices=PREDICTION_SOURCES)
    out_of_fold: Path = flag(DEFAULT_OUT_OF_FOLD, f"the out-of-fold table (default {DEFAULT_OUT_OF_FOLD}, built by "
                             "`make repro`)", type=Path)
    first_call: str = flag(
        "selected", "basin: the first-call predictor of each benchmark (issue 49): selected (the default: the file "
        "train's selection shipped beside the model file, peak_predictor-<benchmark>.onnx, and the out-of-fold "
        "peaks of the selected procedure) or pooled (the model file alone and its out-of-fold peaks: the ablation)",
        choices=FIRST_CALL_CHOICES)
    task_memory: Path = flag(TASK_MEMORY_FILE, "basin: the memory of finished tasks' shrinkage k (default "
                             f"{TASK_MEMORY_FILE}, stage task_memory)", type=Path)
    no_task_memory: bool = flag(False, "basin: the memory of finished tasks off (the prediction alone is told)",
                                action="store_true")
    rates_file: Path = flag(DEFAULT_RATES_FILE, "the overload-rate cache", type=Path)
    overload_rate: float | None = flag(None, "sessions/s that x_overload multiplies (default: measured for the "
                                       "deployment's shape and workload, cached in --rates-file)", type=float)
    calibrations_file: Path = flag(DEFAULT_CALIBRATIONS_FILE, "the cache of measured Basin calibrations (shared by "
                                   "`basin-sim run` and `compare`)", type=Path)

    def revise_at(self, predictor: object = None) -> Sequence[int]:
        """The calls at which Basin re-estimates a peak: --revise-at-calls, else the slots of `predictor`'s
        online model; none with --no-revisions (revisions.py)."""
        return revision_calls_for(predictor, self.revise_at_calls, not self.no_revisions)

    def peaks_tag(self) -> str:
        """What a knee calibration's peaks depend on beyond the model file (predictions.peaks_tag)."""
        return peaks_tag(self.predictions, self.out_of_fold, served_tag(self.model, self.first_call))

    def shrinkage(self) -> Shrinkage | None:
        """The memory of finished tasks as these inputs set it (None: off); a bad file raises TaskMemoryError."""
        return None if self.no_task_memory else load_shrinkage(self.task_memory)


@dataclass(frozen=True)
class RunSetup:
    """One `basin-sim run`: a scenario on a deployment under a policy, one seed, and how Basin is told and measured."""

    scenario: str = flag(help=lambda: f"one of {', '.join(catalog.names(catalog.SCENARIOS_DIR))}, or a scenario "
                         ".yaml file")
    deployment: str = flag(help=lambda: f"one of {', '.join(catalog.names(catalog.DEPLOYMENTS_DIR))}, or a "
                           "deployment .yaml file")
    policy: str = flag(help=lambda: f"one of {', '.join(policy_names())} (basin-sim --help says what each does)")
    cache: CacheKind | None = flag(None, "override the deployment file's cache kind (host: the HiCache host tier)",
                                   choices=("gpu", "host"))
    lending: LendingKind | None = flag(None, "override the deployment file's lending switch (none: stock SGLang; "
                                       "decode-memory: idle decode memory lent to the prefix cache)",
                                       choices=LENDING_KINDS)
    session_radix_cache: str | None = flag(None, "override the deployment file's session_radix_cache (false: off; "
                                           "faithful: SGLang's code under PD, inert on prefill; true: its intended "
                                           "semantics on the prefill tree, hypothetical)",
                                           choices=tuple(SESSION_RADIX_CACHE_CHOICES))
    seed: int = flag(1, "seed of the run's arrivals and session draws: the same seed gives every policy the same "
                     "arrivals", type=int)
    inputs: Inputs = section(Inputs)
    reservation_scale: float = flag(1.0, "basin: a further factor on each reservation (ablations)", type=float)
    knee_tokens: float | None = flag(None, "basin budget: measured cache knee (default: the calibration's, else 0.9 x "
                                     "capacity)", type=float)
    peak_completion_rate: float | None = flag(None, "basin shedding: measured sessions/s (default off)", type=float)
    calibration: Path | None = flag(None, "basin: the knee calibration file (`knee --out`): knee, reservation ratio, "
                                    "peak completion rate (the flags above win); without it, the calibration cached "
                                    "for this deployment, workload, predictor and quantile, measured on first use",
                                    type=Path)
    no_calibration: bool = flag(False, "basin: run uncalibrated on purpose (knee = cache capacity, no reservation "
                                "ratio)", action="store_true")


@dataclass(frozen=True)
class Workload:
    """A scenario and the pool it draws from, with the pool's token scale (workload.median_peak_tokens)."""

    scenario: Scenario
    pool: tuple[Session, ...]
    token_scale: float

    @classmethod
    def of(cls, scenario: Scenario, base: Sequence[Session]) -> Workload:
        """The scenario's workload pool drawn from the base pool."""
        return cls(scenario, tuple(workload_pool(base, scenario.workload)), token_scale(base, scenario.workload))


@dataclass(frozen=True)
class Reserving:
    """What Basin is told of a pool: predicted peaks (and how many came from where), m(q), online revisions and the
    memory of finished tasks (None: off)."""

    peaks: dict[str, float] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    multipliers: dict[str, float] = field(default_factory=dict)
    revisions: Revisions = field(default_factory=dict)
    task_memory: Shrinkage | None = None

    def reserved(self, scale: float = 1.0) -> dict[str, float]:
        """Pool session id -> what it reserves at arrival (scale x m(q) x peak)."""
        return reserved_peaks(self.peaks, self.multipliers, scale)

    def revised(self, scale: float = 1.0) -> Revised:
        """Pool session id -> call k -> what it reserves from its revision at call k on (the knee ramp holds
        these, so the reservation ratio is measured for the reservations Basin will hold)."""
        return revised_reservations(self.revisions, scale)


NOT_RESERVING = Reserving()


def reserving_for(predictor: ReservingPredictor, pool: Sequence[Session], scale: float, inputs: Inputs,
                  quantile: float | None, revise_at: Sequence[int] = ()) -> Reserving:
    """The predictor's peaks for `pool` (from `inputs.predictions`), its m(`quantile`) and revisions at `revise_at`
    (from the same source: revisions.py)."""
    peaks, sources = pool_peaks(predictor, pool, inputs.predictions, inputs.out_of_fold, scale,
                                out_of_fold_column(inputs.first_call))
    revisions = revisions_for(predictor, pool, peaks, quantile, revise_at, inputs.predictions,
                              inputs.online_out_of_fold, scale)
    return Reserving(peaks, sources, reservation_multipliers(predictor, pool, quantile), revisions,
                     inputs.shrinkage())


def run_spec(scenario: Scenario, deployment: Deployment, policy: str, seed: int, rate_per_s: float,
             calibration: Calibration | None, reserving: Reserving = NOT_RESERVING, quantile: float | None = None,
             reservation_scale: float = 1.0, policy_overrides: Mapping[str, Any] | None = None,
             latency_gate: bool = False) -> RunSpec:
    """The run of `policy`; only `basin` is handed the predictions (peaks, m(q), q, revisions, task memory)."""
    told = reserving if policy == "basin" else NOT_RESERVING
    return RunSpec(scenario, deployment, policy, seed, rate_per_s, predicted_peak_tokens=told.peaks,
                   reservation_scale=reservation_scale, calibration=calibration,
                   reservation_multipliers=told.multipliers,
                   reservation_quantile=quantile if policy == "basin" else None, revisions=told.revisions,
                   policy_overrides=policy_overrides or {}, latency_gate=latency_gate,
                   task_memory=told.task_memory)


@dataclass(frozen=True)
class PreparedRun:
    """A `basin-sim run` ready to simulate: its spec and pool, and where each measured input came from."""

    spec: RunSpec
    pool: tuple[Session, ...]
    workload_source: str  # 'table' or 'synthetic'
    overload_rate_source: str
    calibration_source: str
    prediction_sources: dict[str, int]


def prepare_run(setup: RunSetup) -> PreparedRun:
    """The run `setup` describes, every input read (rates and knees cached, else measured now)."""
    predictor = _check_inputs(setup)
    inputs = setup.inputs
    scenario = catalog.load_scenario(setup.scenario)
    deployment_spec = catalog.load_deployment(setup.deployment)
    override = setup.session_radix_cache
    session_cache = None if override is None else SESSION_RADIX_CACHE_CHOICES[override]
    deployment = deployment_spec.build(cache_for(setup.policy, setup.cache, deployment_spec.cache), setup.lending,
                                       session_cache)
    base, source = load_pool(inputs.sessions, inputs.synthetic)
    workload = Workload.of(scenario, base)
    rate, rate_source = _overload_rate(inputs, deployment, workload.pool, scenario)
    reserving = NOT_RESERVING if predictor is None else reserving_for(
        predictor, workload.pool, workload.token_scale, inputs, inputs.reservation_quantile,
        inputs.revise_at(predictor))
    calibration, calibration_source = _calibration(setup, deployment), "given"
    if setup.policy in ("basin", "basin-proto") and calibration is None:
        if setup.no_calibration:
            calibration_source = "none (--no-calibration: knee taken as the cache capacity)"
        else:
            calibration, calibration_source = _knee_calibration(setup, deployment_spec.build("gpu", setup.lending,
                                                                                             session_cache),
                                                                workload, rate, reserving)
    spec = run_spec(scenario, deployment, setup.policy, setup.seed, rate, calibration, reserving,
                    inputs.reservation_quantile, setup.reservation_scale)
    return PreparedRun(spec, workload.pool, source, rate_source, calibration_source, reserving.sources)


def cache_for(policy: str, cache: str | None, file_cache: CacheKind) -> CacheKind:
    """--cache, else the deployment file's; `hicache` (sglang with the host tier) switches a GPU file to host."""
    spec = policy_spec(policy)
    if cache is None:
        return "host" if spec.uses_host_tier else file_cache
    if spec.uses_host_tier and cache != "host":
        raise UsageError(f"policy {policy!r} needs the host tier; use --cache host (or leave --cache out)")
    return "host" if cache == "host" else "gpu"


def _check_inputs(setup: RunSetup) -> ReservingPredictor | None:
    """Every file the run will read, read or checked before any work that takes time; the predictor for basin."""
    policy_spec(setup.policy)  # an unknown name lists the known ones
    if setup.calibration is not None and not setup.calibration.is_file():
        raise UsageError(f"--calibration {setup.calibration}: no such file")
    if setup.policy != "basin":
        return None
    predictor = load_served(setup.inputs.model, setup.inputs.first_call)  # an unusable file: PredictorError naming it
    if setup.inputs.predictions == "out-of-fold":  # a missing table: PredictionsError naming it and `make repro`
        load_out_of_fold(setup.inputs.out_of_fold, out_of_fold_column(setup.inputs.first_call))
        if not setup.inputs.no_revisions:  # a bad online table: PredictionsError naming it (a missing one: a warning)
            load_online_table(setup.inputs.online_out_of_fold)
    setup.inputs.shrinkage()  # a missing or bad task-memory file: TaskMemoryError naming it
    return predictor


def _overload_rate(inputs: Inputs, deployment: Deployment, pool: Sequence[Session],
                   scenario: Scenario) -> tuple[float, str]:
    """--overload-rate, or the cached (else measured now) rate of this shape and workload."""
    if inputs.overload_rate is not None:
        if not inputs.overload_rate > 0:
            raise UsageError(f"--overload-rate must be > 0, got {inputs.overload_rate}")
        return inputs.overload_rate, "--overload-rate"
    if not scenario.needs_overload_rate:  # a closed population, or every segment in per_min: never calibrate
        return 0.0, "no x_overload segment (no overload rate)"
    return overload_rate_for(deployment, pool, scenario.workload, scenario.clients, RateCache(inputs.rates_file))


def _knee_calibration(setup: RunSetup, gpu: Deployment, workload: Workload, rate: float,
                      reserving: Reserving) -> tuple[Calibration, str]:
    """The knee calibration cached for this run's key (basin: its predictor, peaks and q), else measured now."""
    inputs, is_basin = setup.inputs, setup.policy == "basin"
    revised = reserving.revised() if is_basin else {}
    knee, source = cached_knee_calibration(
        gpu, workload.pool, workload.scenario, rate, model_sha256(inputs.model) if is_basin else "none",
        inputs.reservation_quantile if is_basin else None, reserving.reserved() if is_basin else None,
        KneeCache(inputs.calibrations_file), inputs.peaks_tag() if is_basin else "", revised or None,
        revised_tag(revised))
    log.info("Basin calibration (%s, %s): knee %.0f tokens, reservation ratio %s", source, inputs.calibrations_file,
             knee.calibration.knee_tokens, knee.record.get("reservation_ratio"))
    return knee.calibration, source


def _calibration(setup: RunSetup, deployment: Deployment) -> Calibration | None:
    """The calibration file's measurements, with --knee-tokens and --peak-completion-rate winning over them."""
    calibration = None if setup.calibration is None else load_calibration(setup.calibration)
    if calibration is not None:  # measured for this predictor, quantile and lending (when the file says)
        is_basin = setup.policy == "basin"
        try:
            check_serves(calibration,
                         model_sha256(setup.inputs.model) if is_basin else calibration.predictor_sha256 or "none",
                         setup.inputs.reservation_quantile if is_basin else calibration.reservation_quantile,
                         deployment.lending)
        except PolicyError as exc:
            raise UsageError(f"--calibration {setup.calibration}: {exc}") from exc
    if setup.knee_tokens is None and setup.peak_completion_rate is None:
        return calibration
    if calibration is None:
        calibration = uncalibrated(float(deployment.cache_capacity_tokens))
    knee = calibration.knee_tokens if setup.knee_tokens is None else setup.knee_tokens
    rate = calibration.peak_completion_rate_per_s if setup.peak_completion_rate is None else setup.peak_completion_rate
    try:
        measured = {**asdict(calibration), "knee_tokens": knee, "peak_completion_rate_per_s": rate}
        return calibration_from_mapping(measured, "the command line (--knee-tokens / --peak-completion-rate)")
    except CalibrationError as exc:
        raise UsageError(str(exc)) from exc

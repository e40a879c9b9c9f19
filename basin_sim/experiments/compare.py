"""`basin-sim compare` (`python -m basin_sim.experiments.compare`): goodput per scenario x deployment x policy
over seeds.

The comparison grid: scenarios x deployments x lending x policies x seeds, each run in the simulator.

Rules:
- Every claim is over seeds (>= 10 by default): a cell reports the mean goodput per hour and its
  standard deviation over seeds, beside the hit-rate drop (pre-surge minus goodput window, points),
  the first-call wait p50 (mean over seeds of each run's median over window sessions, a shed one
  counted until it was shed), the shed share and the share of seeds whose run is stuck (`is_stuck`).
- Each scenario brings its workload (benchmarks or preset, tool time, clients): its pool, its
  predictions and, per deployment shape, its overload rate (calibrate/rates.py; measured first if
  not cached, before any run), so every policy and lending switch of a cell sees the same arrivals.
- Lending is a deployment switch (`--lending`, default: each deployment file's own): every policy
  runs under each value asked for, so admission and priority are judged with and without it.
- Basin runs are calibrated as `basin-sim run` calibrates them: the knee calibration cached for the
  deployment's shape (GPU cache), its lending, the workload, the predictor file and the quantile
  (calibrate/knee_cache.py, `--calibrations-file`); a missing one is measured on the knee ramp
  before the runs, said on stderr and cached. `basin-proto` gets the same knee (r does not apply to
  it). `hicache` runs `sglang` on the deployment with its host tier.
- Runs (and missing knee ramps) fan out over `--executor` (executors.py): this machine's `--jobs` worker
  processes, or Ray tasks; the cells are the shared input, sent once. A run that fails twice stops the
  grid naming it (exit 1); Ctrl-C cancels what is outstanding (exit 130). Per-seed values are kept in the
  JSON output, the same whichever executor ran them; `--plot-dir` draws one PNG per scenario (goodput by
  policy and ablation, mean ± sd).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from basin_runtime.markdown_table import markdown_table
from basin_runtime.model_files import file_sha256
from basin_runtime.policy.lending import LENDING_KINDS, LendingKind
from basin_runtime.predictor import PredictorError
from basin_runtime.session_table import Session, SessionTableError
from basin_sim import catalog
from basin_sim.experiments.ablations import (
    ABLATIONS,
    SESSION_CACHE,
    Reservation,
    calibration_tag,
    reservations,
    split_label,
)
from basin_sim.experiments.calibrate.knee_cache import KneeCache, KneeCalibration, knee_key, measure_knee
from basin_sim.experiments.calibrate.knee_ramp import RAMP_STEP_S
from basin_sim.experiments.calibrate.rates import RateCache, RatesError, overload_rate_for
from basin_sim.experiments.executors import (
    LOCAL,
    Executor,
    ExecutorError,
    ExecutorSpec,
    Job,
    add_executor_options,
    exit_status,
    open_executor,
)
from basin_sim.experiments.flags import add_flags, flag, from_flags, section
from basin_sim.experiments.help_format import DefaultsFormatter
from basin_sim.experiments.predictions import (
    PredictionsError,
    ReservingPredictor,
    reservation_multipliers,
    revised_tag,
)
from basin_sim.experiments.revisions import revisions_for
from basin_sim.experiments.run_setup import NOT_RESERVING, Inputs, Reserving, Workload, reserving_for, run_spec
from basin_sim.experiments.served import load_served
from basin_sim.policies import policy_names
from basin_sim.policies.base import AdmissionReport, PauseReport, TaskMemoryReport
from basin_sim.profile import Deployment
from basin_sim.run_summary import FIXED_TTL_KEYS
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import PoolError, load_pool
from basin_sim.workload.scenarios import Scenario, ScenarioError

POLICIES = ("sglang", "hicache", "continuum", "budgeter", "basin-proto", "basin")
DEFAULT_SEEDS = tuple(range(1, 11))
KEPT = ("scenario", "deployment", "lending", "policy", "seed", "goodput_per_hour", "hit_rate_pre", "hit_rate_post",
        "sessions_arrived", "sessions_shed", "shed_share", "sessions_abandoned", "first_call_wait_p50_s",
        "ttft_p50_post_s", "recovered_after_s", "backlog_drained_after_s", "is_stuck", "suspensions",
        "held_cache_share", "pin_answer_share", "pin_ttl_mean_s", "pin_tool_time_share", "pin_queue_delay_s")
# what a field baseline did, in its rows only (PauseReport, FixedTtlReport, SessionCacheReport), and Basin's task
# memory (TaskMemoryReport, with it on): absent otherwise
FIELD_KEPT = (*(f.name for f in dataclasses.fields(PauseReport)), *FIXED_TTL_KEYS,
              *(f.name for f in dataclasses.fields(AdmissionReport)), "session_cache",
              *(f.name for f in dataclasses.fields(TaskMemoryReport)))
CellKey = tuple[str, str, str]  # scenario, deployment, lending
# what Continuum's pins did (None for a policy that never pins), averaged over seeds
PIN_COLUMNS = ("held_cache_share", "pin_tool_time_share", "pin_ttl_mean_s", "pin_queue_delay_s")


@dataclass(frozen=True)
class Cell:
    """What every run of one (scenario, deployment, lending) shares: pool, predictions, rate, Basin's calibration."""

    scenario: Scenario
    deployment: catalog.DeploymentSpec
    lending: LendingKind
    pool: tuple[Session, ...]
    overload_rate_per_s: float
    calibration: KneeCalibration | None  # the served reservations' knee (None until calibrated, or none needed)
    reserving: Reserving = NOT_RESERVING  # peaks, m(q) at the served q and revisions (empty: no predictor)
    reservation_quantile: float | None = None
    predictor_sha256: str = "none"
    swept: dict[float, Reserving] = field(default_factory=dict)  # q -> m(q), revisions (peaks the served ones)
    ramp_step_s: float = RAMP_STEP_S  # simulated seconds per knee-ramp step
    peaks_tag: str = ""  # where the peaks come from beyond the model file (predictions.peaks_tag)
    unselected: Reserving | None = None  # basin:no-selection: the pooled model file's peaks and m(q) (served.py)
    unselected_tag: str = ""  # its peaks' tag

    def reserving_at(self, quantile: float | None) -> tuple[float | None, Reserving]:
        """(q, what Basin is told) at the served q (None) or a swept one."""
        if quantile is None:
            return self.reservation_quantile, self.reserving
        return quantile, self.swept[quantile]

    def reserved_as(self, kind: Reservation, quantile: float | None = None) -> Reserving:
        """What Basin is told under a reservation kind (ablations.py) at the served q (None) or a swept one."""
        q, told = self.reserving_at(quantile)
        if kind == "pooled-first-call":
            if self.unselected is None:
                raise ValueError(f"{self.name()}: basin:no-selection runs with its pooled peaks, which were not loaded")
            return self.unselected
        peaks, multipliers = reservations(kind, self.pool, told.peaks, told.multipliers, q)
        return dataclasses.replace(told, peaks=peaks, multipliers=multipliers)

    def name(self) -> str:
        """scenario/deployment/lending, as the runs' rows name them."""
        return f"{self.scenario.name}/{self.deployment.name}/{self.lending}"

    def gpu_deployment(self) -> Deployment:
        """The cell's deployment with a GPU cache (its knee's shape) and its lending switch."""
        return self.deployment.build("gpu", self.lending)


KneeKind = tuple[Reservation, bool]  # a reservation kind, and whether its reservations follow their revisions


def _knee(cells: Mapping[CellKey, Cell], key: CellKey, kind: Reservation, revises: bool) -> KneeCalibration:
    """A job: the knee ramp of one cell and reservation kind (with its revisions when `revises`)."""
    cell = cells[key]
    told = cell.reserved_as(kind)
    return measure_knee(cell.gpu_deployment(), cell.pool, cell.scenario, cell.overload_rate_per_s,
                        cell.predictor_sha256 if kind in ("predicted", "pooled-first-call") else "none",  # no file
                        cell.reservation_quantile, told.reserved(), cell.ramp_step_s,
                        revised=told.revised() if revises else None)


def _run(cells: Mapping[CellKey, Cell], key: CellKey, label: str, seed: int,
         knee: KneeCalibration | None) -> dict[str, Any]:
    """A job: one run of a policy, or of an ablation of `basin` (`label` "basin:<part>"), reported under `label`."""
    cell = cells[key]
    base, session_cache = split_label(label)
    variant = ABLATIONS.get(base)
    policy = "basin" if variant is not None else base
    calibration = knee.calibration if policy in ("basin", "basin-proto") and knee is not None else None
    q, _ = cell.reserving_at(variant.quantile if variant is not None else None)
    told = cell.reserved_as(_kind(label), variant.quantile if variant is not None else None)
    if variant is not None and not variant.revisions:
        told = dataclasses.replace(told, revisions={})
    if (variant is not None and not variant.task_memory) or _kind(label) != "predicted":
        told = dataclasses.replace(told, task_memory=None)
    deployment = cell.deployment.build("host" if policy == "hicache" else None, cell.lending,
                                       True if session_cache else None)
    run = run_spec(cell.scenario, deployment, policy,
                   seed, cell.overload_rate_per_s, calibration, told, q,
                   policy_overrides=variant.overrides if variant is not None else {},
                   latency_gate=variant is not None and variant.latency_gate)
    summary = run_scenario(run, cell.pool).run_summary
    row = summary.to_json()
    return {**{k: row[k] for k in KEPT}, "policy": label, **{k: row[k] for k in FIELD_KEPT if k in row},
            **minute_series(summary.timeline)}


def minute_series(timeline: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """A run's time-resolved results, one value per minute after warm-up (3 significant digits): the hit rate,
    and the first-call wait p50 of the regular sessions arriving in that minute."""
    def compact(value: float | None) -> float | None:
        return None if value is None else float(f"{value:.3g}")

    return {"minute_hit_rate": [compact(e["hit_rate"]) for e in timeline],
            "minute_first_call_wait_s": [compact(e["first_call_wait_p50_s"]) for e in timeline]}


def _kind(label: str) -> Reservation:
    """The reservation kind whose knee calibration a row label runs with."""
    variant = ABLATIONS.get(split_label(label)[0])
    return variant.reservation if variant is not None else "predicted"


def _knee_kind(label: str) -> KneeKind:
    """The knee a row label runs with: its reservation kind, and whether they follow revisions (basin and its
    ablations that keep them; the ramp then measures r for the reservations the run will hold)."""
    base = split_label(label)[0]
    variant = ABLATIONS.get(base)
    return _kind(label), (variant.revisions if variant is not None else base == "basin")


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """Per (scenario, deployment, lending, policy): seeds, goodput mean and sd, hit-rate drop (points), first-call
    wait p50 (mean of the runs' medians), shed share, share stuck (means over seeds)."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["deployment"], row.get("lending", "none"), row["policy"]),
                          []).append(row)
    cells = {}
    for key, runs in groups.items():
        goodputs = [r["goodput_per_hour"] for r in runs]
        cells[key] = {"seeds": len(runs), "goodput_mean": statistics.fmean(goodputs),
                      "goodput_sd": statistics.stdev(goodputs) if len(goodputs) > 1 else 0.0,
                      "hit_rate_drop_points": _mean([100 * (r["hit_rate_pre"] - r["hit_rate_post"]) for r in runs
                                                     if r.get("hit_rate_pre") is not None
                                                     and r.get("hit_rate_post") is not None]),
                      "first_call_wait_p50_s": _mean([r["first_call_wait_p50_s"] for r in runs
                                                      if r.get("first_call_wait_p50_s") is not None]),
                      "shed_share": _mean([r["shed_share"] for r in runs if "shed_share" in r]),
                      "share_stuck": sum(bool(r["is_stuck"]) for r in runs) / len(runs),
                      **{key: _mean([r[key] for r in runs if r.get(key) is not None]) for key in PIN_COLUMNS}}
    return cells


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """One row per (scenario, deployment, lending, policy), policies in the order given: goodput mean ± sd /h,
    hit-rate drop, first-call wait p50, shed share, share of seeds stuck, and what pins held (Continuum: the
    share of the cache held between calls, the share of tool time pinned, T)."""
    cells = aggregate(rows)
    head = ["scenario", "deployment", "lending", "policy", "goodput /h", "hit-rate drop (points)",
            "first-call wait p50", "shed", "stuck", "pinned: cache, tool time, T"]
    body = []
    seen = dict.fromkeys((s, d, lend) for s, d, lend, _ in cells)
    for scenario, deployment, lending in seen:
        for policy in policies:
            cell = cells.get((scenario, deployment, lending, policy))
            if cell is None:
                continue
            body.append([scenario, deployment, lending, policy,
                         f"{cell['goodput_mean']:,.0f} ± {cell['goodput_sd']:,.0f}",
                         _shown(cell["hit_rate_drop_points"], ".1f"),
                         f"{_shown(cell['first_call_wait_p50_s'], '.1f')} s", _shown(cell["shed_share"], ".1%"),
                         f"{cell['share_stuck']:.0%}", _pinned(cell)])
    return markdown_table(head, body)


def paired(rows: Sequence[dict[str, Any]], reference: str = "continuum") -> str:
    """Per (scenario, deployment, lending) and label, goodput over `reference`'s in the same cell and seed (the
    same arrivals), as mean ± sd over seeds and the seeds ahead; a seed whose reference is 0 is left out.
    Lending rows are paired with the reference without lending too: the paper's Basin lends, Continuum does
    not."""
    by = {(r["scenario"], r["deployment"], r.get("lending", "none"), r["policy"], r["seed"]):
          float(r["goodput_per_hour"]) for r in rows}
    head = ["scenario", "deployment", "lending", "label", f"/ {reference} (same lending)",
            f"/ {reference} without lending", "seeds ahead"]
    body = []
    labels = dict.fromkeys((s, d, lend, p) for s, d, lend, p, _ in by if p != reference)
    for scenario, deployment, lending, label in labels:
        seeds = sorted(seed for s, d, lend, p, seed in by if (s, d, lend, p) == (scenario, deployment, lending, label))
        same = _ratios(by, seeds, (scenario, deployment, lending, label), (scenario, deployment, lending, reference))
        bare = _ratios(by, seeds, (scenario, deployment, lending, label), (scenario, deployment, "none", reference))
        if same is None and bare is None:
            continue
        shown = same if same is not None else bare
        assert shown is not None
        body.append([scenario, deployment, lending, label, _ratio_text(same), _ratio_text(bare),
                     f"{sum(r > 1 for r in shown)} of {len(shown)}"])
    return markdown_table(head, body)


def _ratios(by: Mapping[tuple[str, str, str, str, int], float], seeds: Sequence[int], top: tuple[str, str, str, str],
            bottom: tuple[str, str, str, str]) -> list[float] | None:
    ratios = [by[(*top, s)] / by[(*bottom, s)] for s in seeds if by.get((*bottom, s))]
    return ratios or None


def _ratio_text(ratios: Sequence[float] | None) -> str:
    if ratios is None:
        return "-"
    sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    return f"{statistics.fmean(ratios):.3f} ± {sd:.3f}"


def _pinned(cell: Mapping[str, Any]) -> str:
    if cell["pin_tool_time_share"] is None:
        return "-"
    return (f"{_shown(cell['held_cache_share'], '.0%')}, {cell['pin_tool_time_share']:.0%}, "
            f"T {_shown(cell['pin_queue_delay_s'], '.1f')} s")


@dataclass(frozen=True)
class Grid:
    """Scenarios x deployments x lending switches (None: each file's own), each cell run for these labels."""

    scenarios: tuple[str, ...]
    deployments: tuple[str, ...]
    lending: tuple[LendingKind, ...] | None
    labels: tuple[str, ...]
    seeds: tuple[int, ...] | None = None  # the grid's own seeds (a held-out set), else the comparison's


_SESSION_POLICIES = ("sglang", "continuum", "budgeter", "basin-proto", "basin")  # hicache = sglang on a host tier
_PAPER_POLICIES = ("sglang", "continuum", "basin-proto", "basin")
PAPER_SURGES = ("paper-timed-surge-100", "paper-timed-kill-burst", "paper-timed-kill-burst-keep",
                "paper-swebench-pro-surge-100")
_FIELD = ("sglang", "continuum", "continuum-fixed-ttl", "budgeter", "thunderagent", "concur", "basin")
FIELD_LABELS = (*_FIELD, *(label + SESSION_CACHE for label in _FIELD))
ISSUE_49_ABLATIONS = ("basin:no-revisions", "basin:no-task-memory", "basin:no-recovery", "basin:knee-budget",
                      "basin:no-selection")  # one per part of issue 49 that the simulator models
HELD_OUT_SCENARIOS = ("heldout-tb-surge-200-20min", "heldout-tb-burst-2x-keep", "heldout-tb-steady-0.7",
                      "heldout-swepro-burst-3x-keep")
PRESETS: dict[str, tuple[Grid, ...]] = {
    # The evaluation in the paper's regime (sessions timed as the paper's model runs them, issue 34) on its
    # 1P3D H200 node: the three Terminal-Bench scenarios (the paper-sized preset) and the surge on
    # SWE-bench-Pro-like sessions, every policy without lending and with the paper's decode-memory lending
    # (the paper's Basin and its prototype lend; Continuum and SGLang do not: compare across the two);
    # each workload's steady reference; every ablation of Basin without lending.
    "paper": (
        Grid(PAPER_SURGES, ("1p3d",), ("none", "decode-memory"), _PAPER_POLICIES),
        Grid(("paper-timed-steady", "paper-swebench-pro-steady"), ("1p3d",), ("none", "decode-memory"),
             _PAPER_POLICIES),
        Grid(PAPER_SURGES, ("1p3d",), ("none",), tuple(name for name in ABLATIONS if name != "basin")),
    ),
    # The field (issue 48) in the paper's regime on its 1P3D H200 node: the Terminal-Bench scenarios and the
    # SWE-bench-Pro-like ones, steady and surged, every baseline (plain SGLang, Continuum's paper and its public
    # code, the Bursts paper's budgeter, ThunderAgent, Concur) and Basin, each with and without SGLang's session
    # cache, no lending (no field baseline lends); and an ablation of Basin per part of issue 49 in the surges.
    "field": (Grid((*PAPER_SURGES, "paper-timed-steady", "paper-swebench-pro-steady"), ("1p3d",), ("none",),
                   FIELD_LABELS),
              Grid(PAPER_SURGES, ("1p3d",), ("none",), ISSUE_49_ABLATIONS)),
    # Held out (issue 49), committed before Basin's issue-49 parts were built, to be run once, at the end:
    # other deployments (the H100 1P3D, cache first; the H100 3P1D, decode first) and the paper's node, other
    # rates and shapes (a +200% surge for 20 minutes, a 2x burst kept for 20 minutes, steady at 0.7, a
    # SWE-bench-Pro-like 3x burst kept), other seeds (11-20); every field baseline and Basin, no lending.
    "held-out": (Grid(HELD_OUT_SCENARIOS, ("1p3d", "1p3d-h100", "3p1d"), ("none",), _FIELD,
                      tuple(range(11, 21))),),
    # The earlier evaluation, on recorded session timing and the H100 1P3D (README: "The evaluation on
    # recorded timing"): the paper's +100% surge with Terminal-Bench-like and SWE-bench-like sessions, GPU
    # cache and host tier, every policy without lending, with decode-memory lending and (host tier) with
    # stock SGLang's storage offload; each workload's steady reference; Basin's ablations; a decode-first
    # deployment.
    "recorded-h100": (
        Grid(("surge-100-terminal-bench", "surge-100-swebench"), ("1p3d-h100", "1p3d-h100-host"),
             ("none", "decode-memory"), _SESSION_POLICIES),
        # stock SGLang's lending (decode offload to HiCache storage) needs the host tier: SGLang's storage
        # backend sits under --enable-hierarchical-cache
        Grid(("surge-100-terminal-bench", "surge-100-swebench"), ("1p3d-h100-host",), ("storage-offload",),
             _SESSION_POLICIES),
        Grid(("steady-terminal-bench", "steady-swebench"), ("1p3d-h100",), ("none",), ("sglang", "continuum", "basin")),
        Grid(("surge-100-terminal-bench", "surge-100-swebench"), ("1p3d-h100",), ("none",),
             tuple(name for name in ABLATIONS if name != "basin")),
        Grid(("surge-100",), ("3p1d",), ("none",), ("sglang", "continuum", "budgeter", "basin")),
    ),
}


def _grids(args: argparse.Namespace) -> tuple[Grid, ...]:
    """The preset's grids, or the one grid of --scenarios x --deployments x --lending x (--policies, --ablations)."""
    if args.preset is not None:
        return PRESETS[args.preset]
    labels = tuple(dict.fromkeys([*args.policies, *args.ablations]))  # an ablation named "basin" is the policy
    return (Grid(tuple(args.scenarios), tuple(args.deployments), tuple(args.lending) if args.lending else None,
                 labels),)


@dataclass(frozen=True)
class CompareSetup:
    """A comparison: its grids, the seeds each cell runs, what every run reads, where the runs go, what is written."""

    grids: tuple[Grid, ...]
    seeds: tuple[int, ...] = flag(DEFAULT_SEEDS, "every cell runs once per seed; a seed gives every policy the same "
                                  "arrivals", type=int, nargs="+")
    inputs: Inputs = section(Inputs)
    ramp_step_s: float = flag(RAMP_STEP_S, f"simulated seconds per knee-ramp step (default {RAMP_STEP_S:.0f}; part "
                              "of the cache key)", type=float)
    executor: ExecutorSpec = LOCAL  # --executor and --jobs: executors.add_executor_options
    jobs: int = 1
    out: Path | None = flag(None, "JSON with every run, the cells' rates and calibrations", type=Path)
    plot_dir: Path | None = flag(None, "write one PNG per scenario here (goodput by policy, ± sd)", type=Path)

    @property
    def labels(self) -> list[str]:
        """Every label of the grids, in order."""
        return list(dict.fromkeys(label for grid in self.grids for label in grid.labels))


def _cells(setup: CompareSetup) -> tuple[dict[CellKey, Cell], dict[CellKey, list[str]], dict[CellKey, list[int]]]:
    """Every cell of the grids with its pool, predictions and overload rate, the labels it runs and its seeds."""
    inputs = setup.inputs
    base, _ = load_pool(inputs.sessions, inputs.synthetic)
    labels = {split_label(label)[0] for label in setup.labels}
    needs_model = "basin" in labels or any(label in ABLATIONS for label in labels)
    predictor = load_served(inputs.model, inputs.first_call) if needs_model else None
    sha = file_sha256(inputs.model) if predictor is not None else "none"
    swept_qs = sorted({v.quantile for label in labels if (v := ABLATIONS.get(label)) is not None
                       and v.quantile is not None})
    loaded: dict[str, tuple[Workload, Reserving, dict[float, Reserving]]] = {}
    unselected: dict[str, Reserving] = {}  # basin:no-selection's peaks per scenario (served.py: --first-call pooled)
    pooled = dataclasses.replace(inputs, first_call="pooled")
    wants_pooled = predictor is not None and "basin:no-selection" in labels and inputs.first_call != "pooled"
    pooled_predictor = load_served(inputs.model, "pooled") if wants_pooled else None
    rates: dict[tuple[str, str], float] = {}
    cells: dict[CellKey, Cell] = {}
    cell_labels: dict[CellKey, list[str]] = {}
    cell_seeds: dict[CellKey, list[int]] = {}
    tag = ""  # set once the first pool's peaks are read (their table checked)
    for grid in setup.grids:
        for scenario_name in grid.scenarios:
            if scenario_name not in loaded:
                loaded[scenario_name] = _predicted(catalog.load_scenario(scenario_name), base, predictor, inputs,
                                                   swept_qs)
                tag = tag or (inputs.peaks_tag() if loaded[scenario_name][1].sources else "")
                if pooled_predictor is not None:
                    workload = loaded[scenario_name][0]
                    unselected[scenario_name] = reserving_for(pooled_predictor, workload.pool, workload.token_scale,
                                                              pooled, inputs.reservation_quantile,
                                                              pooled.revise_at(pooled_predictor))
            workload, served, swept = loaded[scenario_name]
            for deployment_name in grid.deployments:
                spec = catalog.load_deployment(deployment_name)
                if (scenario_name, deployment_name) not in rates:
                    rates[(scenario_name, deployment_name)] = _rate(workload, spec, grid, inputs)
                for lending in grid.lending or (spec.lending,):
                    key = (scenario_name, deployment_name, lending)
                    cells[key] = Cell(workload.scenario, spec, lending, workload.pool,
                                      rates[(scenario_name, deployment_name)], None, served,
                                      inputs.reservation_quantile, sha, swept, setup.ramp_step_s, tag,
                                      unselected.get(scenario_name, served if predictor is not None else None),
                                      pooled.peaks_tag() if wants_pooled else tag)
                    cell_labels[key] = list(dict.fromkeys([*cell_labels.get(key, []), *grid.labels]))
                    cell_seeds[key] = sorted({*cell_seeds.get(key, []), *(grid.seeds or setup.seeds)})
    return cells, cell_labels, cell_seeds


def _predicted(scenario: Scenario, base: Sequence[Session], predictor: ReservingPredictor | None, inputs: Inputs,
               swept_qs: Sequence[float]) -> tuple[Workload, Reserving, dict[float, Reserving]]:
    """A scenario's workload, what Basin is told of it at the served q, and at each swept q (same peaks)."""
    workload = Workload.of(scenario, base)
    if predictor is None:
        return workload, NOT_RESERVING, {}
    calls = inputs.revise_at(predictor)
    served = reserving_for(predictor, workload.pool, workload.token_scale, inputs, inputs.reservation_quantile, calls)
    if served.sources:
        print(f"{scenario.name}: peaks {served.sources}", file=sys.stderr)
    swept = {q: dataclasses.replace(served, multipliers=reservation_multipliers(predictor, workload.pool, q),
                                    revisions=revisions_for(predictor, workload.pool, served.peaks, q, calls,
                                                            inputs.predictions, inputs.online_out_of_fold,
                                                            workload.token_scale))
             for q in swept_qs}
    return workload, served, swept


def _rate(workload: Workload, spec: catalog.DeploymentSpec, grid: Grid, inputs: Inputs) -> float:
    """The overload rate of a scenario's workload on a deployment's shape: given, cached, else measured (said)."""
    scenario = workload.scenario
    if not (scenario.needs_overload_rate or any(label.startswith("basin") for label in grid.labels)):
        return 0.0  # absolute arrivals and no knee ramp to scale: nothing to calibrate
    if inputs.overload_rate is not None:
        return inputs.overload_rate
    rate, source = overload_rate_for(spec.build("gpu"), workload.pool, scenario.workload, scenario.clients,
                                     RateCache(inputs.rates_file))
    print(f"{scenario.name} on {spec.name}: overload rate {rate:.4f}/s ({source})", file=sys.stderr)
    return rate


def _calibrated(cells: dict[CellKey, Cell], kinds: Mapping[CellKey, Sequence[KneeKind]], cache: KneeCache,
                executor: Executor) -> dict[tuple[CellKey, Reservation, bool], KneeCalibration]:
    """Per cell and knee kind its cached knee calibration; missing ones measured now (in parallel), said and
    cached. Cells of one shape (a host tier's and its GPU deployment) share a knee."""
    keys = {(key, kind, revises): knee_key(cell.gpu_deployment(), cell.pool, cell.scenario,
                                           calibration_tag(kind, cell.predictor_sha256, cell.reservation_quantile),
                                           cell.reservation_quantile, cell.ramp_step_s,
                                           cell.peaks_tag if kind == "predicted" else
                                           cell.unselected_tag if kind == "pooled-first-call" else "",
                                           revised_tag(cell.reserved_as(kind).revised()) if revises else "")
            for key, cell in cells.items() for kind, revises in kinds[key]}
    records = {knee: cache.get(knee) for knee in set(keys.values())}
    first = {knee: job for job, knee in reversed(keys.items())}
    missing = [knee for knee, record in records.items() if record is None]
    measured = executor.run([Job(f"knee ramp of {cells[first[knee][0]].name()} ({first[knee][1]} reservations)",
                                 _knee, first[knee]) for knee in missing], "knee ramps")
    for knee, record in zip(missing, measured, strict=True):
        (key, kind, revises) = first[knee]
        cell = cells[key]
        records[knee] = record
        cache.put(knee, record, cell.gpu_deployment(), cell.scenario)
        print(f"{cell.scenario.name} on {cell.deployment.name} (lending {cell.lending}, reservation {kind}"
              f"{', revised' if revises else ''}): Basin "
              f"calibration measured now on the knee ramp, cached in {cache.path}", file=sys.stderr)
    return {job: found for job, knee in keys.items() if (found := records[knee]) is not None}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="basin-sim compare", description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsFormatter,
                                     epilog="example:\n  basin-sim compare --scenarios surge-100 --deployments 1p3d "
                                            "--policies sglang basin --seeds 1 2 3")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named set of grids instead of --scenarios/--deployments/--lending/--policies/"
                             "--ablations (paper: the evaluation in the paper's regime, policy table, steady "
                             "references and ablations; field: every field baseline and Basin, with and without "
                             "SGLang's session cache; held-out: other deployments, rates and seeds 11-20, run once "
                             "at the end of issue 49; recorded-h100: the earlier one on recorded timing)")
    parser.add_argument("--scenarios", nargs="+", default=["steady", "surge-100", "kill-burst"],
                        help="names or .yaml files")
    parser.add_argument("--deployments", nargs="+", default=["1p3d-h100"], help="names or .yaml files")
    parser.add_argument("--lending", nargs="+", choices=LENDING_KINDS,
                        help="run every policy under each of these lending switches (default: each deployment "
                             "file's own)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES),
                        help=f"policy names (basin-sim --help says what each does); a name ending in {SESSION_CACHE} "
                             "runs that policy with SGLang's session-aware radix cache on prefill (intended semantics)")
    parser.add_argument("--ablations", nargs="*", default=[], choices=list(ABLATIONS), metavar="ABLATION",
                        help=f"also run these ablations of basin ({', '.join(ABLATIONS)}); each is a row")
    add_flags(parser, CompareSetup)
    add_executor_options(parser)
    return parser


@dataclass(frozen=True)
class GridResult:
    """Every run of some grids (sorted by cell, label and seed), the labels in order, and each cell as run."""

    rows: list[dict[str, Any]]
    labels: list[str]
    cells: dict[CellKey, Cell]
    seeds: tuple[int, ...]  # every seed any cell ran

    def summary(self) -> dict[tuple[str, str, str, str], dict[str, Any]]:
        """`aggregate` of the rows."""
        return aggregate(self.rows)

    def cells_json(self) -> dict[str, dict[str, Any]]:
        """Each cell's overload rate and calibration record (None: uncalibrated), by its name."""
        return {c.name(): {"overload_rate_per_s": c.overload_rate_per_s,
                           "calibration": None if c.calibration is None else dict(c.calibration.record)}
                for c in self.cells.values()}


def run_grids(setup: CompareSetup) -> GridResult:
    """Calibrate each cell (cached), then run every label of each cell over `setup.seeds` on `setup.executor`
    (local: `setup.jobs` processes); the cells go to the workers once.

    Raises the loaders' errors (catalog, predictor, session table, pool, rates, scenario, OSError) and
    `ExecutorError` (a run that failed twice, or Ctrl-C)."""
    cells, cell_labels, cell_seeds = _cells(setup)
    with open_executor(setup.executor, cells, setup.jobs) as executor:
        kinds = {key: sorted({_knee_kind(label) for label in cell_labels[key]
                              if (base := split_label(label)[0]) in ("basin", "basin-proto") or base in ABLATIONS})
                 for key in cells}
        knees = _calibrated(cells, kinds, KneeCache(setup.inputs.calibrations_file), executor)
        cells = {key: dataclasses.replace(cell, calibration=knees.get((key, "predicted", True))
                                          or knees.get((key, "predicted", False)))
                 for key, cell in cells.items()}
        rows = executor.run([Job(f"{cell.name()}/{label} seed {seed}", _run,
                                 (key, label, seed, knees.get((key, *_knee_kind(label)))))
                             for key, cell in cells.items() for label in cell_labels[key] for seed in cell_seeds[key]],
                            "runs")
    names = [(cell.scenario.name, cell.deployment.name, cell.lending) for cell in cells.values()]
    order = {name: k for k, name in enumerate(names)}
    rows.sort(key=lambda r: (order[(r["scenario"], r["deployment"], r["lending"])], r["policy"], r["seed"]))
    seeds = tuple(sorted({seed for cell_seed_list in cell_seeds.values() for seed in cell_seed_list}))
    return GridResult(rows, setup.labels, cells, seeds)


def main(argv: list[str] | None = None) -> int:
    """Calibrate each cell (cached), run the grid over seeds, print the Markdown table."""
    args = _parser().parse_args(argv)
    setup = from_flags(CompareSetup, args, grids=_grids(args), executor=args.executor, jobs=args.jobs)
    unknown = [label for label in setup.labels if split_label(label)[0] not in {*policy_names(), *ABLATIONS}]
    if unknown:  # before any rate or knee is measured
        print(f"basin-sim compare: error: unknown policy {', '.join(map(repr, unknown))}; known: "
              f"{', '.join(policy_names())} (each may end in {SESSION_CACHE})", file=sys.stderr)
        return 2
    try:
        result = run_grids(setup)
    except (catalog.CatalogError, PredictorError, SessionTableError, PoolError, RatesError, ScenarioError,
            PredictionsError, OSError) as exc:  # one line, no traceback
        print(f"basin-sim compare: error: {exc}", file=sys.stderr)
        return 2
    except ExecutorError as exc:  # no Ray; a run that failed twice (named); Ctrl-C (the outstanding cancelled)
        print(f"basin-sim compare: {exc}", file=sys.stderr)
        return exit_status(exc)
    print(markdown(result.rows, result.labels))
    if "continuum" in result.labels:
        print("\nPaired by seed (same arrivals), goodput over Continuum's:\n")
        print(paired(result.rows))
    doc = {"seeds": result.seeds, "predictions": setup.inputs.predictions, "labels": result.labels,
           "cells": result.cells_json(), "summary": {"/".join(k): v for k, v in result.summary().items()},
           "runs": result.rows}
    if setup.plot_dir is not None:
        from basin_sim.experiments.plots import plot_compare_doc

        for path in plot_compare_doc(doc, setup.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    if setup.out is not None:
        setup.out.parent.mkdir(parents=True, exist_ok=True)
        setup.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

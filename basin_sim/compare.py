# The comparison grid: scenarios x deployments x policies x seeds, each run in the simulator.
#
# Rules:
# - Every claim is over seeds (>= 10 by default): a cell reports the mean goodput per hour, its
#   standard deviation over seeds, and the share of seeds whose run is stuck (`is_stuck`).
# - Each scenario brings its workload (benchmarks or preset, tool time, clients): its pool, its
#   predictions and, per deployment shape, its overload rate (calibrate/rates.py; measured first if
#   not cached, before any run), so every policy of a cell sees the same arrivals.
# - Basin runs use the knee calibration measured on each deployment's ramp with the same predictor
#   and workload (knee, reservation ratio, peak completion rate; `basin-sim knee`), as an operator
#   would calibrate before deploying; `basin-proto` gets the same knee (its reservations are contexts).
#   `hicache` runs `sglang` on the deployment with its host tier.
# - Runs fan out over `--jobs` worker processes; per-seed values are kept in the JSON output.
"""`basin-sim compare` (`python -m basin_sim.compare`): goodput per scenario x deployment x policy over seeds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from basin_runtime.calibration import calibration_from_mapping
from basin_runtime.predictor import PredictorError
from basin_runtime.session_table import Session, SessionTableError
from basin_sim import catalog
from basin_sim.calibrate.commands import knee_record
from basin_sim.calibrate.rates import DEFAULT_RATES_FILE, RateCache, RatesError, overload_rate_for
from basin_sim.predictions import (
    Revisions,
    add_reservation_quantile,
    load_predictor,
    online_revisions,
    predict_pool,
    reservation_multipliers,
    reserved_peaks,
)
from basin_sim.simulate import RunSpec, run_scenario
from basin_sim.workload.pool import PoolError, load_pool, workload_pool
from basin_sim.workload.scenarios import Scenario, ScenarioError

POLICIES = ("sglang", "hicache", "continuum", "basin-proto", "basin")
DEFAULT_SEEDS = tuple(range(1, 11))
KEPT = ("scenario", "deployment", "policy", "seed", "goodput_per_hour", "hit_rate_pre", "hit_rate_post",
        "sessions_shed", "sessions_abandoned", "ttft_p50_post_s", "recovered_after_s", "is_stuck")


@dataclass(frozen=True)
class Cell:
    """What every run of one (scenario, deployment) shares: pool, predictions, rate, Basin's calibration."""

    scenario: Scenario
    deployment: catalog.DeploymentSpec
    pool: tuple[Session, ...]
    peaks: dict[str, float]
    overload_rate_per_s: float
    calibration: dict[str, Any] | None
    multipliers: dict[str, float] = field(default_factory=dict)  # m(q) per pool session (empty: bare peaks)
    reservation_quantile: float | None = None
    revisions: Revisions = field(default_factory=dict)  # the online re-estimates Basin applies


_CELLS: dict[tuple[str, str], Cell] = {}


def _init(cells: dict[tuple[str, str], Cell]) -> None:
    _CELLS.update(cells)


def _knee(cell: Cell, seed: int) -> dict[str, Any]:
    return knee_record(cell.deployment.build("gpu"), cell.pool, cell.overload_rate_per_s, seed,
                       reserved_peaks(cell.peaks, cell.multipliers),
                       f"basin-sim knee --deployment {cell.deployment.name} --scenario {cell.scenario.name}")


def _run(key: tuple[str, str], policy: str, seed: int, knee: dict[str, Any] | None) -> dict[str, Any]:
    cell = _CELLS[key]
    calibration = None
    if policy in ("basin", "basin-proto") and knee is not None:
        calibration = calibration_from_mapping(knee, f"the {cell.deployment.name} knee ramp")
    run = RunSpec(cell.scenario, cell.deployment.build("host" if policy == "hicache" else None), policy, seed,
                  cell.overload_rate_per_s, predicted_peak_tokens=cell.peaks if policy == "basin" else {},
                  calibration=calibration, reservation_multipliers=cell.multipliers if policy == "basin" else {},
                  reservation_quantile=cell.reservation_quantile if policy == "basin" else None,
                  revisions=cell.revisions if policy == "basin" else {})
    summary = run_scenario(run, cell.pool).summary
    return {k: summary[k] for k in KEPT}


def aggregate(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (scenario, deployment, policy): seeds, goodput mean and standard deviation, share stuck."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["deployment"], row["policy"]), []).append(row)
    cells = {}
    for key, runs in groups.items():
        goodputs = [r["goodput_per_hour"] for r in runs]
        cells[key] = {"seeds": len(runs), "goodput_mean": statistics.fmean(goodputs),
                      "goodput_sd": statistics.stdev(goodputs) if len(goodputs) > 1 else 0.0,
                      "share_stuck": sum(bool(r["is_stuck"]) for r in runs) / len(runs)}
    return cells


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """One row per (scenario, deployment), one column per policy: goodput mean ± sd /h, share of seeds stuck."""
    cells = aggregate(rows)
    lines = ["| scenario | deployment | " + " | ".join(policies) + " |", "| --- | --- |" + " --- |" * len(policies)]
    seen = dict.fromkeys((s, d) for s, d, _ in cells)
    for scenario, deployment in seen:
        values = []
        for policy in policies:
            cell = cells.get((scenario, deployment, policy))
            values.append("-" if cell is None else f"{cell['goodput_mean']:,.0f} ± {cell['goodput_sd']:,.0f} "
                                                   f"(stuck {cell['share_stuck']:.0%})")
        lines.append(f"| {scenario} | {deployment} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def _cells(args: argparse.Namespace) -> dict[tuple[str, str], Cell]:
    """Load every scenario and deployment; per cell its pool, predictions and overload rate."""
    base, _ = load_pool(args.sessions, args.synthetic)
    predictor = load_predictor(args.model) if "basin" in args.policies else None
    cache = RateCache(args.rates_file)
    cells = {}
    for scenario_name in args.scenarios:
        scenario = catalog.load_scenario(scenario_name)
        pool = tuple(workload_pool(base, scenario.workload))
        peaks = {} if predictor is None else predict_pool(predictor, pool)
        q = args.reservation_quantile
        multipliers = {} if predictor is None else reservation_multipliers(predictor, pool, q)
        revisions = {} if predictor is None else online_revisions(predictor, pool, peaks, q, args.revise_at_calls)
        for deployment_name in args.deployments:
            spec = catalog.load_deployment(deployment_name)
            needs_rate = scenario.needs_overload_rate or any(p.startswith("basin") for p in args.policies)
            if not needs_rate:  # absolute arrivals and no knee ramp to scale: nothing to calibrate
                cells[(scenario_name, deployment_name)] = Cell(scenario, spec, pool, peaks, 0.0, None, multipliers, q,
                                                               revisions)
                continue
            rate, source = overload_rate_for(spec.build("gpu"), pool, scenario.workload, scenario.clients, cache)
            print(f"{scenario.name} on {spec.name}: overload rate {rate:.4f}/s ({source})", file=sys.stderr)
            cells[(scenario_name, deployment_name)] = Cell(scenario, spec, pool, peaks, rate, None, multipliers, q,
                                                           revisions)
    return cells


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="basin-sim compare", description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=["steady", "surge-100", "kill-burst"],
                        help="names or .yaml files")
    parser.add_argument("--deployments", nargs="+", default=["1p3d"], help="names or .yaml files")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    parser.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"))
    add_reservation_quantile(parser)
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE, help="the overload-rate cache")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)")
    parser.add_argument("--out", type=Path, help="JSON with every run, the cells' rates and calibrations")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Calibrate each cell, run the grid over seeds, print the Markdown table."""
    args = _parser().parse_args(argv)
    try:
        cells = _cells(args)
    except (catalog.CatalogError, PredictorError, SessionTableError, PoolError, RatesError, ScenarioError,
            OSError) as exc:  # one line, no traceback
        print(f"basin-sim compare: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(cells,)) as executor:
        if any(p in ("basin", "basin-proto") for p in args.policies):
            knees = {key: executor.submit(_knee, cell, args.seeds[0]) for key, cell in cells.items()}
            cells = {key: dataclasses.replace(cell, calibration=knees[key].result()) for key, cell in cells.items()}
        futures: list[Future[dict[str, Any]]] = [executor.submit(_run, key, p, seed, cell.calibration)
                                                 for key, cell in cells.items() for p in args.policies
                                                 for seed in args.seeds]
        rows = []
        for done, future in enumerate(as_completed(futures), 1):
            rows.append(future.result())
            print(f"\r{done}/{len(futures)} runs, {time.perf_counter() - started:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    names = {key: (cell.scenario.name, cell.deployment.name) for key, cell in cells.items()}
    order = {name: k for k, name in enumerate(names.values())}
    rows.sort(key=lambda r: (order[(r["scenario"], r["deployment"])], r["policy"], r["seed"]))
    print(markdown(rows, args.policies))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {f"{s}/{d}": {"overload_rate_per_s": cells[key].overload_rate_per_s,
                             "calibration": cells[key].calibration} for key, (s, d) in names.items()}
        summary = {"/".join(k): v for k, v in aggregate(rows).items()}
        args.out.write_text(json.dumps({"seeds": args.seeds, "cells": meta, "summary": summary, "runs": rows},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

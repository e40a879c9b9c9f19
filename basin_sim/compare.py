# The comparison table: scenarios x deployments x policies x seeds, each run in the simulator.
#
# Rules:
# - Basin runs use the knee calibration measured on each deployment's ramp with the same predictor
#   (knee, reservation ratio, peak completion rate; `python -m basin_sim knee`), as an operator would
#   calibrate before deploying; `basin-proto` gets the same knee (its reservations are contexts).
# - Every deployment runs at its own calibrated overload rate (scenarios set the load fraction);
#   `hicache` uses the host-tier deployment and its own rate.
# - Runs fan out over `--jobs` worker processes; the table is the mean goodput per hour over seeds,
#   and the per-seed values are kept in the JSON output.
"""`python -m basin_sim.compare`: goodput per scenario x deployment x policy, as a Markdown table."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from basin_runtime.calibration import calibration_from_mapping
from basin_runtime.predictor import PredictorError
from basin_runtime.session_table import Session, SessionTableError
from basin_sim import catalog
from basin_sim.calibrate.commands import RAMP_FRACTIONS, RAMP_STEP_S, calibration_record
from basin_sim.calibrate.ramp import run_ramp
from basin_sim.predictions import load_predictor, predict_pool
from basin_sim.profile import CacheKind
from basin_sim.simulate import RunSpec, run_scenario
from basin_sim.workload.pool import load_pool

POLICIES = ("sglang", "hicache", "continuum", "basin-proto", "basin")
_STATE: dict[str, Any] = {}


def _init(pool: Sequence[Session], workload: str, peaks: dict[str, float]) -> None:
    _STATE.update(pool=pool, workload=workload, peaks=peaks)


def _calibrate(deployment_name: str, seed: int) -> dict[str, Any]:
    spec = catalog.load_deployment(deployment_name)
    deployment = spec.build("gpu")
    rate = spec.overload_rate("gpu", _STATE["workload"])
    steps = run_ramp(deployment, _STATE["pool"], [f * rate for f in RAMP_FRACTIONS], RAMP_STEP_S, seed,
                     _STATE["peaks"])
    return calibration_record(deployment, steps, f"python -m basin_sim knee --deployment {deployment_name}")


def _run(scenario: str, deployment_name: str, policy: str, seed: int, calibration: dict[str, Any]) -> dict[str, Any]:
    spec = catalog.load_deployment(deployment_name)
    cache: CacheKind = "host" if policy == "hicache" else "gpu"
    run = RunSpec(catalog.load_scenario(scenario), spec.build(cache), policy, seed,
                  spec.overload_rate(cache, _STATE["workload"]),
                  predicted_peak_tokens=_STATE["peaks"] if policy == "basin" else {},
                  calibration=calibration_from_mapping(calibration, f"the {deployment_name} knee ramp")
                  if policy in ("basin", "basin-proto") else None)
    summary = run_scenario(run, _STATE["pool"]).summary
    return {key: summary[key] for key in ("scenario", "deployment", "policy", "seed", "goodput_per_hour",
                                          "hit_rate_post", "sessions_shed", "ttft_p50_post_s")}


def markdown(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """Mean goodput per hour over seeds: one row per (scenario, deployment), one column per policy."""
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for row in rows:
        cells.setdefault((row["scenario"], row["deployment"]), {}).setdefault(row["policy"], []).append(
            row["goodput_per_hour"])
    lines = ["| scenario | deployment | " + " | ".join(policies) + " |", "| --- | --- |" + " --- |" * len(policies)]
    for (scenario, deployment), by_policy in cells.items():
        values = [f"{statistics.fmean(by_policy[p]):,.0f}" if p in by_policy else "-" for p in policies]
        lines.append(f"| {scenario} | {deployment} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_sim.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", default=["steady", "surge-33", "surge-100", "surge-200",
                                                           "kill-burst"])
    parser.add_argument("--deployments", nargs="+", default=["1p3d", "1p1d"])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"))
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--out", type=Path, help="JSON with every run and the calibrations")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Calibrate each deployment, run the grid, print the Markdown table."""
    args = _parser().parse_args(argv)
    try:
        pool, workload = load_pool(args.sessions, args.synthetic)
        peaks = predict_pool(load_predictor(args.model), pool)
        deployment_names = [catalog.load_deployment(name).name for name in args.deployments]
        scenario_names = [catalog.load_scenario(name).name for name in args.scenarios]
    except (catalog.CatalogError, PredictorError, SessionTableError, OSError) as exc:  # one line, no traceback
        print(f"python -m basin_sim.compare: error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, initializer=_init, initargs=(pool, workload, peaks)) as executor:
        calibrations = {name: executor.submit(_calibrate, name, args.seeds[0]) for name in args.deployments}
        measured = {name: future.result() for name, future in calibrations.items()}  # by the name given
        for name, record in zip(deployment_names, measured.values(), strict=True):
            print(f"{name}: knee {record['knee_tokens']:,} tokens, reservation ratio "
                  f"{record.get('reservation_ratio')}", file=sys.stderr)
        futures = [executor.submit(_run, s, d, p, seed, measured[d]) for s in args.scenarios
                   for d in args.deployments for p in args.policies for seed in args.seeds]
        rows = []
        for done, future in enumerate(as_completed(futures), 1):
            rows.append(future.result())
            print(f"\r{done}/{len(futures)} runs, {time.perf_counter() - started:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    order = {(s, d): k for k, (s, d) in enumerate((s, d) for s in scenario_names for d in deployment_names)}
    rows.sort(key=lambda r: (order[(r["scenario"], r["deployment"])], r["policy"], r["seed"]))
    print(markdown(rows, args.policies))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        by_name = {spec: measured[given] for spec, given in zip(deployment_names, args.deployments, strict=True)}
        args.out.write_text(json.dumps({"workload": workload, "seeds": args.seeds, "calibrations": by_name,
                                        "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The DVC stage `simulate`: a compact scenario set with the freshly trained predictor; goodput per policy
and per reservation quantile, into metrics.json and plots.

Basin reserves m(q) x each predicted peak, m read from the model file for the session's benchmark
(as the gateway does), revised at calls 3 and 5 with the online model beside the file, at the
served quantile (`simulate.reservation_quantile`, 0.9 like the
gateway's default). First the knee ramp with the fresh model at that q (`basin-sim knee`'s
calibration: knee, reservation ratio r, peak completion rate), written where the gateway can read
it; every Basin run uses it.

The quantile sweep (`simulate.quantiles`) runs Basin at each q twice on `simulate.sweep_scenario`
(surge-100-30min: a surge long enough that admission engages, which on the 10-minute surge-100 it
does not at every seed, and a sweep of runs that all admit everyone shows nothing):
- `r_fixed`: the served calibration as it is. The budget B = r x knee is in reservation units, so
  reserving more per session (a larger q) admits fewer sessions into the same B: fewer admissions,
  fewer overflows (sessions whose context outgrew their first reservation).
- `r_remeasured`: a knee ramp at that q first. r is the plateau's reservations over contexts, so it
  scales with m(q) and B with it: the working set admitted stays near the knee whatever q is; q then
  only changes who outgrows their reservation, and the order of admission.

    python -m pipeline.simulate --params params.yaml --model data/models/peak_predictor.onnx \
        --sessions data/sessions.parquet --out-metrics metrics/simulate.json \
        --out-calibration data/simulate/calibration.json --plot-dir data/simulate/

The metrics are kept in git (`metrics/simulate.json`, compared by `dvc metrics diff`), so they hold
only results of the simulation: the stage's wall time is logged, not written. They are also logged
as one MLflow run `simulate`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from basin_runtime.calibration import calibration_from_mapping
from basin_runtime.model_files import file_sha256
from basin_sim import catalog
from basin_sim.calibrate.commands import RAMP_STEP_S, knee_record
from basin_sim.calibrate.rates import DEFAULT_RATES_FILE, RateCache, overload_rate_for
from basin_sim.predictions import (
    DEFAULT_RESERVATION_QUANTILE,
    load_predictor,
    online_revisions,
    predict_pool,
    reservation_multipliers,
    reserved_peaks,
)
from basin_sim.simulate import RunSpec, run_scenario
from basin_sim.workload.pool import load_pool, workload_pool
from pipeline import tracking
from pipeline.metrics_files import numbers_only, write_metrics
from pipeline.params import simulate_params

log = logging.getLogger(__name__)

RUNS = (("surge-100", "sglang"), ("surge-100", "continuum"), ("surge-100", "budgeter"), ("surge-100", "basin-proto"),
        ("surge-100", "basin"),
        ("steady", "sglang"), ("steady", "basin"))
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.95)
SWEEP_SCENARIO = "surge-100-30min"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"))
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--out-metrics", type=Path, default=Path("metrics/simulate.json"))
    parser.add_argument("--headline", type=Path, help="goodput.json to write (the headline numbers)")
    parser.add_argument("--out-calibration", type=Path, default=Path("data/simulate/calibration.json"),
                        help="the knee calibration measured with the fresh model (the gateway's --calibration)")
    parser.add_argument("--ramp-step-s", type=float, default=RAMP_STEP_S, help="simulated seconds per ramp step")
    parser.add_argument("--plot-dir", type=Path, default=Path("data/simulate"))
    parser.add_argument("--params", type=Path, help="read deployment, seed and quantiles from this params.yaml")
    parser.add_argument("--deployment", default="1p3d")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--reservation-quantile", type=float, default=DEFAULT_RESERVATION_QUANTILE)
    parser.add_argument("--quantiles", type=float, nargs="+", default=list(QUANTILES))
    parser.add_argument("--sweep-scenario", default=SWEEP_SCENARIO, help="the scenario of the quantile sweep")
    parser.add_argument("--scenario-override", help="run every scenario as this one (tests: a tiny .yaml)")
    parser.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE,
                        help="the overload-rate cache (measured on first use for this deployment and workload)")
    parser.add_argument("--overload-rate", type=float, help="use this overload rate instead (sessions/s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the compact set; write metrics and one timeline PNG per run."""
    args = _parser().parse_args(argv)
    if args.params is not None:
        params = simulate_params(args.params)
        args.deployment, args.seed = params.deployment, params.seed
        args.reservation_quantile, args.quantiles = params.reservation_quantile, list(params.quantiles)
        args.sweep_scenario = params.sweep_scenario
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from basin_sim.plots import plot_run

    started = time.perf_counter()
    base, workload = load_pool(args.sessions, False)
    names = {name for name, _ in RUNS} | {args.sweep_scenario}
    scenarios = {name: catalog.load_scenario(args.scenario_override or name) for name in names}
    pool = workload_pool(base, scenarios["surge-100"].workload)
    predictor = load_predictor(args.model)
    peaks = predict_pool(predictor, pool)
    spec = catalog.load_deployment(args.deployment)
    deployment = spec.build("gpu")
    rate = args.overload_rate or overload_rate_for(deployment, pool, scenarios["surge-100"].workload,
                                                   scenarios["surge-100"].clients, RateCache(args.rates_file))[0]
    served_q = args.reservation_quantile
    metrics: dict[str, Any] = {"workload": workload, "deployment": spec.name, "seed": args.seed,
                               "reservation_quantile": served_q, "runs": {}, "sweep_scenario": args.sweep_scenario,
                               "quantile_sweep": {}}

    model_sha256 = file_sha256(args.model)
    multipliers = {q: reservation_multipliers(predictor, pool, q) for q in {served_q, *args.quantiles}}
    revisions = {q: online_revisions(predictor, pool, peaks, q) for q in multipliers}

    def calibrate(q: float) -> dict[str, Any]:
        return knee_record(deployment, pool, rate, args.seed, reserved_peaks(peaks, multipliers[q]),
                           f"python -m pipeline.simulate (reservation quantile {q:g})", args.ramp_step_s,
                           predictor_sha256=model_sha256, reservation_quantile=q)

    calibration = calibrate(served_q)
    args.out_calibration.parent.mkdir(parents=True, exist_ok=True)
    args.out_calibration.write_text(json.dumps(calibration, indent=2) + "\n")
    metrics["calibration"] = {k: v for k, v in calibration.items() if k != "notes"}
    log.info("knee %d tokens, reservation ratio %s at q %g", calibration["knee_tokens"],
             calibration.get("reservation_ratio"), served_q)

    def run(scenario_name: str, policy: str, q: float = served_q, measured: dict[str, Any] = calibration,
            plot: bool = True) -> dict[str, Any]:
        result = run_scenario(RunSpec(
            scenarios[scenario_name], deployment, policy, args.seed, rate, predicted_peak_tokens=peaks,
            reservation_multipliers=multipliers[q], reservation_quantile=q,
            revisions=revisions[q] if policy == "basin" else {},
            calibration=calibration_from_mapping(measured, "the stage's knee ramp")), pool)
        if plot:
            plot_run(result, args.plot_dir)
        return result.summary

    for scenario_name, policy in RUNS:
        summary = run(scenario_name, policy)
        metrics["runs"][f"{scenario_name}/{policy}"] = {k: summary[k] for k in (
            "goodput_per_hour", "hit_rate_pre", "hit_rate_post", "ttft_p50_post_s", "sessions_shed")}
        log.info("%s/%s: goodput %.0f/h", scenario_name, policy, summary["goodput_per_hour"])
    runs = metrics["runs"]
    basin = runs["surge-100/basin"]["goodput_per_hour"]
    for other in ("surge-100/continuum", "steady/sglang", "steady/basin"):
        goodput = runs[other]["goodput_per_hour"]
        key = f"basin_over_{other.replace('/', '_').replace('-', '_')}"
        metrics[key] = round(basin / goodput, 3) if goodput else None
    for q in args.quantiles:
        remeasured = calibration if q == served_q else calibrate(q)
        row: dict[str, Any] = {"multiplier_all_rows": predictor.multiplier(q)}
        for name, measured in (("r_fixed", calibration), ("r_remeasured", remeasured)):
            summary = run(args.sweep_scenario, "basin", q, measured, plot=False)
            row[name] = _sweep_entry(summary, measured)
            log.info("%s/basin at q %g, %s (r %.2f): goodput %.0f/h, %d admitted, %.1f%% overflowed",
                     args.sweep_scenario, q, name, row[name]["reservation_ratio"], summary["goodput_per_hour"],
                     summary["sessions_admitted"],
                     100 * (row[name]["overflow_share"] or 0.0))
        metrics["quantile_sweep"][f"q{q:g}"] = row
    log.info("simulate: %.1f s", time.perf_counter() - started)
    write_metrics(args.out_metrics, metrics)
    if args.headline is not None:
        write_metrics(args.headline, numbers_only({  # surge-100, seed as above
            "basin_per_h": basin, "vs_continuum": metrics["basin_over_surge_100_continuum"],
            "vs_steady": metrics["basin_over_steady_sglang"]}))
    tracking.configure()
    tracking.log_run("simulate", {"deployment": spec.name, "seed": args.seed, "model": str(args.model),
                                  "reservation_quantile": served_q}, metrics, {"basin.model": str(args.model)})
    return 0


def _sweep_entry(summary: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    admitted = summary["sessions_admitted"]
    return {"reservation_ratio": measured.get("reservation_ratio", 1.0),
            "goodput_per_hour": summary["goodput_per_hour"],
            "sessions_admitted": admitted, "sessions_overflowed": summary["sessions_overflowed"],
            "overflow_share": summary["sessions_overflowed"] / admitted if admitted else None,
            "hit_rate_post": summary["hit_rate_post"], "first_call_wait_p50_s": summary["first_call_wait_p50_s"]}


if __name__ == "__main__":
    raise SystemExit(main())

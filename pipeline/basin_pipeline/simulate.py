"""The DVC stage `simulate`: the evaluation's headline row with the freshly trained predictor, over seeds.

In the paper's regime: the kept burst (`simulate.scenario`, paper-timed-kill-burst-keep: the one
Terminal-Bench scenario that overloads the paper's node here) on its 1P3D H200 (`simulate.deployment`,
1p3d, its own lending switch: none, as stock SGLang) for `simulate.policies` (sglang, continuum,
basin-proto, basin), and Basin on the steady reference (`simulate.steady_scenario`), every run
over `simulate.seeds` (10): the grid runs through `basin_sim.experiments.compare.run_grids`, so a cell is
calibrated, cached and run exactly as `basin-sim compare` runs it. Basin reserves m(q) x each
predicted peak (m from the file serving the session's benchmark, q = `simulate.reservation_quantile`,
as the gateway serves: the `peak_predictor-<benchmark>.onnx` beside the model, train's selection, unless
`--first-call pooled`); each peak is the nested stage's out-of-fold prediction (the selected procedure's, a
choice and models that never saw the session's task: `--out-of-fold`; `--predictions in-sample` for the
shipped models' own, a near-oracle); each online revision, at the online model's slots, is the online
stage's out-of-fold re-estimate (`--online-out-of-fold`, basin_sim/experiments/revisions.py); in the
budget of the knee ramp measured with these peaks at this q (cached by the model's SHA-256 and the table's in
data/sim/calibrations.json, and written to `--out-calibration`, a file the gateway reads).

Every seed of a cell sees the same arrivals for every policy, so the ratios are paired: per seed,
Basin's goodput over Continuum's (same surge; the prototype's too, when it runs) and over its own
steady goodput; the metrics give
each ratio's mean and standard deviation over seeds, beside each run's goodput mean ± sd, hit-rate
drop, first-call wait, shed share and share of seeds stuck.

    python -m basin_pipeline.simulate --params params.yaml --model data/models/peak_predictor.onnx \\
        --sessions data/sessions.parquet --out-metrics metrics/simulate.json \\
        --headline metrics/goodput.json --out-calibration data/simulate/calibration.json \\
        --plot-dir data/simulate/plots

The metrics are kept in git (`metrics/simulate.json`, `metrics/goodput.json`), so they hold only
results of the simulation: the stage's wall time is logged, not written. They are also logged as one
MLflow run `simulate`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from basin_pipeline import tracking
from basin_pipeline.metrics_files import numbers_only, write_metrics
from basin_pipeline.params import SimulateParams, or_exit, simulate_params
from basin_runtime.logs import configure_logging
from basin_sim.experiments import compare
from basin_sim.experiments.calibrate.knee_cache import DEFAULT_CALIBRATIONS_FILE
from basin_sim.experiments.calibrate.knee_ramp import RAMP_STEP_S
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE
from basin_sim.experiments.flags import add_flags
from basin_sim.experiments.predictions import DEFAULT_RESERVATION_QUANTILE
from basin_sim.experiments.run_setup import Inputs

log = logging.getLogger(__name__)

POLICIES = ("sglang", "continuum", "basin-proto", "basin")
SEEDS = tuple(range(1, 11))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, help="read the stage's settings from this params.yaml (simulate:)")
    parser.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"))
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--out-metrics", type=Path, default=Path("metrics/simulate.json"))
    parser.add_argument("--headline", type=Path, help="goodput.json to write (the headline numbers)")
    parser.add_argument("--out-calibration", type=Path, default=Path("data/simulate/calibration.json"),
                        help="the knee calibration measured with the fresh model (the gateway's --calibration)")
    parser.add_argument("--plot-dir", type=Path, default=Path("data/simulate/plots"))
    parser.add_argument("--deployment", default="1p3d")
    parser.add_argument("--scenario", default="paper-timed-kill-burst-keep", help="the surge (a name or a .yaml file)")
    parser.add_argument("--steady-scenario", default="paper-timed-steady",
                        help="Basin's steady reference (a name or a .yaml)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--reservation-quantile", type=float, default=DEFAULT_RESERVATION_QUANTILE)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: cores)")
    parser.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE,
                        help="the overload-rate cache (measured on first use for this deployment and workload)")
    parser.add_argument("--calibrations-file", type=Path, default=DEFAULT_CALIBRATIONS_FILE,
                        help="the knee-calibration cache (measured on first use for this model file)")
    parser.add_argument("--overload-rate", type=float, help="use this overload rate instead (sessions/s; tests)")
    parser.add_argument("--synthetic", action="store_true", help="the synthetic corpus instead of --sessions")
    add_flags(parser, Inputs, only=("predictions", "out_of_fold", "first_call", "online_out_of_fold"))
    parser.add_argument("--ramp-step-s", type=float, default=RAMP_STEP_S,
                        help="simulated seconds per knee-ramp step (tests: shorter)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the headline row over seeds; write metrics, the calibration and the plot."""
    args = _parser().parse_args(argv)
    params = SimulateParams(args.deployment, args.scenario, args.steady_scenario, tuple(args.policies),
                            tuple(args.seeds), args.reservation_quantile) if args.params is None \
        else or_exit(simulate_params, args.params, "python -m basin_pipeline.simulate")
    configure_logging()
    if not {"basin", "continuum"} <= set(params.policies) or params.scenario == params.steady_scenario:
        raise SystemExit("python -m basin_pipeline.simulate: error: --policies must include basin and continuum, "
                         "and the steady scenario must differ from the surge")
    started = time.perf_counter()
    grids = (compare.Grid((params.scenario,), (params.deployment,), None, params.policies),
             compare.Grid((params.steady_scenario,), (params.deployment,), None, ("basin",)))
    inputs = Inputs(sessions=args.sessions, synthetic=args.synthetic, model=args.model,
                    reservation_quantile=params.reservation_quantile, predictions=args.predictions,
                    out_of_fold=args.out_of_fold, first_call=args.first_call, rates_file=args.rates_file,
                    online_out_of_fold=args.online_out_of_fold,
                    overload_rate=args.overload_rate,
                    calibrations_file=args.calibrations_file)
    result = compare.run_grids(compare.CompareSetup(grids, params.seeds, inputs, args.ramp_step_s,
                                                    jobs=args.jobs))
    surge, steady = (next(cell for key, cell in result.cells.items() if key[0] == name)
                     for name in (params.scenario, params.steady_scenario))
    metrics = headline_metrics(result.rows, surge.scenario.name, steady.scenario.name, params.policies)
    metrics.update({"deployment": surge.deployment.name, "lending": surge.lending, "seeds": list(params.seeds),
                    "reservation_quantile": params.reservation_quantile,
                    "overload_rate_per_s": surge.overload_rate_per_s})
    calibration = {} if surge.calibration is None else dict(surge.calibration.record)
    metrics["calibration"] = {k: v for k, v in calibration.items() if k != "notes"}
    args.out_calibration.parent.mkdir(parents=True, exist_ok=True)
    # sorted keys: the same bytes whether the calibration was measured now or read from the knee cache
    args.out_calibration.write_text(json.dumps(calibration, indent=2, sort_keys=True) + "\n")
    from basin_sim.experiments.plots import plot_compare

    for path in plot_compare(result.summary(), result.labels, args.plot_dir):
        log.info("wrote %s", path)
    log.info("Basin %.0f ± %.0f /h; over Continuum %.3f ± %.3f, over its steady %.3f ± %.3f (%d seeds, %.0f s)",
             metrics["goodput"]["basin"]["mean"], metrics["goodput"]["basin"]["sd"],
             metrics["basin_over_continuum"]["mean"], metrics["basin_over_continuum"]["sd"],
             metrics["basin_over_own_steady"]["mean"], metrics["basin_over_own_steady"]["sd"], len(params.seeds),
             time.perf_counter() - started)
    write_metrics(args.out_metrics, metrics)
    if args.headline is not None:
        write_metrics(args.headline, numbers_only({
            "basin_per_h": metrics["goodput"]["basin"]["mean"], "basin_sd": metrics["goodput"]["basin"]["sd"],
            "vs_continuum": metrics["basin_over_continuum"]["mean"],
            "vs_continuum_sd": metrics["basin_over_continuum"]["sd"],
            "vs_steady": metrics["basin_over_own_steady"]["mean"],
            "vs_steady_sd": metrics["basin_over_own_steady"]["sd"],
            **({"proto_vs_continuum": metrics["proto_over_continuum"]["mean"],
                "proto_vs_continuum_sd": metrics["proto_over_continuum"]["sd"]}
               if "proto_over_continuum" in metrics else {})}))
    tracking.configure()
    tracking.log_run("simulate", {"deployment": surge.deployment.name, "scenario": surge.scenario.name,
                                  "seeds": len(params.seeds), "model": str(args.model),
                                  "reservation_quantile": params.reservation_quantile}, metrics,
                     {"basin.model": str(args.model)})
    return 0


def headline_metrics(rows: Sequence[dict[str, Any]], surge: str, steady: str,
                     policies: Sequence[str]) -> dict[str, Any]:
    """Per policy on the surge (and Basin on steady): goodput mean and sd over seeds (and each seed's, in seed
    order), hit-rate drop, first-call wait p50, shed share, share stuck; the paired per-seed ratios of Basin's
    goodput over Continuum's and over its own steady goodput (and the prototype's over Continuum's when it
    runs), as mean and sd."""
    summary = compare.aggregate(rows)
    by = {(row["scenario"], row["policy"], row["seed"]): float(row["goodput_per_hour"]) for row in rows}
    goodput: dict[str, Any] = {}
    seeds = sorted({seed for (_, _, seed) in by})
    for (scenario, _, _, policy), cell in summary.items():
        name = policy if scenario == surge else f"{policy}_steady"
        goodput[name] = {"mean": cell["goodput_mean"], "sd": cell["goodput_sd"], "seeds": cell["seeds"],
                         "per_seed": [by.get((scenario, policy, seed)) for seed in seeds],
                         "hit_rate_drop_points": cell["hit_rate_drop_points"],
                         "first_call_wait_p50_s": cell["first_call_wait_p50_s"], "shed_share": cell["shed_share"],
                         "share_stuck": cell["share_stuck"]}
    missing = [p for p in policies if p not in goodput]
    if missing:
        raise ValueError(f"no runs of {missing} on {surge}")
    paired = {"basin_over_continuum": _paired(by, seeds, (surge, "basin"), (surge, "continuum")),
              "basin_over_own_steady": _paired(by, seeds, (surge, "basin"), (steady, "basin"))}
    if "basin-proto" in policies:
        paired["proto_over_continuum"] = _paired(by, seeds, (surge, "basin-proto"), (surge, "continuum"))
    return {"scenario": surge, "steady_scenario": steady, "goodput": goodput, **paired}


def _paired(by: Mapping[tuple[str, str, int], float], seeds: Sequence[int], top: tuple[str, str],
            bottom: tuple[str, str]) -> dict[str, Any]:
    """Mean and sd over seeds of top / bottom goodput in the same seed (a zero bottom leaves that seed out)."""
    ratios = [by[(*top, s)] / by[(*bottom, s)] for s in seeds if by.get((*bottom, s))]
    return {"mean": statistics.fmean(ratios) if ratios else None,
            "sd": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
            "seeds": len(ratios), "seeds_ahead": sum(r > 1 for r in ratios)}


if __name__ == "__main__":
    raise SystemExit(main())

"""Basin at reservation quantiles q = 0.5 / 0.9 / 0.95, the budget's r held fixed and re-measured, over seeds.

    python benchmarks/reservation_quantiles.py                       # surge-100-30min on 1p3d-h100, 10 seeds
    python benchmarks/reservation_quantiles.py --scenario surge-100 --seeds 1 2 3

Each session reserves m(q) x its predicted peak, m from the shipped pooled model's file for its
benchmark, revised at calls 3 and 5 with the file's online model (the gateway's --revise-at-calls 3 5). The budget
is B = r x 0.9 x knee, r the reservation ratio measured on the knee ramp (first-call reservations
over contexts of the live sessions):
- `r fixed`: r from the ramp at the served q (0.9) for every q: a larger q reserves more per session
  in the same B, so fewer sessions are admitted at once and fewer outgrow their reservation;
- `r re-measured`: a ramp at each q first: r scales with m(q) and B with it, so about the same
  working set is admitted whatever q is.
Per cell: sessions admitted, the share of them whose context outgrew their first reservation,
goodput and the median first-call wait, each a mean +- sd over the seeds. The simulator's pool is
the training sessions, so the model predicts them in-sample: the overflow shares are lower than on
new sessions (the outer-fold coverage in metrics/nested.json is the honest one).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from basin_runtime.calibration import calibration_from_mapping
from basin_runtime.markdown_table import markdown_row, markdown_table
from basin_runtime.model_files import file_sha256
from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.experiments.calibrate.knee_ramp import knee_record
from basin_sim.experiments.calibrate.rates import RateCache, overload_rate_for
from basin_sim.experiments.predictions import (
    load_predictor,
    online_revisions,
    predict_pool,
    reservation_multipliers,
    reserved_peaks,
)
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import load_pool, workload_pool

SERVED_Q = 0.9


@functools.cache
def _setup(scenario_name: str, deployment_name: str, model: str) -> tuple[Any, Any, list[Session], dict[str, float],
                                                                          Any, float]:
    """Scenario, deployment, pool, predicted peaks, predictor and overload rate, once per worker."""
    scenario = catalog.load_scenario(scenario_name)
    deployment = catalog.load_deployment(deployment_name).build("gpu")
    base, _ = load_pool(Path("data/sessions.parquet"), False)
    pool = workload_pool(base, scenario.workload)
    predictor = load_predictor(Path(model))
    rate = overload_rate_for(deployment, pool, scenario.workload, scenario.clients, RateCache())[0]
    return scenario, deployment, pool, predict_pool(predictor, pool), predictor, rate


def _calibrate(job: tuple[str, str, str, float]) -> dict[str, Any]:
    scenario_name, deployment_name, model, q = job
    _, deployment, pool, peaks, predictor, rate = _setup(scenario_name, deployment_name, model)
    return knee_record(deployment, pool, rate, 1, reserved_peaks(peaks, reservation_multipliers(predictor, pool, q)),
                       f"benchmarks/reservation_quantiles.py (q {q:g})", predictor_sha256=file_sha256(Path(model)),
                       reservation_quantile=q)


def _run(job: tuple[str, str, str, float, int, dict[str, Any]]) -> dict[str, Any]:
    scenario_name, deployment_name, model, q, seed, calibration = job
    scenario, deployment, pool, peaks, predictor, rate = _setup(scenario_name, deployment_name, model)
    summary = run_scenario(RunSpec(
        scenario, deployment, "basin", seed, rate, predicted_peak_tokens=peaks,
        reservation_multipliers=reservation_multipliers(predictor, pool, q), reservation_quantile=q,
        revisions=online_revisions(predictor, pool, peaks, q, (3, 5)),
        calibration=calibration_from_mapping(calibration, "the knee ramp")), pool).summary
    admitted = summary["sessions_admitted"]
    return {"admitted": admitted, "overflow": summary["sessions_overflowed"] / admitted if admitted else 0.0,
            "goodput": summary["goodput_per_hour"], "wait": summary["first_call_wait_p50_s"] or 0.0}


def _cell(values: Sequence[float], fmt: str) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.fmean(values), fmt)} ± {format(sd, fmt)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="surge-100-30min")
    parser.add_argument("--deployment", default="1p3d-h100")
    parser.add_argument("--model", default="models/peak_predictor.onnx")
    parser.add_argument("--quantiles", type=float, nargs="+", default=[0.5, 0.9, 0.95])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    key = (args.scenario, args.deployment, args.model)
    quantiles = sorted(set(args.quantiles) | {SERVED_Q})
    with ProcessPoolExecutor(args.jobs) as pool:
        calibrations = dict(zip(quantiles, pool.map(_calibrate, [(*key, q) for q in quantiles]), strict=True))
        print(f"knee ramps done ({time.perf_counter() - started:.0f} s): r at q " + ", ".join(
            f"{q:g} = {c.get('reservation_ratio')}" for q, c in calibrations.items()), file=sys.stderr)
        jobs = [(*key, q, seed, calibrations[SERVED_Q if mode == "fixed" else q])
                for q in args.quantiles for mode in ("fixed", "re-measured") for seed in args.seeds]
        results = list(pool.map(_run, jobs))
    predictor = load_predictor(Path(args.model))
    print(f"{args.scenario} on {args.deployment}, Basin, {len(args.seeds)} seeds, model {args.model} "
          f"({time.perf_counter() - started:.0f} s)")
    print(markdown_table(["q", "m(q), all rows", "r", "sessions admitted", "overflow share", "goodput /h",
                          "first-call wait p50 s"], []))
    n = len(args.seeds)
    for k, (q, mode) in enumerate((q, m) for q in args.quantiles for m in ("fixed", "re-measured")):
        rows = results[k * n:(k + 1) * n]
        r = calibrations[SERVED_Q if mode == "fixed" else q].get("reservation_ratio")
        print(markdown_row([f"{q:g}", f"{predictor.multiplier(q):.2f}", f"{r} ({mode})",
                            _cell([x['admitted'] for x in rows], '.0f'), _cell([x['overflow'] for x in rows], '.3f'),
                            _cell([x['goodput'] for x in rows], ',.0f'), _cell([x['wait'] for x in rows], '.1f')]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The paper's experiments (`paper-*` scenarios) on the paper's deployment, over seeds, beside its numbers.

    python benchmarks/paper_runs.py                      # 10 seeds, our corpora and the paper-sized preset
    python benchmarks/paper_runs.py --seeds 1 2 --plots docs/
    python benchmarks/paper_runs.py --relative --workloads paper   # the paper's factors at the model's own rate
    python benchmarks/paper_runs.py --timing qwen3.6-35b-a3b       # sessions timed as the paper's model runs them

Per scenario (plain SGLang, `sglang` policy, on `1p1d`): goodput of the sessions arriving in the hour
after the surge, share of seeds stuck, hit rate before / after, TTFT p50 after, minutes to recover,
prefill busy share, and live regular sessions at minute 50 (the burst scenarios' measure); each a
mean +- standard deviation over the seeds. Writes data/sim/paper_runs.json; with --plots, the timeline
PNG of the first stuck run (any scenario) and the first surge-100 run that is not stuck. Scenario parameters are
the paper's; nothing here is tuned. With --relative, every rate keeps the paper's factor of its
overload rate (3.3/min = 0.5 x its ~6.6/min) but applies it to the model's own measured overload rate
of the deployment on that workload (calibrate/rates.py, measured once and cached). With --timing, every
scenario's sessions are timed as that serving model runs them (workload/serving.py), at the scales its fit
file holds (fitted on the steady facts alone, before any of these runs: calibrate/timing_fit.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.experiments.calibrate.rates import RateCache, overload_rate_for
from basin_sim.experiments.plots import plot_run
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import RunResult, run_scenario
from basin_sim.workload.pool import load_pool, workload_pool
from basin_sim.workload.scenarios import WorkloadSpec
from basin_sim.workload.serving import RECORDED, load_timing

SCENARIOS = ("steady", "surge-100", "surge-33", "burst-kill", "burst-keep")
PAPER = {  # the paper's measurements on its 1P1D H100 deployment (issue 15)
    "steady": "TTFT p50 ~0.2 s, hit 0.95, goodput 138/h, prefill ~1/12 busy",
    "surge-100": "never recovers: TTFT p50 ~60 s, hit 0.95 -> 0.27, goodput 17/h (-88%)",
    "surge-33": "recovers within 20 min",
    "burst-kill": "recovers within 2 min of the kill",
    "burst-keep": "bursts linger up to 25 min; live regular sessions at min 50 = 1.7x steady",
}
MINUTE_50_S = 3_000.0
PAPER_OVERLOAD_PER_MIN = 6.6  # 3.3 sessions/min is half the paper deployment's overload rate


@functools.cache
def _pool(workload: WorkloadSpec) -> list[Session]:
    """The scenario's session pool, read once per worker process."""
    base, _ = load_pool(Path("data/sessions.parquet"), False)
    return workload_pool(base, workload)


def _one(job: tuple[str, int, str, bool, bool, str, float | None]) -> tuple[dict[str, Any], RunResult | None]:
    scenario_name, seed, deployment_name, keep, relative, timing, reasoning_scale = job
    scenario = catalog.load_scenario(scenario_name)
    if timing != RECORDED:
        workload = replace(scenario.workload, timing=timing, reasoning_scale=reasoning_scale)
        scenario = replace(scenario, workload=workload)
    pool = _pool(scenario.workload)
    deployment = catalog.load_deployment(deployment_name).build(None)
    rate = 0.0
    if relative:
        steps = tuple(replace(s, x_overload=(s.per_min or 0.0) / PAPER_OVERLOAD_PER_MIN, per_min=None)
                      for s in scenario.rate)
        scenario = replace(scenario, rate=steps)
        rate, _ = overload_rate_for(deployment, pool, scenario.workload, scenario.clients, RateCache())
    result = run_scenario(RunSpec(scenario, deployment, "sglang", seed, rate), pool)
    s = result.summary
    minute = next((e for e in s["timeline"] if e["t_s"] + 60.0 == MINUTE_50_S), None)
    row = {"scenario": scenario_name, "seed": seed, **{k: s[k] for k in (
        "goodput_per_hour", "is_stuck", "hit_rate_pre", "hit_rate_post", "ttft_p50_post_s", "recovered_after_s",
        "prefill_busy_fraction", "sessions_arrived", "sessions_good")},
        "live_regular_min50": None if minute is None else minute["live_sessions"] - minute["live_burst_sessions"],
        "backlog_drained_after_s": s["backlog_drained_after_s"], **_lifetimes(result)}
    return row, (result if keep else None)


def _lifetimes(result: RunResult) -> dict[str, float | None]:
    """Arrival to end of the regular sessions that arrived in the goodput window and finished."""
    scenario = result.spec.scenario
    start, end = scenario.engine_s(scenario.goodput_from_s), scenario.engine_s(scenario.goodput_to_s)
    spans = sorted(o.ended_s - o.arrival_s for o in result.outcomes if not o.is_burst and o.ended_s is not None
                   and o.status == "finished" and start <= o.arrival_s < end)
    if not spans:
        return {"lifetime_mean_s": None, "lifetime_p50_s": None, "lifetime_p95_s": None}
    return {"lifetime_mean_s": statistics.fmean(spans), "lifetime_p50_s": statistics.median(spans),
            "lifetime_p95_s": spans[min(len(spans) - 1, int(0.95 * len(spans)))]}


def _stat(values: list[float | None]) -> str:
    xs = [v for v in values if v is not None]
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3g} +- {sd:.2g}" + ("" if len(xs) == len(values) else f" ({len(xs)}/{len(values)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--deployment", default="1p1d")
    parser.add_argument("--workloads", nargs="+", default=["paper", "paper-preset"],
                        help="scenario name prefixes: paper (our corpora), paper-preset (the paper-sized preset)")
    parser.add_argument("--relative", action="store_true",
                        help="the paper's factors of the overload rate, at the model's own overload rate")
    parser.add_argument("--timing", default=RECORDED,
                        help="time sessions as this serving model runs them (workload/serving.py), fitted scales")
    parser.add_argument("--reasoning-scale", type=float,
                        help="with --timing: this reasoning scale instead of the fitted one (e.g. the upper end of "
                             "the fit's indistinguishable span, for sensitivity)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("data/sim/paper_runs.json"))
    parser.add_argument("--plots", type=Path, help="write one stuck and one recovered run's timeline here")
    args = parser.parse_args(argv)
    timing = None if args.timing == RECORDED else load_timing(args.timing, args.reasoning_scale)
    jobs = [(f"{w}-{name}", seed, args.deployment, args.plots is not None, args.relative, args.timing,
             args.reasoning_scale)
            for w in args.workloads for name in SCENARIOS for seed in args.seeds]
    rows: list[dict[str, Any]] = []
    plotted: dict[str, Path] = {}
    started = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        for k, (row, result) in enumerate(pool.map(_one, jobs), 1):
            rows.append(row)
            print(f"[{k}/{len(jobs)}] {row['scenario']} seed {row['seed']}: goodput {row['goodput_per_hour']:.0f}/h "
                  f"stuck {row['is_stuck']} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
            kind = "stuck" if row["is_stuck"] else "recovered" if "surge-100" in row["scenario"] else None
            if result is not None and kind is not None and kind not in plotted:
                plotted[kind] = plot_run(result, args.plots)
    table = []
    for w in args.workloads:
        for name in SCENARIOS:
            runs = [r for r in rows if r["scenario"] == f"{w}-{name}"]
            cell = {"scenario": f"{w}-{name}", "seeds": len(runs),
                    "share_stuck": sum(bool(r["is_stuck"]) for r in runs) / len(runs), "paper": PAPER[name]}
            for key in ("goodput_per_hour", "hit_rate_pre", "hit_rate_post", "ttft_p50_post_s", "recovered_after_s",
                        "prefill_busy_fraction", "live_regular_min50", "backlog_drained_after_s", "lifetime_mean_s",
                        "lifetime_p50_s", "lifetime_p95_s"):
                cell[key] = _stat([r[key] for r in runs])
            table.append(cell)
            print(f"{cell['scenario']:<26} stuck {cell['share_stuck']:.0%}  goodput {cell['goodput_per_hour']}/h  "
                  f"hit {cell['hit_rate_pre']} -> {cell['hit_rate_post']}  TTFT p50 {cell['ttft_p50_post_s']} s  "
                  f"recovered after {cell['recovered_after_s']} s  busy {cell['prefill_busy_fraction']}  "
                  f"live regular @50min {cell['live_regular_min50']}   | paper: {cell['paper']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scales = None if timing is None else {"reasoning_scale": timing.reasoning_scale}
    args.out.write_text(json.dumps({"deployment": args.deployment, "seeds": args.seeds, "relative": args.relative,
                                    "timing": args.timing, "timing_scales": scales,
                                    "table": table, "runs": rows,
                                    "plots": {k: str(v) for k, v in plotted.items()}}, indent=1) + "\n")
    for kind, path in plotted.items():
        print(f"{kind} run: {path}")
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

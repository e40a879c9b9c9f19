"""Fit a serving timing's free parameters to the paper's steady 1P1D facts, and nothing else.

    python -m basin_sim.experiments.calibrate.timing_fit   # qwen3.6-35b-a3b: two grids, seeds 1-4; writes the fit
    python -m basin_sim.experiments.calibrate.timing_fit --check-seeds 1 2 3 4 5 6 7 8 9 10  # + the fit, 10 seeds

Rules:
- The facts (TARGETS) are the paper's steady run on its 1P1D H100 deployment at 3.3 sessions/min: TTFT
  p50 ~0.2 s, prefix-cache hit rate 0.95, prefill ~1/12 busy, 138 good sessions per hour. The run is
  the `paper-preset-steady` scenario (the pool sized to the paper's trajectories: median prompt 25.6K
  tokens, 98.2% reuse; plain SGLang, `1p1d`) with the timing applied; `--scenario paper-steady` fits on
  our Terminal-Bench sessions instead. No surge, burst or other rate is run here, so nothing the fit is
  later judged by is seen by it.
- The free parameters and their ranges are the timing file's `free` block (the sourced range of each;
  since tool time came from published sources, that is `reasoning_scale` alone). A coarse grid
  (GRID_POINTS log-spaced values of each inside its range), then a fine grid of as many points between
  the best coarse point's neighbours; every point over `--seeds`.
- Loss of a point = the sum over the facts of (log(model mean / paper))^2: every fact weighs the same
  whatever its unit. The fitted point is the grid point of least loss; the fit file records it, the
  targets, each fact's model value and error at it, and the whole grid, so the fit can be audited.
- Identifiability: the seed noise of the best loss is the standard error of its per-seed losses; every
  point within 2 of those of the best loss is `indistinguishable` from it, and the fit file records
  their span per parameter. A wide span means the facts do not pin that parameter: predictions made
  with the fit should be shown at the span's ends too.
- Written to NAME.fit.yaml beside the timing file (workload/serving.py reads it as the default scales).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload import serving
from basin_sim.workload.pool import DEFAULT_SESSIONS, load_pool, workload_pool

SCENARIO = "paper-preset-steady"
DEPLOYMENT = "1p1d"
POLICY = "sglang"
GRID_POINTS = 7
# The paper's steady 1P1D facts (its steady run at 3.3 sessions/min; README "The paper's experiments").
TARGETS: Mapping[str, float] = {
    "ttft_p50_post_s": 0.2,
    "hit_rate_post": 0.95,
    "prefill_busy_fraction": 1.0 / 12.0,
    "goodput_per_hour": 138.0,
}


@functools.cache
def _base(sessions: str) -> list[Session]:
    return load_pool(Path(sessions), False)[0]


Point = tuple[float, ...]  # a value of each of serving.SCALES, in order
Job = tuple[str, str, str, Point, int]  # sessions, scenario, timing, point, seed


def run_point(job: Job) -> dict[str, Any]:
    """One steady run at one point of the grid: the facts the paper reports, and the live sessions."""
    sessions, scenario_name, timing, point, seed = job
    scenario = catalog.load_scenario(scenario_name)
    scales: dict[str, Any] = dict(zip(serving.SCALES, point, strict=True))
    workload = dataclasses.replace(scenario.workload, timing=timing, **scales)
    scenario = dataclasses.replace(scenario, workload=workload)
    pool = workload_pool(_base(sessions), workload)
    deployment = catalog.load_deployment(DEPLOYMENT).build(None)
    summary = run_scenario(RunSpec(scenario, deployment, POLICY, seed, 0.0), pool).summary
    timeline = summary["timeline"]
    live = statistics.fmean(m["live_sessions"] for m in timeline) if timeline else 0.0
    return {**dict(zip(serving.SCALES, point, strict=True)), "seed": seed,
            **{key: float(summary[key]) for key in TARGETS}, "live_sessions_mean": live}


def loss(means: Mapping[str, float]) -> float:
    """Sum of squared log errors against TARGETS (inf when a fact is 0 or missing)."""
    total = 0.0
    for key, target in TARGETS.items():
        value = means.get(key, 0.0)
        if not value > 0:
            return math.inf
        total += math.log(value / target) ** 2
    return total


def axis(low: float, high: float, points: int) -> list[float]:
    """Log-spaced values from low to high (3 significant digits, so the file reads cleanly)."""
    return [float(f"{v:.3g}") for v in np.geomspace(low, high, points)]


def grid(ranges: Mapping[str, tuple[float, float]], points: int) -> list[Point]:
    """Log-spaced points over every range."""
    axes = [axis(*ranges[key], points) for key in serving.SCALES]
    return list(itertools.product(*axes))


def point_of(row: Mapping[str, Any]) -> Point:
    """The grid point a row or table entry was run at."""
    return tuple(row[key] for key in serving.SCALES)


def refined(ranges: Mapping[str, tuple[float, float]], points: int, best: Point) -> dict[str, tuple[float, float]]:
    """The ranges between the best point's neighbours on the coarse axes (clipped to the free ranges)."""
    out = {}
    for key, value in zip(serving.SCALES, best, strict=True):
        values = axis(*ranges[key], points)
        k = values.index(value)
        out[key] = (values[max(0, k - 1)], values[min(len(values) - 1, k + 1)])
    return out


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per grid point: the mean and sd of each fact over its seeds, and the loss of the means."""
    out = []
    for point in sorted({point_of(r) for r in rows}):
        runs = [r for r in rows if point_of(r) == point]
        means = {k: statistics.fmean(r[k] for r in runs) for k in (*TARGETS, "live_sessions_mean")}
        sds = {k: statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0 for k in TARGETS}
        per_seed = [loss(r) for r in runs]
        finite = [x for x in per_seed if math.isfinite(x)]
        noise = statistics.stdev(finite) / math.sqrt(len(finite)) if len(finite) == len(runs) > 1 else math.inf
        out.append({**dict(zip(serving.SCALES, point, strict=True)), "seeds": len(runs),
                    "mean": {k: round(v, 4) for k, v in means.items()},
                    "sd": {k: round(v, 4) for k, v in sds.items()}, "loss": round(loss(means), 5),
                    "loss_noise": round(noise, 5)})
    return out


def indistinguishable(table: Sequence[Mapping[str, Any]], best: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The grid points whose loss is within two seed-noise units of the best point's (the best included)."""
    line = best["loss"] + 2 * best["loss_noise"]
    return [p for p in table if p["loss"] <= line]


def _run(jobs: list[Job], workers: int, label: str) -> list[dict[str, Any]]:
    rows = []
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        for k, row in enumerate(pool.map(run_point, jobs), 1):
            rows.append(row)
            scales = " ".join(f"{key} x{row[key]}" for key in serving.SCALES)
            print(f"[{label} {k}/{len(jobs)}] {scales} "
                  f"seed {row['seed']}: TTFT {row['ttft_p50_post_s']:.3f} s hit {row['hit_rate_post']:.3f} "
                  f"busy {row['prefill_busy_fraction']:.3f} good {row['goodput_per_hour']:.0f}/h "
                  f"live {row['live_sessions_mean']:.1f} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timing", default="qwen3.6-35b-a3b", help="a timing name or .yaml path")
    parser.add_argument("--sessions", default=str(DEFAULT_SESSIONS))
    parser.add_argument("--scenario", default=SCENARIO, help="the steady scenario the facts are fitted on")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3, 4], help="seeds per grid point")
    parser.add_argument("--points", type=int, default=GRID_POINTS, help="grid points per parameter")
    parser.add_argument("--check-seeds", nargs="*", type=int, default=[],
                        help="also run the fitted point over these seeds (steady only) and record them")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="default: NAME.fit.yaml beside the timing file")
    args = parser.parse_args(argv)
    path = serving.timing_path(args.timing)
    ranges = serving.free_parameters(args.timing)
    started = time.perf_counter()

    def jobs_of(points: list[Point], seeds: list[int]) -> list[Job]:
        return [(args.sessions, args.scenario, args.timing, point, seed) for point in points for seed in seeds]

    coarse = grid(ranges, args.points)
    print(f"fitting {sorted(ranges)} of {path.name} on {args.scenario} ({DEPLOYMENT}, {POLICY}): two grids of "
          f"{len(coarse)} points x {len(args.seeds)} seeds", file=sys.stderr)
    coarse_table = summarize(_run(jobs_of(coarse, args.seeds), args.jobs, "coarse"))
    coarse_best = min(coarse_table, key=lambda p: p["loss"])
    fine_ranges = refined(ranges, args.points, point_of(coarse_best))
    fine = [p for p in grid(fine_ranges, args.points) if p not in set(coarse)]
    table = sorted(coarse_table + summarize(_run(jobs_of(fine, args.seeds), args.jobs, "fine")), key=point_of)
    best = min(table, key=lambda p: p["loss"])
    alike = indistinguishable(table, best)
    fit: dict[str, Any] = {
        "timing": path.name, "scenario": args.scenario, "deployment": DEPLOYMENT, "policy": POLICY,
        "command": "python -m basin_sim.experiments.calibrate.timing_fit "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "targets": dict(TARGETS), "free": {k: list(v) for k, v in ranges.items()}, "seeds": args.seeds,
        "fitted": {key: best[key] for key in serving.SCALES},
        "at_fit": {"mean": best["mean"], "sd": best["sd"], "loss": best["loss"],
                   "error": {k: round(best["mean"][k] / t - 1.0, 4) for k, t in TARGETS.items()}},
        "indistinguishable": {"points": len(alike), "within_loss": round(best["loss"] + 2 * best["loss_noise"], 5),
                              **{key: [min(p[key] for p in alike), max(p[key] for p in alike)]
                                 for key in serving.SCALES}},
    }
    if args.check_seeds:
        check = summarize(_run(jobs_of([point_of(best)], args.check_seeds), args.jobs, "check"))[0]
        fit["check"] = {"seeds": args.check_seeds, "mean": check["mean"], "sd": check["sd"],
                        "error": {k: round(check["mean"][k] / t - 1.0, 4) for k, t in TARGETS.items()}}
    fit["grid"] = table
    fit["wall_s"] = round(time.perf_counter() - started, 1)
    out = args.out or serving.fit_path(path)
    header = ("# Written by basin_sim/experiments/calibrate/timing_fit.py from the paper's steady 1P1D facts only; "
              "do not edit.\n")
    out.write_text(header + yaml.safe_dump(fit, sort_keys=False, width=120))
    for key, target in TARGETS.items():
        print(f"{key:<24} paper {target:<8.4g} model {best['mean'][key]:<8.4g} ({best['mean'][key] / target - 1:+.1%})")
    span = fit["indistinguishable"]
    fitted = ", ".join(f"{key} {best[key]}" for key in serving.SCALES)
    spans = ", ".join(f"{key} {span[key]}" for key in serving.SCALES)
    print(f"fitted {fitted} (loss {best['loss']} +- {best['loss_noise']}); {span['points']} points "
          f"indistinguishable from it: {spans}; wrote {out} ({fit['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The paper's regime with the serving model's timing: overload rates, prefill busy at half of them, the
hysteresis of the 1P3D H200 host-tier cache after a surge, the post-surge rate thresholds, and the knee.

    python benchmarks/paper_regime.py          # everything, 10 seeds, qwen3.6-35b-a3b at its fitted scales
    python benchmarks/paper_regime.py --parts rates knee --seeds 1 2 3

Every run uses the timing's fitted scales (calibrate/timing_fit.py: steady 1P1D facts only) on the
paper-sized preset (`paper-terminal-bench`); nothing here is fitted or tuned.
- rates: the overload rate (calibrate/overload.py: the lowest rate at which 4 of 5 steady trials
  overload) of 1p1d (paper: ~6.6/min) and 1p3d with a one-hour horizon (sessions live ~10 min
  here, so the default 30 minutes from an empty cache would read a rate the steady state cannot hold),
  then steady runs at half of each over the seeds: prefill busy share, TTFT, hit rate, goodput.
- hysteresis: on 1p3d-host (SGLang with its HiCache host tier) a base at 0.5x the 1p3d overload
  rate, on 1p1d the paper's 3.3/min; +100% for 10 minutes, then the rate goes to f x base for f in
  POST_FACTORS; beside it, the same deployment steady at each f x base from the start. The gap between
  the two (stuck after the surge, healthy without it) is the hysteresis. Per f, the share of seeds
  stuck: the post-surge threshold is the f where the share after the surge crosses one half.
- knee: a stepped ramp (calibrate/ramp.py) on 1p1d: per step, working set / cache and hit rate, next to
  the paper's uncollapsed runs (hit 0.81-0.93 at a working set of 1.6-1.7x the cache).
Writes data/sim/paper_regime.json and, with --plots, the knee and hysteresis figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.experiments.calibrate.overload import find_overload_rate
from basin_sim.experiments.calibrate.ramp import run_ramp
from basin_sim.experiments.calibrate.rates import TIMED_SETTINGS
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import load_pool, workload_pool
from basin_sim.workload.scenarios import RateStep, Scenario, WorkloadSpec
from basin_sim.workload.serving import load_timing

TIMING = "qwen3.6-35b-a3b"
PRESET = "paper-terminal-bench"
POST_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25)
PAPER_BASE_PER_MIN = 3.3  # the paper's 1P1D base rate
RATE_SETTINGS = TIMED_SETTINGS  # an hour at 0.002/s: what basin-sim uses for every timed workload
KNEE_FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
KNEE_STEP_S = 1800.0
PAPER = {
    "overload_1p1d_per_min": 6.6,
    "prefill_busy_at_half": 1.0 / 12.0,
    "knee": "hit 0.81-0.93 in uncollapsed runs with the working set at 1.6-1.7x the cache",
}


def workload(timing: str) -> WorkloadSpec:
    return WorkloadSpec(preset=PRESET, timing=timing)


@functools.cache
def pool_of(timing: str) -> list[Session]:
    return workload_pool(load_pool(Path("data/sessions.parquet"), False)[0], workload(timing))


def steady(name: str, base_per_s: float, timing: str, factor: float = 1.0) -> Scenario:
    """The paper's steady run shape at `factor` x `base_per_s` (20 min warm-up, goodput over the hour after min 25)."""
    return Scenario(name, duration_s=5100.0, warmup_s=1200.0, goodput_from_s=1500.0, goodput_to_s=5100.0,
                    rate=(RateStep(0.0, per_min=60.0 * base_per_s * factor),), workload=workload(timing))


def surge(name: str, base_per_s: float, timing: str, post: float) -> Scenario:
    """+100% in minutes 15-25 (the paper's surge), then `post` x base."""
    per_min = 60.0 * base_per_s
    return Scenario(name, duration_s=5100.0, warmup_s=1200.0, goodput_from_s=1500.0, goodput_to_s=5100.0,
                    rate=(RateStep(0.0, per_min=per_min), RateStep(900.0, per_min=2 * per_min),
                          RateStep(1500.0, per_min=post * per_min)), workload=workload(timing))


def run_one(job: tuple[Scenario, str, int, str]) -> dict[str, Any]:
    scenario, deployment_name, seed, timing = job
    deployment = catalog.load_deployment(deployment_name).build(None)
    s = run_scenario(RunSpec(scenario, deployment, "sglang", seed, 0.0), pool_of(timing)).summary
    return {"scenario": scenario.name, "deployment": deployment_name, "seed": seed,
            **{k: s[k] for k in ("goodput_per_hour", "is_stuck", "hit_rate_pre", "hit_rate_post", "ttft_p50_post_s",
                                 "recovered_after_s", "prefill_busy_fraction", "sessions_arrived")}}


def overload(job: tuple[str, str]) -> dict[str, Any]:
    deployment_name, timing = job
    deployment = catalog.load_deployment(deployment_name).build(None)
    found = find_overload_rate(deployment, "sglang", pool_of(timing), RATE_SETTINGS)
    return {"deployment": deployment_name, "overload_rate_per_s": found.overload_rate_per_s,
            "overload_per_min": 60.0 * found.overload_rate_per_s, "tried": [list(t) for t in found.tried]}


def knee(job: tuple[str, float, int, str]) -> list[dict[str, Any]]:
    deployment_name, rate_per_s, seed, timing = job
    deployment = catalog.load_deployment(deployment_name).build(None)
    steps = run_ramp(deployment, pool_of(timing), [f * rate_per_s for f in KNEE_FRACTIONS], KNEE_STEP_S, seed)
    return [{"seed": seed, "fraction": f, "rate_per_min": 60.0 * st.rate_per_s, "load": st.load,
             "hit_rate": st.hit_rate, "live_sessions": st.live_sessions, "ttft_p50_s": st.ttft_p50_s,
             "calls_per_s": st.calls_per_s, "sessions_per_min": 60.0 * st.sessions_finished_per_s}
            for f, st in zip(KNEE_FRACTIONS, steps, strict=True)]


def stat(values: Sequence[float | None]) -> dict[str, float | int | None]:
    xs = [float(v) for v in values if v is not None]
    return {"mean": statistics.fmean(xs) if xs else None, "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "n": len(xs)}


def summary(rows: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    runs = [r for r in rows if r["scenario"] == name]
    return {"scenario": name, "seeds": len(runs), "share_stuck": sum(bool(r["is_stuck"]) for r in runs) / len(runs),
            **{k: stat([r[k] for r in runs]) for k in ("goodput_per_hour", "hit_rate_pre", "hit_rate_post",
                                                        "ttft_p50_post_s", "prefill_busy_fraction")}}


def _map(fn: Any, jobs: list[Any], workers: int, label: str) -> list[Any]:
    out, started = [], time.perf_counter()
    with ProcessPoolExecutor(workers) as ex:
        for k, row in enumerate(ex.map(fn, jobs), 1):
            out.append(row)
            print(f"[{label} {k}/{len(jobs)}] ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return out


def _plot_completions(plt: Any, points: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """The fluid model's X(N): sessions completed per minute against live sessions (and working set), with the
    paper's base and surge arrival rates: where completions cross an arrival rate is a fixed point."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, label in ((axes[0], "live_sessions", "live sessions N"),
                           (axes[1], "load", "working set / prefix-cache capacity")):
        ax.scatter([p[key] for p in points], [p["sessions_per_min"] for p in points], s=14,
                   label="model (1p1d, per seed and step)")
        for rate, style in ((PAPER_BASE_PER_MIN, "--"), (2 * PAPER_BASE_PER_MIN, ":")):
            ax.axhline(rate, color="k", ls=style, lw=1, label=f"arrivals {rate:g}/min")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("sessions completed per minute, X(N)/K")
    axes[0].legend(fontsize=8)
    fig.suptitle("Completion curve on steady ramp steps (stable where it crosses arrivals rising, unstable falling)")
    path = out_dir / "completions.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    if "knee" in result:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        points = result["knee"]["steps"]
        ax.scatter([p["load"] for p in points], [p["hit_rate"] for p in points], s=14, label="model (1p1d, per seed)")
        ax.add_patch(plt.Rectangle((1.6, 0.81), 0.1, 0.12, alpha=0.3, color="tab:red",
                                   label="paper: uncollapsed runs"))
        ax.set_xlabel("working set / prefix-cache capacity")
        ax.set_ylabel("prefix-cache hit rate")
        ax.set_title("Hit rate vs working set on steady ramp steps")
        ax.legend(loc="upper right")
        paths.append(out_dir / "knee.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(_plot_completions(plt, points, out_dir))
    if "hysteresis" in result:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for h in result["hysteresis"].values():
            factors = [c["post_factor"] for c in h["cells"]]
            ax.plot(factors, [c["steady"]["share_stuck"] for c in h["cells"]], "o--",
                    label=f"{h['deployment']}: steady at that rate")
            ax.plot(factors, [c["after_surge"]["share_stuck"] for c in h["cells"]], "s-",
                    label=f"{h['deployment']}: after a +100% 10-min surge")
        ax.set_xlabel("rate after the surge / base rate")
        ax.set_ylabel("share of seeds stuck")
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("Seeds stuck after a surge vs steady at the same rate (hysteresis)")
        ax.legend(fontsize=8)
        paths.append(out_dir / "hysteresis.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["rates", "hysteresis", "knee"],
                        choices=["rates", "hysteresis", "knee"])
    parser.add_argument("--timing", default=TIMING)
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--knee-seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("data/sim/paper_regime.json"))
    parser.add_argument("--plots", type=Path)
    args = parser.parse_args(argv)
    timing = load_timing(args.timing)
    result: dict[str, Any] = {"timing": args.timing, "scales": {"reasoning_scale": timing.reasoning_scale},
                              "seeds": args.seeds, "paper": PAPER}
    if args.out.exists():  # keep the parts not rerun
        result = {**json.loads(args.out.read_text()), **result}
    started = time.perf_counter()
    rates = {r["deployment"]: r for r in _map(overload, [("1p1d", args.timing), ("1p3d", args.timing)],
                                               args.jobs, "overload")}
    result["overload"] = rates
    for name, r in rates.items():
        print(f"{name}: overload at {r['overload_per_min']:.2f} sessions/min", file=sys.stderr)
    if "rates" in args.parts:
        jobs = [(steady(f"half-{d}", rates[d]["overload_rate_per_s"], args.timing, 0.5), d, seed, args.timing)
                for d in ("1p1d", "1p3d") for seed in args.seeds]
        rows = _map(run_one, jobs, args.jobs, "half")
        result["half_overload"] = {d: summary(rows, f"half-{d}") for d in ("1p1d", "1p3d")}
    if "hysteresis" in args.parts:
        bases = {"1p3d-host": 0.5 * rates["1p3d"]["overload_rate_per_s"], "1p1d": PAPER_BASE_PER_MIN / 60}
        result["hysteresis"] = {}
        for deployment, base in bases.items():
            jobs = [(scenario, deployment, seed, args.timing) for f in POST_FACTORS
                    for scenario in (steady(f"steady-{f}", base, args.timing, f),
                                     surge(f"surge-{f}", base, args.timing, f))
                    for seed in args.seeds]
            rows = _map(run_one, jobs, args.jobs, f"hysteresis {deployment}")
            result["hysteresis"][deployment] = {"deployment": deployment, "base_per_min": 60.0 * base, "cells": [
                {"post_factor": f, "steady": summary(rows, f"steady-{f}"), "after_surge": summary(rows, f"surge-{f}")}
                for f in POST_FACTORS], "runs": rows}
    if "knee" in args.parts:
        jobs = [("1p1d", rates["1p1d"]["overload_rate_per_s"], seed, args.timing) for seed in args.knee_seeds]
        steps = [s for seed_steps in _map(knee, jobs, args.jobs, "knee") for s in seed_steps]
        result["knee"] = {"deployment": "1p1d", "step_s": KNEE_STEP_S, "steps": steps}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plots is not None:
        for path in plot(result, args.plots):
            print(f"plot: {path}")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

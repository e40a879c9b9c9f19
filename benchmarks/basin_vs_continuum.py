"""Basin (or a row of it) against Continuum, paired by seed; exit 1 below --min-ratio (a guard for README claims).

    python benchmarks/basin_vs_continuum.py     # the paper's regime where nothing is overloaded: they must tie
    python benchmarks/basin_vs_continuum.py --scenarios paper-timed-kill-burst-keep --min-ratio 1.3   # fails: 0.78x
    python benchmarks/basin_vs_continuum.py --scenarios paper-timed-kill-burst-keep --label basin:oracle-peak

Runs `basin-sim compare` for `continuum` and `--label` (default `basin`, the paper's Basin; any
ablation row) on the given scenarios on the paper's 1P3D H200 (default: the three cells of the
paper's regime that no policy overloads, the Terminal-Bench surge and killed burst and the
SWE-bench-Pro-like surge, where Basin must not fall behind), pairs the runs by seed and prints, per
scenario, both goodputs (mean +- sd), the ratio of the means and how many seeds Basin won. The exit
status is 1 if any scenario's ratio of means is below --min-ratio (default 0.99).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from basin_runtime.markdown_table import markdown_row, markdown_table
from basin_sim.experiments import compare


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):,.0f} ± {sd:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+",
                        default=["paper-timed-surge-100", "paper-timed-kill-burst", "paper-swebench-pro-surge-100"])
    parser.add_argument("--label", default="basin",
                        help="basin or one of its ablations (basin_sim/experiments/ablations.py)")
    parser.add_argument("--predictions", choices=("out-of-fold", "in-sample"), default="out-of-fold",
                        help="Basin's peaks (basin_sim/experiments/predictions.py; default out-of-fold, as basin-sim "
                             "compare)")
    parser.add_argument("--deployment", default="1p3d")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--min-ratio", type=float, default=0.99, help="Basin / Continuum goodput must be >= this")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        policies = ["--policies", "continuum", "basin"] if args.label == "basin" else \
            ["--policies", "continuum", "--ablations", args.label]
        status = compare.main(["--scenarios", *args.scenarios, "--deployments", args.deployment, *policies,
                               "--seeds", *map(str, args.seeds), "--jobs", str(args.jobs),
                               "--out", str(out), "--predictions", args.predictions])
        if status != 0:
            return status
        runs = json.loads(out.read_text())["runs"]
    failed = []
    label = args.label
    print("\n" + markdown_table(["scenario", "continuum /h", f"{label} /h", f"{label} / continuum", "seeds ahead",
                                 f">= {args.min_ratio:g}"], []))
    for scenario in args.scenarios:
        by_seed = {(r["policy"], r["seed"]): r["goodput_per_hour"] for r in runs if r["scenario"] == scenario}
        basin = [by_seed[(args.label, s)] for s in args.seeds]
        continuum = [by_seed[("continuum", s)] for s in args.seeds]
        ratio = statistics.fmean(basin) / statistics.fmean(continuum) if statistics.fmean(continuum) > 0 else \
            float("inf")
        ahead = sum(b > c for b, c in zip(basin, continuum, strict=True))
        ok = ratio >= args.min_ratio
        if not ok:
            failed.append(scenario)
        print(markdown_row([scenario, _spread(continuum), _spread(basin), f"{ratio:.2f}",
                            f"{ahead} of {len(args.seeds)}", "yes" if ok else "NO"]))
    if failed:
        print(f"{args.label} / Continuum below {args.min_ratio:g} on: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

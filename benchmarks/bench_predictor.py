"""PeakPredictor load time and single-row / batch prediction latency of every shipped model
(targets: load < 0.5 s, single-row p99 < 1 ms), on real task texts when the session table is there,
and the p99 of a revision at call 3 (the online model beside the file, from a stored first-call prediction).

    python benchmarks/bench_predictor.py [--model models/peak_predictor.onnx ...] [--n 5000]

Each model predicts the task texts of its own benchmark (the pooled model: all of them); without the
session table, one short synthetic text. Prints one row per model and the ones that miss the target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from basin_runtime.predictor import PeakPredictor
from basin_runtime.session_table import read_table

P99_TARGET_MS = 1.0
LOAD_TARGET_S = 0.5


def _texts(sessions: Path, benchmarks: tuple[str, ...], n: int) -> list[tuple[str, int]]:
    rows: list[tuple[str, int]] = []
    if sessions.exists():
        table = read_table(sessions).select(["benchmark", "task_text", "first_prompt_tokens"]).to_pylist()
        rows = [(r["task_text"], int(r["first_prompt_tokens"])) for r in table if r["benchmark"] in benchmarks]
    if not rows:
        rows = [("Fix the failing test in utils.py and add a regression test.", 1500)]
    return [rows[i % len(rows)] for i in range(n)]


def bench(model: Path, sessions: Path, n: int) -> dict[str, float]:
    """Load time, single-row p50 / p99 / max and batch time per row of one model file."""
    started = time.perf_counter()
    predictor = PeakPredictor.load(model)
    load_s = time.perf_counter() - started
    rows = _texts(sessions, predictor.info.benchmarks, n)
    latencies = []
    for text, first in rows:
        t0 = time.perf_counter_ns()
        predictor.predict(text, first)
        latencies.append((time.perf_counter_ns() - t0) / 1e6)
    batch_t0 = time.perf_counter()
    predictor.predict_batch([t for t, _ in rows], [f for _, f in rows])
    batch_ms = (time.perf_counter() - batch_t0) * 1e3 / len(rows)
    online = []  # a revision at call 3: the online model alone, from the stored first-call prediction
    if predictor.online is not None:
        for _, first in rows:
            t0 = time.perf_counter_ns()
            predictor.online.predict(3.0 * first, [first, 2 * first, 3 * first], [100, 120])
            online.append((time.perf_counter_ns() - t0) / 1e6)
    return {"mb": model.stat().st_size / 1e6, "chars": statistics.median(len(t) for t, _ in rows),
            "load_ms": load_s * 1e3, "p50": float(np.percentile(latencies, 50)),
            "p99": float(np.percentile(latencies, 99)), "max": max(latencies), "batch_ms": batch_ms,
            "online_p99": float(np.percentile(online, 99)) if online else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append",
                        help="a model file (repeat; default: every models/*.onnx)")
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"),
                        help="real task texts to predict on, when present")
    parser.add_argument("--n", type=int, default=5000, help="single-row predictions per model")
    args = parser.parse_args(argv)
    models = args.model or sorted(p for p in Path("models").glob("*.onnx") if not p.name.endswith(".online.onnx"))
    if not models:
        print("no model files: give --model PATH", file=sys.stderr)
        return 2
    source = args.sessions if args.sessions.exists() else "a synthetic line"
    print(f"{args.n} single-row predictions per model; task texts from {source}")
    print(f"{'model':44} {'MB':>6} {'chars p50':>9} {'load ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} "
          f"{'batch ms/row':>12} {'revision p99 ms':>15}")
    misses = []
    for model in models:
        r = bench(model, args.sessions, args.n)
        print(f"{model.name:44} {r['mb']:6.2f} {r['chars']:9.0f} {r['load_ms']:8.1f} {r['p50']:7.3f} {r['p99']:7.3f} "
              f"{r['max']:7.3f} {r['batch_ms']:12.3f} {r['online_p99']:15.3f}")
        if r["p99"] >= P99_TARGET_MS or r["load_ms"] >= LOAD_TARGET_S * 1e3:
            misses.append(model.name)
    print(f"target: single-row p99 < {P99_TARGET_MS:g} ms, load < {LOAD_TARGET_S:g} s; "
          + (f"missed by {', '.join(misses)}" if misses else "every model meets it"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

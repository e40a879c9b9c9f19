"""PeakPredictor load time and single-row / batch prediction latency (targets: load < 0.5 s, p99 < 0.5 ms).

    python benchmarks/bench_predictor.py [--model models/peak_predictor.onnx] [--n 5000]
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


def _texts(sessions: Path, n: int) -> list[tuple[str, int]]:
    if sessions.exists():
        table = read_table(sessions).select(["task_text", "first_prompt_tokens"]).to_pylist()
        rows = [(r["task_text"], int(r["first_prompt_tokens"])) for r in table]
    else:
        rows = [("Fix the failing test in utils.py and add a regression test.", 1500)]
    return [rows[i % len(rows)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/peak_predictor.onnx"))
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"),
                        help="real task texts to predict on, when present")
    parser.add_argument("--n", type=int, default=5000)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    predictor = PeakPredictor.load(args.model)
    load_s = time.perf_counter() - started
    rows = _texts(args.sessions, args.n)
    latencies = []
    for text, first in rows:
        t0 = time.perf_counter_ns()
        predictor.predict(text, first)
        latencies.append((time.perf_counter_ns() - t0) / 1e6)
    batch_t0 = time.perf_counter()
    predictor.predict_batch([t for t, _ in rows], [f for _, f in rows])
    batch_ms = (time.perf_counter() - batch_t0) * 1e3 / len(rows)
    chars = statistics.median(len(t) for t, _ in rows)
    print(f"model {args.model} ({args.model.stat().st_size / 1e6:.2f} MB), {len(rows)} predictions, "
          f"median task text {chars:.0f} chars")
    print(f"load (incl. warm-up)  {load_s * 1e3:.1f} ms")
    print(f"single row            p50 {np.percentile(latencies, 50):.3f} ms   p99 {np.percentile(latencies, 99):.3f} ms"
          f"   max {max(latencies):.3f} ms")
    print(f"batch of {len(rows)}         {batch_ms:.3f} ms per row")
    return 0


if __name__ == "__main__":
    sys.exit(main())

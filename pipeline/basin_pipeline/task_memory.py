"""Stage `task_memory`: the shrinkage k of the memory of finished tasks, fitted and scored out of fold by task.

Rules:
- Rows: every session of the feature frame with its out-of-fold pooled prediction (the nested stage's
  table: a model that never saw the session's task, as the simulator replays it) and its task
  fingerprint (`basin_runtime.task_fingerprint`, from its task text).
- The memory of a row is the peaks of the earlier sessions of its fingerprint, the newest
  MAX_PEAKS_PER_TASK of them (`basin_runtime.task_memory`'s bound). Assumption (the order): the corpora
  carry no start times, so "earlier" is a fixed pseudo-random order, the SHA-256 of the session id; the
  simulator's arrivals are uniform random draws too, so a memory sees its task's sessions in a random order.
- Loss: squared error of the log peak over the rows with a memory (rows without one are not moved by k).
  Why: the predictor is a ridge on log peak (its own loss), and a reservation is m(q) x the peak, so
  an error counts by its ratio, not its tokens.
- k is chosen on K_GRID, a log grid 0.01..1000 with 0 (the memory alone) and None (no memory, w = 0) at
  its ends; ties go to the larger k (less memory). Assumption: the grid spans w from 1/(1+1000) to
  n/(n+0.01) for any n >= 1 at 10 points a decade, finer than the fit's noise on a few hundred rows.
- Out of fold by task: for each outer fold of the nested stage's table (every run of a task in one fold),
  k is fitted on the other folds' rows and scored on the fold's rows; the report gives each fold's k
  and the held-out loss with and without the memory. The shipped k is fitted on every row (as `train`
  fits the shipped model on every row; the out-of-fold numbers score that procedure).
- The output (TASK_MEMORY_FILE, `basin_runtime.task_memory.load_shrinkage` reads it) holds the shipped k
  and the report. No params: the folds are the nested stage's.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from basin_pipeline.metrics_files import write_metrics
from basin_runtime.logs import configure_logging
from basin_runtime.task_fingerprint import task_fingerprint
from basin_runtime.task_memory import FORMAT, MAX_PEAKS_PER_TASK, VERSION, shrinkage_weight

log = logging.getLogger(__name__)
K_GRID: tuple[float | None, ...] = (None, *(float(10 ** (e / 10)) for e in range(30, -21, -1)), 0.0)


@dataclass(frozen=True)
class MemoryRows:
    """Per row: log true peak, log prediction, memory size n, mean log peak of the memory (nan if n = 0), fold."""

    log_peak: np.ndarray
    log_predicted: np.ndarray
    n: np.ndarray
    mean_log: np.ndarray
    fold: np.ndarray


def memory_rows(frame: pd.DataFrame, predictions: pd.DataFrame) -> MemoryRows:
    """Each session's memory of earlier sessions of its fingerprint (see the rules), beside its prediction."""
    rows = frame[["session_id", "task_text", "peak_prompt_tokens"]].merge(
        predictions[["session_id", "outer_fold", "pooled_predicted"]], on="session_id", how="inner",
        validate="one_to_one")
    rows = rows[rows["pooled_predicted"].notna()].reset_index(drop=True)
    rows["fingerprint"] = rows["task_text"].map(task_fingerprint)
    rows["order"] = rows["session_id"].map(lambda s: hashlib.sha256(str(s).encode()).hexdigest())
    n = np.zeros(len(rows), dtype=np.int64)
    mean_log = np.full(len(rows), np.nan)
    for fingerprint, group in rows.groupby("fingerprint", sort=True):
        earlier: list[float] = []
        for index in group.sort_values("order").index:
            memory = earlier[-MAX_PEAKS_PER_TASK:]
            if memory and fingerprint:
                n[index] = len(memory)
                mean_log[index] = float(np.mean(memory))
            earlier.append(math.log(max(1.0, float(rows.at[index, "peak_prompt_tokens"]))))
    return MemoryRows(np.log(np.maximum(1.0, rows["peak_prompt_tokens"].to_numpy(dtype=float))),
                      np.log(np.maximum(1.0, rows["pooled_predicted"].to_numpy(dtype=float))), n, mean_log,
                      rows["outer_fold"].to_numpy())


def loss(rows: MemoryRows, at: np.ndarray, k: float | None) -> float | None:
    """Mean squared log error of the shrunk predictions on the rows `at` that have a memory (None: no such row)."""
    chosen = at & (rows.n > 0)
    if not chosen.any():
        return None
    w = np.array([shrinkage_weight(int(n), k) for n in rows.n[chosen]])
    shrunk = (1.0 - w) * rows.log_predicted[chosen] + w * np.nan_to_num(rows.mean_log[chosen])
    return float(np.mean((rows.log_peak[chosen] - shrunk) ** 2))


def fit_k(rows: MemoryRows, at: np.ndarray) -> float | None:
    """The k of K_GRID with the least loss on the rows `at` (ties: the larger k; no row with a memory: None)."""
    best_k, best = None, loss(rows, at, None)
    if best is None:
        return None
    for k in K_GRID[1:]:
        value = loss(rows, at, k)
        if value is not None and value < best - 1e-12:
            best_k, best = k, value
    return best_k


def out_of_fold(rows: MemoryRows) -> dict[str, Any]:
    """Per outer fold: k fitted on the other folds, the fold's rows with a memory, its loss without and with it."""
    folds: dict[str, Any] = {}
    held_model, held_shrunk, held_rows = 0.0, 0.0, 0
    for fold in sorted(set(rows.fold.tolist())):
        test = rows.fold == fold
        k = fit_k(rows, ~test)
        model, shrunk = loss(rows, test, None), loss(rows, test, k)
        with_memory = int((test & (rows.n > 0)).sum())
        folds[str(fold)] = {"k": k, "rows_with_memory": with_memory, "loss_model": model, "loss_shrunk": shrunk}
        if model is not None and shrunk is not None:
            held_model += model * with_memory
            held_shrunk += shrunk * with_memory
            held_rows += with_memory
    pooled = {"rows_with_memory": held_rows,
              "loss_model": held_model / held_rows if held_rows else None,
              "loss_shrunk": held_shrunk / held_rows if held_rows else None}
    return {"folds": folds, "held_out": pooled}


def report(frame: pd.DataFrame, predictions: pd.DataFrame) -> dict[str, Any]:
    """The task-memory file: the shipped k (fitted on every row) and its out-of-fold report."""
    rows = memory_rows(frame, predictions)
    every = np.ones(len(rows.n), dtype=bool)
    return {"format": FORMAT, "version": VERSION, "k": fit_k(rows, every),
            "loss": "mean squared log error over rows with a memory", "rows": len(rows.n),
            "rows_with_memory": int((rows.n > 0).sum()), "max_peaks_per_task": MAX_PEAKS_PER_TASK,
            "out_of_fold": out_of_fold(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.task_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--frame", type=Path, required=True, help="the feature frame (task text, true peak)")
    parser.add_argument("--predictions", type=Path, required=True, help="the nested stage's out-of-fold table")
    parser.add_argument("--out", type=Path, required=True, help="task_memory.json to write")
    args = parser.parse_args(argv)
    configure_logging()
    result = report(pd.read_parquet(args.frame), pd.read_parquet(args.predictions))
    held = result["out_of_fold"]["held_out"]
    log.info("task memory: k %s on %d rows with a memory of %d; held out: loss %s without, %s with",
             result["k"], result["rows_with_memory"], result["rows"], held["loss_model"], held["loss_shrunk"])
    write_metrics(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

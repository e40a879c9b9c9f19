"""Stage task_memory: the shrinkage k is fitted out of fold by task (basin_pipeline.task_memory)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from basin_pipeline import task_memory
from basin_runtime.task_memory import load_shrinkage


def _fixture() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fold 0: each task's runs share one peak far from the model's guess (the memory is right); fold 1: a task's
    runs scatter around an accurate model (the memory is noise). In-fold, fold 0 would pick a small k."""
    rows = []
    for t in range(4):  # fold 0
        for r in range(4):
            rows.append((f"a{t}-{r}", f"task a{t}", 8000, 1000.0, 0))
    rng = np.random.default_rng(0)
    for t in range(4):  # fold 1
        for r in range(4):
            rows.append((f"b{t}-{r}", f"task b{t}", int(4000 * math.exp(rng.choice([-2.0, 2.0]))), 4000.0, 1))
    frame = pd.DataFrame({"session_id": [r[0] for r in rows], "task_text": [r[1] for r in rows],
                          "peak_prompt_tokens": [r[2] for r in rows]})
    predictions = pd.DataFrame({"session_id": [r[0] for r in rows], "pooled_predicted": [r[3] for r in rows],
                                "outer_fold": [r[4] for r in rows]})
    return frame, predictions


def test_each_folds_k_is_fitted_on_the_other_folds_and_differs_from_an_in_fold_fit() -> None:
    frame, predictions = _fixture()
    rows = task_memory.memory_rows(frame, predictions)
    fold0, fold1 = rows.fold == 0, rows.fold == 1
    in_fold = task_memory.fit_k(rows, fold0)
    report = task_memory.out_of_fold(rows)["folds"]
    assert report["0"]["k"] == task_memory.fit_k(rows, fold1)
    assert report["1"]["k"] == task_memory.fit_k(rows, fold0)
    assert in_fold is not None and in_fold <= 0.01  # fold 0 alone: trust the memory
    assert report["0"]["k"] != in_fold  # out of fold it is not told that
    assert report["0"]["loss_shrunk"] == task_memory.loss(rows, fold0, report["0"]["k"])


def test_a_rows_memory_is_its_tasks_earlier_sessions_only() -> None:
    frame, predictions = _fixture()
    rows = task_memory.memory_rows(frame, predictions)
    assert sorted(rows.n.tolist()) == sorted([0, 1, 2, 3] * 8)  # 8 tasks of 4 runs: 0..3 earlier runs each
    assert np.allclose(rows.mean_log[rows.fold == 0][rows.n[rows.fold == 0] > 0], math.log(8000))


def test_the_stage_writes_a_file_the_runtime_reads(tmp_path: Path) -> None:
    frame, predictions = _fixture()
    frame.to_parquet(tmp_path / "frame.parquet")
    predictions.to_parquet(tmp_path / "oof.parquet")
    out = tmp_path / "task_memory.json"
    assert task_memory.main(["--frame", str(tmp_path / "frame.parquet"), "--predictions",
                             str(tmp_path / "oof.parquet"), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["rows_with_memory"] == 24
    assert load_shrinkage(out).k == written["k"]

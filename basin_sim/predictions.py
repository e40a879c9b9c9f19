# Predicted peaks for a session pool, made once per run set with the shipped ONNX predictor.
#
# Rules: the predictor sees only what the gateway sees at a session's first call (`task_text`, the
# first prompt's size); the whole pool goes through `predict_batch` in one call. The reservation
# quantile: scale factors are quantiles of true/predicted peak ratios from the evaluate stage.
"""Batch-predict a pool's peaks; reservation scale factors from evaluated ratios."""

from __future__ import annotations

import csv
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from basin_runtime.session_table import Session

DEFAULT_MODEL = Path("models/peak_predictor.onnx")


class BatchPredictor(Protocol):
    """What `basin_runtime.predictor.PeakPredictor` offers the simulator."""

    def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> Sequence[float]:
        """Predicted peak tokens of many sessions."""
        ...


def load_predictor(path: Path) -> BatchPredictor:
    """The ONNX peak predictor at `path` (onnxruntime; checked by `PeakPredictor.load`)."""
    from basin_runtime.predictor import PeakPredictor

    return PeakPredictor.load(path)  # type: ignore[return-value]


def predict_pool(predictor: BatchPredictor, pool: Sequence[Session]) -> dict[str, float]:
    """Pool session id -> predicted peak tokens, from task text and first prompt size only."""
    peaks = predictor.predict_batch([s.task_text for s in pool], [s.first_prompt_tokens for s in pool])
    return {s.session_id: float(p) for s, p in zip(pool, peaks, strict=True)}


def ratio_quantiles(predictions_csv: Path, quantiles: Sequence[float],
                    column: str = "pooled_predicted") -> dict[float, float]:
    """Quantiles of true/predicted peak from the evaluate stage's predictions.csv."""
    with predictions_csv.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or column not in rows[0] or "true_peak_tokens" not in rows[0]:
        raise ValueError(f"{predictions_csv}: expected columns true_peak_tokens and {column}")
    ratios = sorted(float(r["true_peak_tokens"]) / float(r[column]) for r in rows if float(r[column]) > 0)
    if len(ratios) < 2:
        raise ValueError(f"{predictions_csv}: fewer than 2 usable rows")
    cuts = statistics.quantiles(ratios, n=100, method="inclusive")
    return {q: (cuts[round(q * 100) - 1] if 0 < q < 1 else (ratios[0] if q <= 0 else ratios[-1])) for q in quantiles}

"""Ranking quality: Spearman per benchmark, out-of-fold predictions, overflow share."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy.stats import spearmanr
from sklearn.pipeline import Pipeline


def spearman(predicted: np.ndarray, true: np.ndarray) -> float | None:
    """Spearman rank correlation, or None where it is undefined (fewer than 3 rows, or a constant)."""
    if len(true) < 3 or np.ptp(predicted) == 0 or np.ptp(true) == 0:
        return None
    value = float(spearmanr(predicted, true).statistic)
    return value if math.isfinite(value) else None


def spearman_by_benchmark(frame: pd.DataFrame, predicted: np.ndarray) -> dict[str, float | None]:
    """Spearman of `predicted` against the true peak within each benchmark."""
    result: dict[str, float | None] = {}
    for name, index in frame.groupby("benchmark").indices.items():
        result[str(name)] = spearman(predicted[index], frame["peak_prompt_tokens"].to_numpy()[index])
    return result


def mean_defined(values: dict[str, float | None]) -> float:
    """Mean of the defined values (an undefined one counts as 0: no ranking ability)."""
    return float(np.mean([v if v is not None else 0.0 for v in values.values()])) if values else 0.0


def _fit_predict(make: Callable[[], Pipeline], train: pd.DataFrame, test: pd.DataFrame) -> np.ndarray:
    model = make().fit(train, train["peak_prompt_tokens"].to_numpy())
    return np.asarray(model.predict(test), dtype=np.float64)


def out_of_fold(frame: pd.DataFrame, fold_column: str, make: Callable[[], Pipeline]) -> np.ndarray:
    """Predictions for every row from a model fitted without that row's fold (-1: row never held out)."""
    predicted = np.full(len(frame), np.nan)
    for fold in sorted(f for f in frame[fold_column].unique() if f >= 0):
        train, test = frame[frame[fold_column] != fold], frame[frame[fold_column] == fold]
        predicted[frame.index.get_indexer(test.index)] = _fit_predict(make, train, test)
    return predicted


def overflow_share(predicted: np.ndarray, true: np.ndarray) -> float:
    """Share of sessions whose true peak exceeds the prediction: what overflows a budget."""
    return float(np.mean(true > predicted)) if len(true) else float("nan")

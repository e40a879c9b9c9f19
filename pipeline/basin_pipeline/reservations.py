"""Reservation multipliers: reserve m(q) x predicted peak so that a share q of true peaks fit.

Rules:
- m(q) is the q-quantile of true_peak / predicted_peak over OUT-OF-FOLD predictions (each row
  predicted by a model fitted without its task-grouped fold), per benchmark. The quantile is the
  inverted empirical CDF (the smallest ratio with at least a share q of ratios at or below it), so on
  the rows it is fitted on it covers at least q. In-sample predictions would over-fit and under-cover.
- Predictions are floored at 1 token before dividing (a ratio needs a positive denominator).
- Coverage of reserves on rows = share of rows with true_peak <= reserve. Reserved/used ratio = the
  sum of reserves over the sum of true peaks on the same rows (tokens held per token used: the
  budget's view), not the mean of per-row ratios.
- References scored the same way: oracle (reserve = true peak: coverage 1, ratio 1) and constant
  (reserve = the q-quantile of the training rows' true peaks of that benchmark, same quantile rule).
- `shipping_multipliers` fits m(q) for the shipped models (train's chosen params, train's folds) on
  each model's own rows, on a grid of q (SHIPPED_QUANTILES), per benchmark and over all rows: export
  writes it into each ONNX file (`basin.reservation_multipliers`), read by
  `PeakPredictor.multiplier(q)`. Nothing here reads params.yaml or writes files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.trained import POOLED, TrainedModel, TrainedModels

QUANTILES = (0.8, 0.9, 0.95)
# the grid each shipped model carries; the runtime interpolates between its points
SHIPPED_QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.99)
MIN_PREDICTED_TOKENS = 1.0


def quantile(values: np.ndarray, q: float) -> float:
    """The smallest value with at least a share `q` of `values` at or below it."""
    if len(values) == 0:
        raise ValueError("a quantile of no values")
    return float(np.quantile(np.asarray(values, dtype=np.float64), q, method="inverted_cdf"))


def ratios(true: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """true_peak / predicted_peak, the prediction floored at one token."""
    return np.asarray(true, dtype=np.float64) / np.maximum(np.asarray(predicted, dtype=np.float64),
                                                             MIN_PREDICTED_TOKENS)


def multipliers(true: np.ndarray, predicted: np.ndarray, qs: Sequence[float] = QUANTILES) -> dict[str, float]:
    """m(q) per q (keys as text, e.g. "0.9") from out-of-fold predictions."""
    r = ratios(true, predicted)
    return {str(q): quantile(r, q) for q in qs}


def cover(true: np.ndarray, reserved: np.ndarray) -> dict[str, float]:
    """Coverage (share with true <= reserved) and reserved/used (sum reserved / sum true) on these rows."""
    true = np.asarray(true, dtype=np.float64)
    reserved = np.asarray(reserved, dtype=np.float64)
    return {"coverage": float(np.mean(true <= reserved)), "reserved_over_used": float(reserved.sum() / true.sum())}


def fold_scores(true_train: np.ndarray, oof_train: np.ndarray, true_test: np.ndarray, predicted_test: np.ndarray,
                qs: Sequence[float] = QUANTILES) -> dict[str, Any]:
    """One outer fold of one benchmark: multipliers fitted on the train rows' out-of-fold predictions,
    scored on the test rows, beside the oracle and the per-benchmark constant."""
    m = multipliers(true_train, oof_train, qs)
    floored = np.maximum(np.asarray(predicted_test, dtype=np.float64), MIN_PREDICTED_TOKENS)
    out: dict[str, Any] = {"multiplier": m, "model": {}, "constant": {}, "oracle": cover(true_test, true_test)}
    for q in qs:
        out["model"][str(q)] = cover(true_test, m[str(q)] * floored)
        out["constant"][str(q)] = cover(true_test, np.full(len(true_test), quantile(true_train, q)))
    return out


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, sd (null for one value) and min of some fold-level numbers."""
    return {"mean": float(np.mean(values)), "sd": float(np.std(values, ddof=1)) if len(values) > 1 else None,
            "min": float(np.min(values))}


def aggregate(folds: list[dict[str, Any]], qs: Sequence[float] = QUANTILES) -> dict[str, Any]:
    """Mean, sd and min over every (seed, outer fold) of each `fold_scores` number."""
    keys = ("coverage", "reserved_over_used")
    out: dict[str, Any] = {"folds": len(folds),
                           "multiplier": {str(q): spread([f["multiplier"][str(q)] for f in folds]) for q in qs},
                           "oracle": {k: spread([f["oracle"][k] for f in folds]) for k in keys}}
    for name in ("model", "constant"):
        out[name] = {str(q): {k: spread([f[name][str(q)][k] for f in folds]) for k in keys} for q in qs}
    return out


def shipping_multipliers(frame: pd.DataFrame, chosen: TrainedModels,
                         qs: Sequence[float] = SHIPPED_QUANTILES, folds_column: str = "fold_unseen",
                         ) -> dict[str, dict[str, Any]]:
    """The `basin.reservation_multipliers` table of each shipped model (`chosen`: train's best.json): m(q)
    on the grid `qs` from the model's out-of-fold predictions over its own rows (train's task-grouped
    folds), per benchmark and over all its rows.

    Shape: {name: {"quantiles": [q...], "by_benchmark": {benchmark: [m...]}, "all": [m...]}}.
    """
    frame = frame.reset_index(drop=True)
    out: dict[str, dict[str, Any]] = {}
    for name, record in chosen.items():
        rows = (frame if name == POOLED else frame[frame["benchmark"] == name]).reset_index(drop=True)
        true = rows["peak_prompt_tokens"].to_numpy(dtype=np.float64)
        predicted = _out_of_fold(rows, record, folds_column)
        benches = rows["benchmark"].astype(str).to_numpy()

        out[name] = multiplier_table(true, predicted, benches, qs)
    return out


def multiplier_table(true: np.ndarray, predicted: np.ndarray, benches: np.ndarray,
                     qs: Sequence[float] = SHIPPED_QUANTILES) -> dict[str, Any]:
    """One file's `basin.reservation_multipliers` table from out-of-fold predictions of its rows."""
    everything = np.ones(len(true), dtype=bool)
    return {"quantiles": list(qs), "all": _grid(true, predicted, everything, qs),
            "by_benchmark": {b: _grid(true, predicted, benches == b, qs) for b in sorted(set(benches))}}


def _grid(true: np.ndarray, predicted: np.ndarray, at: np.ndarray, qs: Sequence[float]) -> list[float]:
    m = multipliers(true[at], predicted[at], qs)
    return [round(m[str(q)], 6) for q in qs]


def _out_of_fold(rows: pd.DataFrame, record: TrainedModel, folds_column: str) -> np.ndarray:
    params = record.params
    return FoldFeaturizer(rows, [params.ngram_max]).out_of_fold(params, rows[folds_column].to_numpy())

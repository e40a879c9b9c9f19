"""A length line: log(1 + peak) as a straight line in log(1 + one length), the nested stage's length baselines.

Rules:
- The line is fitted by least squares (`numpy.polyfit`, degree 1) on log1p of the column and of the true
  peak; a column that does not vary on the fitted rows gives a flat line at the mean log peak. This is the
  nested stage's `task_chars_only` / `first_prompt_only` baseline (`basin_pipeline.nested.baseline_predict`
  calls `fit_line`), so what is scored there is what ships.
- Columns: `task_chars` (characters of the task text, as the gateway counts `len(task_text)`) or
  `first_prompt_tokens`: the predictor's length inputs, so a line's ONNX file takes the same three inputs
  as every other predictor file (the text is an input it does not read).
- `LengthLine.predict` takes the model frame (`basin_pipeline.features.model_frame`) and returns peak tokens,
  like a fitted pipeline, so export's parity check runs on it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from basin_pipeline.features import LENGTH_INPUTS


def fit_line(x: np.ndarray, true: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of log1p(true) on log1p(x); flat at the mean log peak when x does not vary."""
    log_x = np.log1p(np.asarray(x, dtype=np.float64))
    log_y = np.log1p(np.asarray(true, dtype=np.float64))
    if len(log_x) == 0:
        raise ValueError("a length line fitted on no rows")
    if np.ptp(log_x) == 0:
        return 0.0, float(np.mean(log_y))
    slope, intercept = np.polyfit(log_x, log_y, 1)
    return float(slope), float(intercept)


def predict_line(slope: float, intercept: float, x: np.ndarray) -> np.ndarray:
    """Peak tokens on the line at lengths `x`."""
    return np.asarray(np.expm1(slope * np.log1p(np.asarray(x, dtype=np.float64)) + intercept), dtype=np.float64)


def line_out_of_fold(x: np.ndarray, true: np.ndarray, folds: np.ndarray) -> np.ndarray:
    """Each row's prediction by the line fitted on the other folds' rows."""
    x, true = np.asarray(x, dtype=np.float64), np.asarray(true, dtype=np.float64)
    predicted = np.full(len(x), np.nan)
    for fold in np.unique(folds):
        held = folds == fold
        predicted[held] = predict_line(*fit_line(x[~held], true[~held]), x[held])
    return predicted


@dataclass(frozen=True)
class LengthLine:
    """A fitted length line on one of the predictor's length inputs."""

    column: str
    slope: float
    intercept: float

    def __post_init__(self) -> None:
        if self.column not in LENGTH_INPUTS:
            raise ValueError(f"a length line reads one of {list(LENGTH_INPUTS)}, not {self.column!r}")
        if not (np.isfinite(self.slope) and np.isfinite(self.intercept)):
            raise ValueError(f"a length line needs a finite slope and intercept, got {self.slope}, {self.intercept}")

    @classmethod
    def fit(cls, frame: pd.DataFrame, column: str) -> LengthLine:
        """The line through `frame`'s rows (its `column` and `peak_prompt_tokens`)."""
        slope, intercept = fit_line(frame[column].to_numpy(), frame["peak_prompt_tokens"].to_numpy())
        return cls(column, slope, intercept)

    def predict(self, frame: pd.DataFrame) -> np.ndarray:
        """Peak tokens of the model frame's rows."""
        return predict_line(self.slope, self.intercept, frame[self.column].to_numpy())

    def to_json(self) -> dict[str, Any]:
        return {"column": self.column, "slope": self.slope, "intercept": self.intercept}

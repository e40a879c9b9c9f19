"""What the runtime's two model files (first-call and online) share: how a file is opened, how a
multiplier is read off its quantile grid, and a file's SHA-256 (a calibration names the predictor file
it was measured for). Errors are raised as the caller's own error type."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort


def open_session(path: Path, error: type[ValueError]) -> ort.InferenceSession:
    """An onnxruntime session on one thread (CPU); `error` naming the file if it is not a loadable model."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad files
        raise error(f"{path}: not a loadable ONNX model: {exc}") from exc


def multiplier_at(q: float, grid: Sequence[float], row: Sequence[float], error: type[ValueError], path: str | Path,
                  table: str) -> float:
    """m(q) linear between the grid's quantiles; `error` naming the file and `table` when q is off the grid."""
    if not (isinstance(q, (int, float)) and grid[0] <= q <= grid[-1]):
        raise error(f"{path}: reservation quantile {q!r} is outside the {table}' grid [{grid[0]}, {grid[-1]}]")
    return float(np.interp(q, grid, row))


def file_sha256(path: Path | None) -> str:
    """The predictor file's SHA-256 (hex), or "none" without a file (reservations are contexts)."""
    return "none" if path is None else hashlib.sha256(path.read_bytes()).hexdigest()

"""The metric files kept in git under metrics/ (`dvc metrics diff`, `dvc exp show`).

Rules:
- Floats are written with 6 significant digits: the last bits of a float differ between machines
  (BLAS, onnxruntime builds), and a re-run on unchanged data must leave git clean.
- NaN and infinities are written as null (JSON has neither; DVC shows `-`).
- Keys sorted, two-space indent, one trailing newline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SIGNIFICANT_DIGITS = 6


def rounded(value: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """`value` with every float rounded to `digits` significant digits (non-finite -> None)."""
    if isinstance(value, Mapping):
        return {str(k): rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    return value


def write_metrics(path: Path, values: Mapping[str, Any]) -> None:
    """Write `values` to `path` as a versioned metric file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rounded(values), indent=2, sort_keys=True) + "\n", encoding="utf-8")

"""The metric files kept in git under metrics/ (`dvc metrics diff`, `dvc exp show`).

Two kinds:
- Headline files, the only ones dvc.yaml declares as `metrics` (so `dvc metrics show`, `dvc metrics
  diff` and `dvc exp show` stay a few readable columns): from the nested stage one file per number,
  keyed by benchmark (`spearman_unseen.json`, `spearman_seen.json`, `cover90.json`: a row each in
  `dvc metrics show`, a column per benchmark), and `goodput.json` from simulate. Numbers only,
  benchmarks by their short names (`swe`, `tau`, `tb`; others as they are).
- Detail files (every other metrics/*.json): each stage's full report with the protocol named beside
  each number, kept in git as stage outputs; compare them with `dvc metrics diff --targets FILE`
  or `dvc metrics show FILE`.

Rules:
- Floats are written with 4 significant digits, the precision stable across x86 CPUs: every number
  here is computed in float64, but ridge's iterative solver stops at a tolerance, and another CPU's
  BLAS kernels (AVX2 or AVX-512, their own summation order) move its fit by ~1e-5 relative
  (docs/pipeline/predictor.md, "Clean re-runs"); 4 significant digits round on a step of 1e-4 to
  1e-3 relative, ten times that or more. 6 digits (before issue 45) showed the noise and dirtied git.
  The generated docs blocks (pipeline/basin_pipeline/render_results.py) print 2 or 3 decimals. What rounding cannot
  absorb: a value within the noise of a rounding step, or a simulated admission decided by a
  prediction within the noise of the budget, moves; commit the new file then.
- NaN and infinities are written as null (JSON has neither; DVC shows `-`).
- Keys sorted, two-space indent, one trailing newline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SIGNIFICANT_DIGITS = 4


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


def numbers_only(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` without None, strings or empty sections (a headline file holds numbers only)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            inner = numbers_only(value)
            if inner:
                out[key] = inner
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    return out

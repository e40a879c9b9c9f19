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
- Floats are written with 6 significant digits, a precision stable across x86 CPUs: every number
  here is computed in float64 (ridge fits, rank correlations, quantiles; the simulate stage replays
  the nested stage's float64 out-of-fold predictions and the m(q) rounded to 6 decimals in the
  shipped file), whose results differ between CPUs only in the last bits (BLAS kernels picked
  per instruction set, AVX2 or AVX-512: ~1e-13 relative), some seven orders below the 6th digit.
  float32 onnxruntime outputs (~1e-6 apart between builds) reach no metric file, and a model whose
  predictions moved by less than export's tolerance is not re-published. The generated docs
  blocks (scripts/render_results.py) print these at 2 or 3 decimals. A re-run on unchanged data
  leaves git clean.
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


SHORT_NAMES = {"swebench-verified": "swe", "tau-bench-airline": "tau", "terminal-bench": "tb"}


def short_name(benchmark: str) -> str:
    """A benchmark's column name in the headline files."""
    return SHORT_NAMES.get(benchmark, benchmark)


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

"""`python -m basin_pipeline.headline`: the pipeline's headline from the committed metrics, two lines.

The last thing `make repro` prints (after DVC's own messages) and what `make metrics` ends with: the nested,
unseen-task Spearman of each benchmark's shipped model (mean ± sd over fold seeds; the honest estimate), then
the simulate stage's row (Basin's goodput and its paired ratios over seeds). It reads files only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


class HeadlineError(ValueError):
    """A metrics file is missing or lacks a number the headline shows."""


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HeadlineError(f"{path} is missing (`make repro` writes it)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise HeadlineError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise HeadlineError(f"{path}: not a JSON object")
    return value


def spearman_line(nested: dict[str, Any]) -> str:
    """The nested unseen-task Spearman per benchmark: the selected procedure's (`basin_pipeline.selection`), or in
    a file written before it, its shipped model's (its own, else the pooled one)."""
    parts = []
    for bench, entry in sorted(nested.get("unseen_task", {}).items()):
        model = "selected" if "selected" in entry else "own_model" if "own_model" in entry else "pooled_model"
        per_fold = entry.get(model, {}).get("per_fold", {})
        if per_fold.get("mean") is None:
            continue
        parts.append(f"{bench} {per_fold['mean']:.2f} ± {per_fold.get('sd') or 0.0:.2f}")
    seeds = len(nested.get("settings", {}).get("seeds", [])) or "?"
    return f"Spearman on unseen tasks (nested CV, {seeds} fold seeds): " + (", ".join(parts) or "none scored")


def simulate_line(simulate: dict[str, Any]) -> str:
    """Basin's goodput and its paired ratios, as the simulate stage logs them."""
    try:
        basin = simulate["goodput"]["basin"]
        over_c, over_s = simulate["basin_over_continuum"], simulate["basin_over_own_steady"]
        return (f"Basin {basin['mean']:.0f} ± {basin['sd']:.0f} /h; over Continuum {over_c['mean']:.3f} ± "
                f"{over_c['sd']:.3f}, over its steady {over_s['mean']:.3f} ± {over_s['sd']:.3f} "
                f"({len(simulate['seeds'])} seeds)")
    except (KeyError, TypeError) as exc:
        raise HeadlineError(f"metrics/simulate.json lacks {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--metrics-dir", type=Path, default=Path("metrics"), help="where the metric files are")
    args = parser.parse_args(argv)
    try:
        nested = _load(args.metrics_dir / "nested.json")
        simulate = _load(args.metrics_dir / "simulate.json")
        print(spearman_line(nested))
        print(simulate_line(simulate))
    except HeadlineError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

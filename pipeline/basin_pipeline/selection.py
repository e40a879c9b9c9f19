"""Which first-call predictor serves each benchmark: the candidate that ranks best on inner folds (issue 49, part 5).

Rules:
- Candidates (`CANDIDATES`, in this order): the benchmark's own tuned model, the pooled tuned model, and the
  nested stage's two log-log lines of one number, on task characters and on first-prompt tokens
  (`basin_pipeline.length_line`). The constant baseline ranks nothing and is no candidate.
- A candidate's score on a set of folds is the statistic the nested stage reports: the Spearman within one
  benchmark's scored rows of each fold, averaged over the folds where it is defined (`inner_score`).
- The choice is the highest score (`choose`). Assumption: ties go to the earlier candidate in
  `CANDIDATES` (today's shipped order, own model before pooled, then the lines); a candidate with no
  defined fold is never chosen; if none is defined, the first candidate offered (own, else pooled: today's rule).
- Nested (`Candidates`): per fold seed, outer fold and benchmark, each candidate is scored on the inner folds
  of the outer-train rows only (the inner study's folds; a tuned model's inner predictions are its study's
  chosen trial's), the choice is made there, and its predictions of the outer-test rows are the selected
  procedure's. The outer-test rows never enter the choice; the selected score is the whole procedure's.
- Known bias, not hidden: a tuned model's inner score is the best of its study's trials on those same folds,
  so it is optimistic against the lines (nothing tuned); the choice leans towards the tuned models. The
  reported selected score stays honest either way: it is measured on outer-test rows.
- Shipping (`basin_pipeline.train`): the same rule on train's folds (`fold_unseen`) over all rows; the choice is
  recorded in best.json (`basin_pipeline.trained.ServingChoice`) and export ships it.
- No I/O; nothing here reads params.yaml.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from basin_pipeline.scoring import spearman

OWN, POOLED_MODEL, TASK_CHARS, FIRST_PROMPT = "own_model", "pooled_model", "task_chars_only", "first_prompt_only"
CANDIDATES = (OWN, POOLED_MODEL, TASK_CHARS, FIRST_PROMPT)
LINE_COLUMNS = {TASK_CHARS: "task_chars", FIRST_PROMPT: "first_prompt_tokens"}  # nested.BASELINES' columns


def inner_score(predicted: np.ndarray, true: np.ndarray, folds: np.ndarray) -> float | None:
    """Mean over `folds` of the Spearman within each fold's rows (folds where it is undefined are left out)."""
    values = [spearman(predicted[folds == f], true[folds == f]) for f in np.unique(folds)]
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def choose(scores: Mapping[str, float | None]) -> str:
    """The candidate with the highest defined score; ties to the earlier in CANDIDATES (see the rules)."""
    offered = [c for c in CANDIDATES if c in scores]
    unknown = set(scores) - set(CANDIDATES)
    if unknown or not offered:
        raise ValueError(f"candidates {sorted(scores)}: expected some of {list(CANDIDATES)}")
    best, best_value = offered[0], None
    for name in offered:
        value = scores[name]
        if value is not None and (best_value is None or value > best_value):
            best, best_value = name, value
    return best


@dataclass(frozen=True)
class FoldCandidate:
    """One candidate in one outer fold for one benchmark: its inner score and its outer-test predictions."""

    inner: float | None
    session_ids: tuple[str, ...]  # the benchmark's scored outer-test rows
    predicted: np.ndarray
    true: np.ndarray


@dataclass
class Candidates:
    """Every candidate's `FoldCandidate` by (fold seed, outer fold, benchmark), filled by the nested runs."""

    folds: dict[tuple[int, int, str], dict[str, FoldCandidate]] = field(default_factory=dict)

    def add(self, seed: int, fold: int, bench: str, candidate: str, entry: FoldCandidate) -> None:
        """Record one candidate; the same fold's candidates must score the same outer-test rows."""
        if candidate not in CANDIDATES:
            raise ValueError(f"unknown candidate {candidate!r}; known: {list(CANDIDATES)}")
        at = self.folds.setdefault((seed, fold, bench), {})
        other = next(iter(at.values()), None)
        if other is not None and set(other.session_ids) != set(entry.session_ids):
            raise ValueError(f"seed {seed}, outer fold {fold}, {bench}: {candidate} scores other outer-test rows "
                             "than the other candidates (the outer folds must depend only on the benchmark's rows)")
        at[candidate] = entry

    def choices(self) -> dict[tuple[int, int, str], str]:
        """The candidate chosen in each (seed, outer fold, benchmark), by inner scores only."""
        return {key: choose({name: c.inner for name, c in by.items()}) for key, by in self.folds.items()}

    def selected(self, seeds: Sequence[int]) -> dict[str, dict[str, Any]]:
        """Per benchmark and seed: the selected procedure's per-fold Spearman mean, its undefined folds, the
        value pooled over rows and the scored rows (`nested.score_seed`'s shape), and how often each candidate
        was chosen."""
        chosen = self.choices()
        out: dict[str, dict[str, Any]] = {}
        for bench in sorted({b for _, _, b in self.folds}):
            per_seed: list[dict[str, Any]] = []
            counts = dict.fromkeys(CANDIDATES, 0)
            for seed in seeds:
                keys = sorted(k for k in self.folds if k[0] == seed and k[2] == bench)
                picks = [self.folds[k][chosen[k]] for k in keys]
                for k in keys:
                    counts[chosen[k]] += 1
                values = [spearman(p.predicted, p.true) for p in picks]
                defined = [v for v in values if v is not None]
                predicted = np.concatenate([p.predicted for p in picks]) if picks else np.empty(0)
                true = np.concatenate([p.true for p in picks]) if picks else np.empty(0)
                per_seed.append({"per_fold": float(np.mean(defined)) if defined else None,
                                 "undefined_folds": len(values) - len(defined),
                                 "pooled_over_rows": spearman(predicted, true), "scored_rows": len(true)})
            out[bench] = {"per_seed": per_seed, "chosen": {c: n for c, n in counts.items() if n}}
        return out

    def predictions(self, seed: int) -> dict[str, tuple[float, str]]:
        """Session id -> (the selected procedure's outer-test prediction, the candidate chosen) for one seed."""
        chosen = self.choices()
        out: dict[str, tuple[float, str]] = {}
        for key, by in self.folds.items():
            if key[0] == seed:
                pick = by[chosen[key]]
                out.update((sid, (float(p), chosen[key])) for sid, p in zip(pick.session_ids, pick.predicted,
                                                                              strict=True))
        return out

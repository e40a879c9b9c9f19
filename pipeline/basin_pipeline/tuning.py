"""The Optuna study: a seeded TPE search over ridge alpha and the featurizer's knobs.

Objective: mean Spearman over the benchmarks a model serves, each measured on out-of-fold
predictions of the unseen-task folds (all runs of a task in one fold). Bigram trials search no
vocabulary cap (see `basin_pipeline.features`), so every trial's model converts to ONNX exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
import pandas as pd

from basin_pipeline.fast_cv import EmptyVocabularyError, FoldFeaturizer
from basin_pipeline.features import ModelParams
from basin_pipeline.params import SearchSpace
from basin_pipeline.scoring import mean_defined, spearman_by_benchmark


@dataclass(frozen=True)
class TrialResult:
    number: int
    params: ModelParams
    spearman: dict[str, float | None]
    objective: float


def suggest(trial: optuna.trial.BaseTrial, space: SearchSpace) -> ModelParams:
    """One point of the search space."""
    ngram_max = trial.suggest_int("ngram_max", *space.ngram_max)
    unigram = ngram_max == 1
    return ModelParams(
        alpha=trial.suggest_float("alpha", *space.alpha, log=True),
        ngram_max=ngram_max,
        min_df=trial.suggest_int("min_df", *space.min_df),
        max_df=trial.suggest_float("max_df", *space.max_df) if unigram else 1.0,
        max_features=trial.suggest_int("max_features", *space.max_features, log=True) if unigram else None,
        binary=trial.suggest_categorical("binary", [False, True]),
        use_lengths=trial.suggest_categorical("use_lengths", [False, True]),
    )


def evaluate_params(frame: pd.DataFrame, params: ModelParams, featurizer: FoldFeaturizer) -> dict[str, float | None]:
    """Unseen-task Spearman per benchmark for one set of knobs."""
    predicted = featurizer.out_of_fold(params, frame["fold_unseen"].to_numpy())
    return spearman_by_benchmark(frame, predicted)


def run_study(
    frame: pd.DataFrame,
    space: SearchSpace,
    *,
    study_name: str,
    storage: str,
    seed: int,
    n_trials: int,
    resume: bool,
    on_trial: Callable[[TrialResult], None],
) -> optuna.Study:
    """Run (or resume) the study; `on_trial` sees every finished trial (for MLflow and progress)."""
    if not resume:
        with contextlib.suppress(KeyError):  # no stored study of that name yet
            optuna.delete_study(study_name=study_name, storage=storage)
    study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed), load_if_exists=resume)
    featurizer = FoldFeaturizer(frame, range(space.ngram_max[0], space.ngram_max[1] + 1))
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    remaining = n_trials - len([t for t in study.trials if t.state in finished])

    def objective(trial: optuna.Trial) -> float:
        params = suggest(trial, space)
        try:
            scores = evaluate_params(frame, params, featurizer)
        except EmptyVocabularyError as exc:
            raise optuna.TrialPruned(str(exc)) from exc
        value = mean_defined(scores)
        for name, score in scores.items():
            trial.set_user_attr(f"spearman/{name}", score)
        on_trial(TrialResult(trial.number, params, scores, value))
        return value

    if remaining > 0:
        study.optimize(objective, n_trials=remaining)
    return study


def best_params(study: optuna.Study, space: SearchSpace) -> ModelParams:
    """The best trial's knobs as model params."""
    fixed: dict[str, Any] = dict(study.best_trial.params)
    return suggest(optuna.trial.FixedTrial(fixed), space)

"""Nested, repeated cross-validation (`basin_pipeline.nested`): folds, what the inner studies see, and bias."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
import scipy.sparse as sp

from basin_pipeline import nested, tuning
from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.features import ModelParams, build_model
from basin_pipeline.featurize import assign_folds
from basin_pipeline.params import NestedParams, SearchSpace
from basin_pipeline.scoring import spearman
from basin_pipeline.tracking import flat

SPACE = SearchSpace(alpha=(0.01, 30.0), ngram_max=(1, 1), min_df=(1, 4), max_df=(0.3, 1.0), max_features=(50, 5000))
SETTINGS = nested.Settings(outer_folds=5, inner_folds=3, trials=6, search=SPACE)
SIGNAL_WORDS = {f"w{i}" for i in range(1, 16)}


@pytest.fixture(autouse=True)
def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def synthetic(seed: int, num_rows: int, *, signal: bool, runs_per_task: int = 1) -> pd.DataFrame:
    """Random 20-word texts over 300 words; the peak is pure noise, or grows with 8 signal words."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice([f"w{i}" for i in range(300)], 20)) for _ in range(num_rows)]
    noise = rng.normal(0.0, 1.0, num_rows)
    hits = np.array([sum(w in SIGNAL_WORDS for w in t.split()) for t in texts], dtype=float)
    peak = np.exp(8.0 + (1.0 * hits if signal else 0.0) + 0.5 * noise)
    return pd.DataFrame({"benchmark": "b", "task_id": [f"t{i // runs_per_task}" for i in range(num_rows)],
                         "task_text": texts, "task_chars": rng.integers(100, 1000, num_rows),
                         "first_prompt_tokens": rng.integers(100, 1000, num_rows),
                         "peak_prompt_tokens": peak.astype(int)})


class Recording(FoldFeaturizer):
    """FoldFeaturizer that remembers every (train, test) index pair it was asked for."""

    def __init__(self, frame: pd.DataFrame) -> None:
        super().__init__(frame, [1])
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def split(self, params: ModelParams, train: np.ndarray, test: np.ndarray) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        self.calls.append((np.asarray(train).copy(), np.asarray(test).copy()))
        return super().split(params, train, test)


def test_outer_folds_keep_every_task_in_one_fold_and_seeds_reshuffle() -> None:
    frame = pd.concat([synthetic(0, 60, signal=False, runs_per_task=3),
                       synthetic(1, 40, signal=False).assign(benchmark="c")], ignore_index=True)
    rows = np.arange(len(frame))
    labels = {seed: nested.assign(frame, rows, 5, seed, "unseen_task") for seed in (1, 2, 3)}
    for seed, fold in labels.items():
        per_task = pd.Series(fold).groupby([frame["benchmark"], frame["task_id"]]).nunique()
        assert per_task.max() == 1, seed
        assert set(fold) == set(range(5))
    assert not np.array_equal(labels[1], labels[2]) and not np.array_equal(labels[2], labels[3])
    # a benchmark's folds do not depend on the other benchmarks' rows (pooled and own models share them)
    alone = frame[frame["benchmark"] == "c"].reset_index(drop=True)
    assert np.array_equal(nested.assign(alone, np.arange(len(alone)), 5, 1, "unseen_task"), labels[1][60:])
    seen = nested.assign(frame, rows, 5, 1, "seen_task")
    assert pd.Series(seen[:60]).groupby(frame["task_id"][:60]).nunique().max() > 1  # runs spread by row


def test_inner_studies_never_see_the_outer_test_rows() -> None:
    frame = synthetic(3, 50, signal=True)
    featurizer = Recording(frame)
    settings = nested.Settings(outer_folds=5, inner_folds=3, trials=2, search=SPACE)
    labels = nested.assign(frame, np.arange(len(frame)), settings.outer_folds, 7, "unseen_task")
    chosen: list[dict[str, object]] = []
    predict = nested.model_predictor(frame, featurizer, labels, "unseen_task", settings, 7, chosen)
    for fold in range(settings.outer_folds):
        featurizer.calls.clear()
        outer_test = np.flatnonzero(labels == fold)
        predict(np.flatnonzero(labels != fold), outer_test, fold)
        *inner, refit = featurizer.calls
        assert len(inner) == settings.trials * settings.inner_folds
        for train, test in inner:
            assert not set(train) & set(outer_test) and not set(test) & set(outer_test)
            assert not set(train) & set(test)
        assert set(refit[0]) == set(np.flatnonzero(labels != fold)) and set(refit[1]) == set(outer_test)
    assert len(chosen) == settings.outer_folds


def test_constant_baseline_is_undefined_per_fold_but_defined_when_pooled() -> None:
    frame = synthetic(4, 100, signal=False)
    scores = nested.nested_scores(frame, "unseen_task", [1, 2], nested.Settings(5, 3, 1, SPACE),
                                  FoldFeaturizer(frame, [1]), with_baselines=True)["b"]
    assert scores["constant"]["per_fold"] == {"mean": None, "sd": None, "seeds": [None, None]}
    assert scores["constant"]["undefined_folds"] == [5, 5]
    assert all(v is not None for v in scores["constant"]["pooled_over_rows"]["seeds"])
    assert scores["first_prompt_only"]["per_fold"]["mean"] is not None


def _tuned(frame: pd.DataFrame, tmp_path: Path, trials: int) -> optuna.Study:
    """The tuning recipe (`train`): a study whose best trial is scored on the folds it was picked on."""
    folded = assign_folds(frame, 5, 13)
    return tuning.run_study(folded, SPACE, study_name="s", storage=f"sqlite:///{tmp_path / 'o.db'}", seed=42,
                            n_trials=trials, resume=False, on_trial=lambda _: None)


@pytest.mark.integration
def test_nested_removes_the_selection_bias_of_the_best_trial_on_noise(tmp_path: Path) -> None:
    """Pure-noise target: the best of 40 trials scores clearly above 0 on its own folds; nested ~ 0."""
    best, honest = [], []
    for seed in range(4):
        frame = synthetic(seed, 100, signal=False)
        best.append(float(_tuned(frame, tmp_path, trials=40).best_value))
        scores = nested.nested_scores(frame, "unseen_task", [1, 2, 3], SETTINGS, FoldFeaturizer(frame, [1]),
                                      with_baselines=False)
        honest.append(scores["b"]["model"]["per_fold"]["mean"])
    assert np.mean(best) > 0.15, best  # selection bias: nothing to learn, yet a "skill"
    assert abs(np.mean(honest)) < 0.1, honest  # over 4 data sets x 3 fold seeds
    assert np.mean(best) - np.mean(honest) > 0.1


def test_nested_matches_true_out_of_sample_with_real_signal(tmp_path: Path) -> None:
    """With signal: nested ~ what the recipe (tune on all folds, fit on all rows) scores on fresh data."""
    frame = synthetic(5, 120, signal=True)
    scores = nested.nested_scores(frame, "unseen_task", [1, 2, 3], SETTINGS, FoldFeaturizer(frame, [1]),
                                  with_baselines=False)["b"]["model"]["per_fold"]
    model = build_model(tuning.best_params(_tuned(frame, tmp_path, trials=20), SPACE))
    model.fit(frame, frame["peak_prompt_tokens"].to_numpy())
    fresh = synthetic(99, 1000, signal=True)
    true_rho = spearman(np.asarray(model.predict(fresh)), fresh["peak_prompt_tokens"].to_numpy(dtype=float))
    assert true_rho is not None and true_rho > 0.3
    assert scores["mean"] is not None and abs(scores["mean"] - true_rho) < 0.1, (scores, true_rho)


def test_the_headline_is_the_shipped_models_numbers_by_benchmark_name_and_numbers_only() -> None:
    per_fold = {"per_fold": {"mean": 0.4, "sd": 0.05}}
    result = {
        "notes": {"own_model / pooled_model": "text"},
        "unseen_task": {
            "swebench-verified": {"protocol": "unseen-task ...", "own_model": per_fold,
                                  "pooled_model": {"per_fold": {"mean": 0.3}},
                                  "own_model_reservations": {"model": {"0.9": {"coverage": {"mean": 0.89}}}}},
            "my-bench": {"pooled_model": {"per_fold": {"mean": None}},
                         "pooled_model_reservations": {"model": {"0.9": {"coverage": {"mean": 0.91}}}}},
        },
        "seen_task": {"swebench-verified": {"own_model": {"per_fold": {"mean": 0.6}}}},
    }
    assert nested.headline(result) == {"spearman_unseen": {"swebench-verified": 0.4},
                                       "spearman_seen": {"swebench-verified": 0.6},
                                       "cover90": {"swebench-verified": 0.89, "my-bench": 0.91}}


def test_out_of_fold_predictions_come_from_models_that_never_saw_the_task_and_are_written_per_session(
        tmp_path: Path) -> None:
    frame = synthetic(3, 60, signal=True, runs_per_task=3)
    frame["session_id"] = [f"s{i}" for i in range(len(frame))]
    featurizer = Recording(frame)
    kept: list[np.ndarray] = []
    nested.nested_scores(frame, "unseen_task", [7], nested.Settings(5, 3, 2, SPACE), featurizer,
                         with_baselines=False, predictions=kept)
    assert len(kept) == 1 and np.isfinite(kept[0]).all()
    tasks = frame["task_id"].to_numpy()
    for train, test in featurizer.calls:  # every fit, inner or outer, predicts only tasks it did not train on
        assert not set(tasks[train]) & set(tasks[test])
    params = NestedParams(seeds=(7,), outer_folds=5, inner_folds=3, trials=2, seen_task=False)
    out = tmp_path / "oof.parquet"
    nested.write_out_of_fold(out, frame, {"pooled": pd.Series(kept[0], index=frame["session_id"])}, params)
    table = pd.read_parquet(out)
    assert list(table["session_id"]) == list(frame["session_id"])
    assert np.allclose(table["pooled_predicted"], kept[0]) and table["own_predicted"].isna().all()
    assert np.array_equal(table["outer_fold"], nested.assign(frame, np.arange(len(frame)), 5, 7, "unseen_task"))
    assert (table["seed"] == 7).all()


def test_the_mlflow_run_holds_each_models_per_fold_spearman_and_the_headline() -> None:
    # Issue 45: the nested stage, the honest estimate, was not logged to MLflow at all.
    result = {
        "unseen_task": {"terminal-bench": {"own_model": {"per_fold": {"mean": 0.02, "sd": 0.11}},
                                           "task_chars_only": {"per_fold": {"mean": 0.145, "sd": 0.1}},
                                           "constant": {"per_fold": {"mean": None, "sd": None}}}},
        "seen_task": {},
    }
    metrics = nested.run_metrics(result)
    assert flat(metrics) == {"headline/spearman_unseen/terminal-bench": 0.02,
                             "unseen_task/terminal-bench/own_model/mean": 0.02,
                             "unseen_task/terminal-bench/own_model/sd": 0.11,
                             "unseen_task/terminal-bench/task_chars_only/mean": 0.145,
                             "unseen_task/terminal-bench/task_chars_only/sd": 0.1}

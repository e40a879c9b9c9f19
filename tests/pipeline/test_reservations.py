"""Reservation multipliers (`basin_pipeline.reservations`, nested's `*_reservations`): arithmetic and honesty."""

from __future__ import annotations

import numpy as np
import optuna
import pandas as pd
import pytest

from basin_pipeline import nested, reservations
from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.features import ModelParams, build_model
from basin_pipeline.params import NestedParams
from basin_pipeline.trained import TrainedModel, TrainedModels
from tests.pipeline.test_nested import SPACE, Recording, synthetic

QS = ("0.8", "0.9", "0.95")


@pytest.fixture(autouse=True)
def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_hand_made_ratios_give_known_multipliers_coverage_and_reserved_over_used() -> None:
    true_train = np.arange(1, 11) * 100.0  # predicted 100 everywhere: ratios 1, 2, ..., 10
    scores = reservations.fold_scores(true_train, np.full(10, 100.0), np.array([50.0, 150.0, 950.0, 1000.0]),
                                      np.array([100.0, 100.0, 100.0, 0.0]))
    assert scores["multiplier"] == {"0.8": 8.0, "0.9": 9.0, "0.95": 10.0}
    # reserves at 0.9: 900, 900, 900 and 9 x 1 (a prediction of 0 is floored at one token)
    assert scores["model"]["0.9"] == {"coverage": 0.5, "reserved_over_used": pytest.approx(2709.0 / 2150.0)}
    # at 0.95 (m = 10) the 950-token row fits a 1000-token reserve too
    assert scores["model"]["0.95"] == {"coverage": 0.75, "reserved_over_used": pytest.approx(3010.0 / 2150.0)}
    # constant: the 0.9-quantile of the training peaks (900) for every row
    assert scores["constant"]["0.9"] == {"coverage": 0.5, "reserved_over_used": pytest.approx(3600.0 / 2150.0)}
    assert scores["constant"]["0.95"] == {"coverage": 1.0, "reserved_over_used": pytest.approx(4000.0 / 2150.0)}
    assert scores["oracle"] == {"coverage": 1.0, "reserved_over_used": 1.0}
    # the inverted-CDF quantile covers at least q of the rows it was fitted on
    assert reservations.cover(true_train, 9.0 * np.full(10, 100.0))["coverage"] == 0.9
    folds = reservations.aggregate([scores, {**scores, "multiplier": {"0.8": 6.0, "0.9": 7.0, "0.95": 8.0}}])
    assert folds["folds"] == 2
    assert folds["multiplier"]["0.9"] == {"mean": 8.0, "sd": pytest.approx(np.sqrt(2.0)), "min": 7.0}


def test_outer_test_rows_never_enter_the_multiplier_fit() -> None:
    frame = synthetic(3, 60, signal=True)
    settings = nested.Settings(outer_folds=5, inner_folds=3, trials=2, search=SPACE)
    labels = nested.assign(frame, np.arange(len(frame)), settings.outer_folds, 7, "unseen_task")
    featurizer = Recording(frame)
    reserved: list[dict[str, dict[str, object]]] = []
    predict = nested.model_predictor(frame, featurizer, labels, "unseen_task", settings, 7, [], reserved)
    outer_test = np.flatnonzero(labels == 2)
    outer_train = np.flatnonzero(labels != 2)
    predict(outer_train, outer_test, 2)
    *_, refit = featurizer.calls[: settings.trials * settings.inner_folds + 1]
    fit_calls = featurizer.calls[settings.trials * settings.inner_folds + 1:]
    assert set(refit[1]) == set(outer_test)
    assert len(fit_calls) == settings.inner_folds  # the multiplier's inner out-of-fold predictions
    assert set(np.concatenate([test for _, test in fit_calls])) == set(outer_train)
    for train, test in fit_calls:
        assert not set(train) & set(outer_test) and not set(test) & set(outer_test)
        assert not set(train) & set(test)
    # the outer-test peaks can be anything: the fitted multipliers stay the same, only coverage moves
    moved = frame.copy()
    moved.loc[outer_test, "peak_prompt_tokens"] *= 50
    again: list[dict[str, dict[str, object]]] = []
    nested.model_predictor(moved, Recording(moved), labels, "unseen_task", settings, 7, [], again)(
        outer_train, outer_test, 2)
    assert again[0]["b"]["multiplier"] == reserved[0]["b"]["multiplier"]
    assert again[0]["b"]["model"] != reserved[0]["b"]["model"]


def test_out_of_fold_multipliers_cover_new_data_and_in_sample_ones_do_not() -> None:
    """A memorising model: in-sample ratios sit near 1, so their multipliers under-cover fresh data."""
    frame = synthetic(5, 150, signal=True)
    fresh = synthetic(99, 2000, signal=True)
    true, fresh_true = frame["peak_prompt_tokens"].to_numpy(), fresh["peak_prompt_tokens"].to_numpy()
    params = ModelParams(alpha=0.05)
    model = build_model(params).fit(frame, true)
    fresh_predicted = np.asarray(model.predict(fresh))
    in_sample = reservations.multipliers(true, np.asarray(model.predict(frame)))
    folds = nested.assign(frame, np.arange(len(frame)), 5, 1, "unseen_task")
    honest = reservations.multipliers(true, FoldFeaturizer(frame, [1]).out_of_fold(params, folds))
    for q in QS:
        in_cover = reservations.cover(fresh_true, in_sample[q] * fresh_predicted)["coverage"]
        honest_cover = reservations.cover(fresh_true, honest[q] * fresh_predicted)["coverage"]
        assert in_cover < float(q) - 0.2, (q, in_cover)
        assert abs(honest_cover - float(q)) < 0.05, (q, honest_cover)


def test_nested_outer_fold_coverage_is_close_to_q() -> None:
    """Over 2 data sets x 3 fold seeds x 5 outer folds, the honest coverage lands within 0.05 of q."""
    settings = nested.Settings(outer_folds=5, inner_folds=3, trials=4, search=SPACE)
    coverage: dict[str, list[float]] = {q: [] for q in QS}
    for seed in (5, 6):
        frame = synthetic(seed, 150, signal=True)
        scores = nested.nested_scores(frame, "unseen_task", [1, 2, 3], settings, FoldFeaturizer(frame, [1]),
                                      with_baselines=False, with_reservations=True)["b"]["reservations"]
        assert scores["folds"] == 15
        assert scores["oracle"]["coverage"]["mean"] == 1.0 and scores["oracle"]["reserved_over_used"]["mean"] == 1.0
        for q in QS:
            coverage[q].append(scores["model"][q]["coverage"]["mean"])
            assert scores["constant"][q]["coverage"]["mean"] is not None
    for q in QS:
        assert abs(np.mean(coverage[q]) - float(q)) < 0.05, (q, coverage[q])


def test_shipping_multipliers_are_each_files_own_out_of_fold_ratios_per_benchmark() -> None:
    """The pooled file carries a row per benchmark and one over all rows, from the pooled model's out-of-fold
    predictions; a benchmark's own file carries its own model's; all on the shipped grid, non-decreasing."""
    own = synthetic(1, 60, signal=True).assign(fold_unseen=lambda f: np.arange(len(f)) % 5)
    other = synthetic(2, 30, signal=True).assign(benchmark="c", fold_unseen=lambda f: np.arange(len(f)) % 5)
    frame = pd.concat([own, other], ignore_index=True)
    chosen = TrainedModels({"pooled": _trained(ModelParams(alpha=3.0)), "b": _trained(ModelParams(alpha=0.1))})
    got = reservations.shipping_multipliers(frame, chosen)
    grid = reservations.SHIPPED_QUANTILES
    b_oof = FoldFeaturizer(own, [1]).out_of_fold(ModelParams(alpha=0.1), own["fold_unseen"].to_numpy())
    pooled_oof = FoldFeaturizer(frame, [1]).out_of_fold(ModelParams(alpha=3.0), frame["fold_unseen"].to_numpy())
    true = frame["peak_prompt_tokens"].to_numpy()

    def row(t: np.ndarray, p: np.ndarray) -> list[float]:
        m = reservations.multipliers(t, p, grid)
        return [round(m[str(q)], 6) for q in grid]

    assert got["b"] == {"quantiles": list(grid), "all": row(true[:60], b_oof),
                        "by_benchmark": {"b": row(true[:60], b_oof)}}
    assert got["pooled"]["by_benchmark"] == {"b": row(true[:60], pooled_oof[:60]), "c": row(true[60:], pooled_oof[60:])}
    assert got["pooled"]["all"] == row(true, pooled_oof)
    for table in got.values():
        for values in [table["all"], *table["by_benchmark"].values()]:
            assert values == sorted(values) and values[0] > 0


def test_report_carries_reservations_per_benchmark_beside_the_protocol() -> None:
    """unseen-task only: own model for `b`; `c` (too few tasks for its own model) gets the pooled model's."""
    own = synthetic(1, 60, signal=True, runs_per_task=2).assign(fold_unseen=lambda f: np.arange(len(f)) % 5)
    small = synthetic(2, 12, signal=True).assign(benchmark="c", fold_unseen=lambda f: np.arange(len(f)) % 3)
    frame = pd.concat([own, small], ignore_index=True)
    result = nested.report(frame, NestedParams(seeds=(1,), outer_folds=3, inner_folds=2, trials=1, seen_task=True),
                           SPACE)
    b, c = result["unseen_task"]["b"], result["unseen_task"]["c"]
    assert b["protocol"].startswith("unseen-task") and c["protocol"].startswith("unseen-task")
    assert b["own_model_reservations"]["folds"] == 3 and "own_model_reservations" not in c
    assert b["own_model_reservations"]["protocol"].startswith("unseen-task")
    assert set(b["pooled_model_reservations"]["model"]) == set(QS) == set(c["pooled_model_reservations"]["model"])
    assert any("reservations" in k for k in result["notes"])
    assert "own_model" in result["seen_task"]["b"]
    assert not any("reservations" in k for k in result["seen_task"]["b"])


def _trained(params: ModelParams) -> TrainedModel:
    """A best.json record of which shipping_multipliers reads only the knobs."""
    return TrainedModel(params=params, cv_objective=0.0, cv_spearman={}, best_trial=0, rows=0, benchmarks=())

"""Reservations that follow the session in the simulator (issue 49 part 1, basin_sim/experiments/revisions.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from basin_runtime.online import SLOTS, OnlineModel
from basin_runtime.policy.calibrated import Calibration
from basin_sim.experiments.ablations import ablation
from basin_sim.experiments.predictions import PredictionsError
from basin_sim.experiments.revisions import load_online_table, model_slots, revisions_for
from basin_sim.experiments.run_setup import Inputs, reserving_for
from basin_sim.policies import BasinPolicy, PolicyContext, make_policy
from tests.sim.builders import deployment, session

IN_SAMPLE = 111.0  # what the (fake) shipped online model says of every session


class FakeOnline:
    slots = (2, 3)

    def predict_batch(self, first_calls: Sequence[float], prompts: Sequence[Sequence[int]],
                      completions: Sequence[Sequence[int]]) -> np.ndarray:
        return np.full(len(first_calls), IN_SAMPLE)

    def multiplier(self, q: float, k: int) -> float:
        return 1.5 if k == 2 else 1.25


class FakePredictor:
    online = FakeOnline()

    def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> Sequence[float]:
        return [1_000.0] * len(task_texts)

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        return 1.0


POOL = [session("a", [100, 200, 300, 400]), session("b", [100, 200, 300]), session("c", [100])]
TABLE = {"a": {2: 5_000.0, 3: 7_000.0}}  # out of fold; b is not in the training table


def test_out_of_fold_revisions_come_from_the_table_not_the_in_sample_model() -> None:
    peaks = {s.session_id: 1_000.0 for s in POOL}
    got = revisions_for(FakePredictor(), POOL, peaks, 0.9, (2, 3), "out-of-fold", table=TABLE)  # type: ignore[arg-type]
    assert got["a"] == {2: (5_000.0, 1.5), 3: (7_000.0, 1.25)}
    assert got["b"] == {2: (IN_SAMPLE, 1.5), 3: (IN_SAMPLE, 1.25)}  # not in the table: the shipped model
    assert got["c"] == {}
    scaled = revisions_for(FakePredictor(), POOL, peaks, None, (3,), "out-of-fold", token_scale=2.0,  # type: ignore[arg-type]
                           table=TABLE)
    assert scaled["a"] == {3: (14_000.0, 1.0)}
    in_sample = revisions_for(FakePredictor(), POOL, peaks, 0.9, (2,), "in-sample")  # type: ignore[arg-type]
    assert in_sample["a"] == {2: (IN_SAMPLE, 1.5)}


def test_no_table_means_no_revisions_never_the_in_sample_model(tmp_path: Path) -> None:
    peaks = {s.session_id: 1_000.0 for s in POOL}
    assert revisions_for(FakePredictor(), POOL, peaks, 0.9, (2, 3), "out-of-fold",  # type: ignore[arg-type]
                         tmp_path / "absent.parquet") == {}
    path = tmp_path / "oof.parquet"
    pq.write_table(pa.table({"session_id": ["a", "a"], "benchmark": ["x", "x"], "k": [2, 3],
                             "online_predicted": [5_000.0, 7_000.0], "fold": [0, 0]}), path)
    assert load_online_table(path) == TABLE
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"session_id": ["a"], "pooled_predicted": [1.0]}), bad)
    with pytest.raises(PredictionsError, match=r"(?s)bad\.parquet.*--no-revisions"):
        load_online_table(bad)
    inputs = Inputs(predictions="in-sample", online_out_of_fold=path)
    told = reserving_for(FakePredictor(), POOL, 1.0, inputs, 0.9, inputs.revise_at(FakePredictor()))  # type: ignore[arg-type]
    assert told.revisions["a"][2] == (IN_SAMPLE, 1.5)
    inputs = Inputs(predictions="out-of-fold", online_out_of_fold=path)
    assert revisions_for(FakePredictor(), POOL, peaks, 0.9, inputs.revise_at(FakePredictor()),  # type: ignore[arg-type]
                         inputs.predictions, inputs.online_out_of_fold)["a"] == {2: (5_000.0, 1.5), 3: (7_000.0, 1.25)}


def test_basin_revises_at_the_online_models_slots_by_default_and_the_switch_turns_them_off() -> None:
    predictor = FakePredictor()
    assert Inputs().revise_at(predictor) == (2, 3) == model_slots(predictor)
    assert Inputs(revise_at_calls=(3,)).revise_at(predictor) == (3,)
    assert Inputs(no_revisions=True).revise_at(predictor) == ()
    assert Inputs().revise_at(object()) == ()  # no online model: no revisions
    off, basin = ablation("basin:no-revisions"), ablation("basin")
    assert not off.revisions and basin.revisions
    assert (off.reservation, off.overrides, off.task_memory, off.quantile) == (
        basin.reservation, basin.overrides, basin.task_memory, basin.quantile)


def test_the_shipped_online_file_names_its_slots() -> None:
    path = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.online.onnx"
    assert OnlineModel.load(path).slots == SLOTS


def revising_basin() -> BasinPolicy:
    """Basin told peaks of 1,000 for the pool and the table's out-of-fold re-estimates at calls 2 and 3."""
    peaks = {s.session_id: 1_000.0 for s in POOL}
    revisions = revisions_for(FakePredictor(), POOL, peaks, 0.9, (2, 3), "out-of-fold", table=TABLE)  # type: ignore[arg-type]
    context = PolicyContext(deployment(cache_tokens=100_000), peaks,
                            calibration=Calibration(50_000.0 / 0.9, 100_000.0), revisions=revisions)
    sim = make_policy("basin", context)
    assert isinstance(sim, BasinPolicy)
    return sim


def test_the_core_revises_at_each_slot_from_the_tables_re_estimate() -> None:
    """Session a reserves m x 1000 at arrival; at call 2 the core reserves ceil(1.5 x 5000), at call 3
    ceil(1.25 x 7000), at call 4 (no slot) nothing changes."""
    sim = revising_basin()
    sim.on_arrival("a", 0.0, POOL[0])
    assert sim.core.reservation_of("a") == 1_000
    sim.on_call("a", 1.0, 100)
    assert sim.core.reservation_of("a") == 1_000
    sim.on_call("a", 2.0, 200)
    assert sim.core.reservation_of("a") == math.ceil(1.5 * 5_000)
    sim.on_call("a", 3.0, 300)
    assert sim.core.reservation_of("a") == math.ceil(1.25 * 7_000)
    sim.on_call("a", 4.0, 400)
    assert sim.core.reservation_of("a") == math.ceil(1.25 * 7_000)
    assert (report := sim.report().reservations) is not None and report.revisions == 2


def test_an_arrival_drawn_from_a_pool_session_is_revised_by_that_sessions_re_estimates() -> None:
    """The engine names each arrival anew (sessions are drawn with replacement); its revisions are its pool
    session's, as its first-call peak is."""
    sim = revising_basin()
    for t, arrival in ((0.0, "a/1"), (10.0, "a/2")):
        sim.on_arrival(arrival, t, POOL[0])
        sim.on_call(arrival, t + 1, 100)
        sim.on_call(arrival, t + 2, 200)
        assert sim.core.reservation_of(arrival) == math.ceil(1.5 * 5_000)
    assert (report := sim.report().reservations) is not None and report.revisions == 2

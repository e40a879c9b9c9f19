"""The online re-estimate through the runtime: the shipped files, the history rules, the pairing check."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from basin_runtime.online import FEATURES, SLOTS, OnlineError, OnlineModel, features, online_file_name, slot_index
from basin_runtime.predictor import PeakPredictor, PredictorError

MODELS = Path(__file__).resolve().parents[2] / "models"
NAMES = ("peak_predictor", "peak_predictor-swebench-verified", "peak_predictor-tau-bench-airline",
         "peak_predictor-terminal-bench")


@pytest.mark.parametrize("name", NAMES)
def test_every_shipped_first_call_model_has_its_online_model_and_k_1_is_the_first_call(name: str) -> None:
    predictor = PeakPredictor.load(MODELS / f"{name}.onnx")
    assert predictor.online is not None and predictor.online.path == MODELS / f"{name}.online.onnx"
    text = "Fix the failing test in the parser and add a regression test"
    assert predictor.predict_online(text, 1500, [1500], []) == predictor.predict(text, 1500)
    growing = predictor.predict_online(text, 1500, [1500, 4000, 9000], [80, 120])
    assert growing >= 9000 and math.isfinite(growing)  # never below the context seen
    for k in (2, 3, 5, 10, 40):
        assert predictor.online_multiplier(0.9, k) > 0
    assert predictor.online_multiplier(0.9, 1) == predictor.multiplier(0.9)


def test_the_online_graph_computes_the_ridge_of_the_features_per_slot() -> None:
    """exp(features . W[slot] + b[slot]) - 1, read back from the shipped file's initializers."""
    path = MODELS / "peak_predictor-terminal-bench.online.onnx"
    proto = onnx.load(path)
    init = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    weights, intercepts = init["W"].astype(np.float64), init["b"].astype(np.float64)
    assert weights.shape == (len(SLOTS), len(FEATURES))
    model = OnlineModel.load(path)
    for prompts, completions in (([900, 1200], [50]), ([900, 1200, 5000], [50, 60]), ([900] * 12, [10] * 11)):
        x = np.asarray(features(2500.0, prompts, completions))
        slot = slot_index(len(prompts))
        expected = max(math.expm1(float(x @ weights[slot] + intercepts[slot])), prompts[-1])
        assert model.predict(2500.0, prompts, completions) == pytest.approx(expected, rel=1e-4)
    assert [slot_index(k) for k in (2, 3, 4, 5, 6, 7, 9, 10, 50)] == [0, 1, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize(("prompts", "completions", "match"), [
    ([], [], "prompt sizes of calls 1..k"),
    ([100, 200], [], "k - 1 = 1 completions"),
    ([100, 200], [5, 6], "k - 1 = 1 completions"),
    ([100, -2], [5], "prompt_tokens must be finite and >= 0"),
    ([100, 200], [math.nan], "completion_tokens must be finite"),
])
def test_a_malformed_history_is_refused_naming_what(prompts: list[int], completions: list[int], match: str) -> None:
    predictor = PeakPredictor.load(MODELS / "peak_predictor.onnx")
    with pytest.raises(PredictorError, match=match):
        predictor.predict_online("task", 100, prompts, completions)


def _copy_pair(tmp: Path, name: str) -> tuple[Path, Path]:
    first, online = tmp / f"{name}.onnx", tmp / f"{name}.online.onnx"
    shutil.copyfile(MODELS / f"{name}.onnx", first)
    shutil.copyfile(MODELS / f"{name}.online.onnx", online)
    return first, online


def test_an_online_file_of_another_first_call_model_is_refused_and_none_means_no_revision(tmp_path: Path) -> None:
    first, online = _copy_pair(tmp_path, "peak_predictor")
    shutil.copyfile(MODELS / "peak_predictor-terminal-bench.online.onnx", online)  # paired with another model
    with pytest.raises(PredictorError, match=r"peak_predictor\.online\.onnx: trained with another first-call model"):
        PeakPredictor.load(first)
    online.unlink()
    alone = PeakPredictor.load(first)
    assert alone.online is None and online_file_name(first) == online
    assert alone.predict_online("task", 100, [100], []) == alone.predict("task", 100)
    with pytest.raises(PredictorError, match=r"no online model beside it \(peak_predictor\.online\.onnx\)"):
        alone.predict_online("task", 100, [100, 200], [10])


def test_a_broken_online_file_is_refused_at_load(tmp_path: Path) -> None:
    first, online = _copy_pair(tmp_path, "peak_predictor")
    proto = onnx.load(online)
    for entry in proto.metadata_props:
        if entry.key == "basin.online_multipliers":
            entry.value = json.dumps({"quantiles": [0.9], "by_slot": {"2": [1.0]}})
    onnx.save(proto, online)
    with pytest.raises(PredictorError, match="a row per slot"):
        PeakPredictor.load(first)
    online.write_bytes(b"junk")
    with pytest.raises(PredictorError, match="not a loadable ONNX model"):
        PeakPredictor.load(first)
    with pytest.raises(OnlineError, match="serves calls k >= 2"):
        slot_index(1)

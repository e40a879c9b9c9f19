from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from basin_runtime.online import clamp_peak
from basin_runtime.predictor import MAX_PEAK_TOKENS, PeakPredictor, PredictorError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "peak_predictor.onnx"


def _rewrite(tmp: Path, change_key: str, value: str | None) -> Path:
    """The shipped pooled model with one metadata entry set (added if absent), or removed (None)."""
    proto = onnx.load(SHIPPED)
    kept = [(e.key, e.value) for e in proto.metadata_props if e.key != change_key]
    del proto.metadata_props[:]
    for key, old in kept + ([] if value is None else [(change_key, value)]):
        proto.metadata_props.add(key=key, value=old)
    path = tmp / "changed.onnx"
    onnx.save(proto, path)
    return path


TABLE = {"quantiles": [0.5, 0.9, 0.95], "all": [1.0, 2.0, 3.0],
         "by_benchmark": {"swe": [1.1, 1.5, 2.5], "tb": [0.9, 4.0, 6.0]}}


def test_reservation_multipliers_interpolate_per_benchmark_and_fall_back_to_all_rows(tmp_path: Path) -> None:
    predictor = PeakPredictor.load(_rewrite(tmp_path, "basin.reservation_multipliers", json.dumps(TABLE)))
    assert predictor.multiplier(0.9, "swe") == 1.5 and predictor.multiplier(0.95, "tb") == 6.0
    assert predictor.multiplier(0.7, "swe") == pytest.approx(1.3)  # halfway from 0.5 (1.1) to 0.9 (1.5)
    assert predictor.multiplier(0.9) == 2.0 and predictor.multiplier(0.9, "unknown-bench") == 2.0
    for q in (0.49, 0.96, float("nan")):
        with pytest.raises(PredictorError, match=r"quantile .* outside the multipliers' grid \[0.5, 0.95\]"):
            predictor.multiplier(q)
    one = {**TABLE, "by_benchmark": {"swe": [1.1, 1.5, 2.5]}}  # a single-benchmark file answers for it
    assert PeakPredictor.load(_rewrite(tmp_path, "basin.reservation_multipliers", json.dumps(one))).multiplier(0.9) \
        == 1.5


def test_a_file_without_multipliers_loads_but_refuses_to_make_them_up(tmp_path: Path) -> None:
    predictor = PeakPredictor.load(_rewrite(tmp_path, "basin.reservation_multipliers", None))
    assert predictor.info.reservation_multipliers is None
    with pytest.raises(PredictorError, match=r"carries no reservation multipliers .*re-export"):
        predictor.multiplier(0.9)


@pytest.mark.parametrize("table", [
    "not json", json.dumps({"quantiles": [0.9, 0.5], "all": [1, 2], "by_benchmark": {}}),
    json.dumps({**TABLE, "all": [1.0, 2.0]}), json.dumps({**TABLE, "all": [3.0, 2.0, 1.0]}),
    json.dumps({**TABLE, "quantiles": [0.5, 0.9, 1.0]}), json.dumps({"quantiles": [0.5]}),
])
def test_a_malformed_multipliers_table_is_refused_at_load(tmp_path: Path, table: str) -> None:
    with pytest.raises(PredictorError, match=r"changed\.onnx: basin\.reservation_multipliers"):
        PeakPredictor.load(_rewrite(tmp_path, "basin.reservation_multipliers", table))


def test_shipped_model_loads_and_predicts_sane_peaks() -> None:
    predictor = PeakPredictor.load(SHIPPED, expected_tokenizer="qwen3.6")
    assert predictor.info.model_name == "pooled" and predictor.info.synthetic is False
    assert predictor.info.benchmarks == ("swebench-verified", "tau-bench-airline", "terminal-bench")
    texts = ["", " ", "Fix the typo in README", "日本語 🙂", "x" * 100_000, "refactor " * 5000]
    firsts = [0, 10, 1500, 900, 30_000, 4000]
    peaks = predictor.predict_batch(texts, firsts)
    assert np.all(np.isfinite(peaks)) and np.all(peaks > 0)
    assert np.all(peaks >= np.maximum(firsts, 1)) and np.all(peaks <= MAX_PEAK_TOKENS)
    assert predictor.predict(texts[2], 1500) == pytest.approx(peaks[2])
    table = predictor.info.reservation_multipliers  # exported with the model: every benchmark, q 0.5..0.99
    assert table is not None and sorted(table["by_benchmark"]) == list(predictor.info.benchmarks)
    assert table["quantiles"][0] == 0.5 and table["quantiles"][-1] == 0.99
    for bench in predictor.info.benchmarks:
        assert 1.0 < predictor.multiplier(0.9, bench) < predictor.multiplier(0.95, bench)


def test_refuses_incompatible_files_with_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PredictorError, match="no such predictor file"):
        PeakPredictor.load(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(PredictorError, match=r"junk\.onnx: not a loadable ONNX model"):
        PeakPredictor.load(tmp_path / "junk.onnx")
    with pytest.raises(PredictorError, match=r"schema version '99'; this runtime reads '1'"):
        PeakPredictor.load(_rewrite(tmp_path, "basin.schema_version", "99"))
    with pytest.raises(PredictorError, match=r"trained on 'qwen3\.6' token counts, but this gateway counts with 'gpt'"):
        PeakPredictor.load(SHIPPED, expected_tokenizer="gpt")


def test_refuses_a_model_with_other_inputs(tmp_path: Path) -> None:
    proto = onnx.load(SHIPPED)
    proto.graph.input[1].name = "renamed"
    for node in proto.graph.node:
        node.input[:] = ["renamed" if i == "task_chars" else i for i in node.input]
    onnx.save(proto, tmp_path / "renamed.onnx")
    with pytest.raises(PredictorError, match=r"inputs .* do not match the expected"):
        PeakPredictor.load(tmp_path / "renamed.onnx")


def test_loading_and_predicting_never_import_the_training_stack() -> None:
    code = (
        "import json, sys\n"
        "from basin_runtime.predictor import PeakPredictor\n"
        f"p = PeakPredictor.load({str(SHIPPED)!r})\n"
        "p.predict('fix the bug', 1200)\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = set(json.loads(out))
    assert "onnxruntime" in loaded
    assert loaded.isdisjoint({"sklearn", "pandas", "optuna", "mlflow", "skl2onnx", "scipy"})


def test_one_row_predictions_equal_the_batch_path_exactly() -> None:
    """`predict` (the gateway's first call) and `OnlineModel.predict` (its revisions) skip the batch path's array
    work; their answers must be the batch path's, bit for bit, clamps included."""
    predictor = PeakPredictor.load(SHIPPED)
    texts = ["", "Fix the typo in README", "日本語 🙂", "refactor " * 3000]
    for text in texts:
        for first in (0, 1, 1500, 10**7, 2 * 10**7, 1.5):
            assert predictor.predict(text, first) == float(predictor.predict_batch([text], [first])[0])
    with pytest.raises(ValueError, match="finite and non-negative"):
        predictor.predict("task", -1)
    online = predictor.online
    assert online is not None
    for first_call in (0.0, 1.0, 2500.0, 3e7):
        for prompts, completions in (([900, 1200], [50]), ([0, 0, 0], [0, 0]), ([900] * 12, [10] * 11),
                                     ([10, 2 * 10**7], [5])):
            assert online.predict(first_call, prompts, completions) == float(
                online.predict_batch([first_call], [prompts], [completions])[0])


@pytest.mark.parametrize("raw", [math.nan, math.inf, -math.inf, -5.0, 0.0, 0.5, 7.0, 1e9, MAX_PEAK_TOKENS * 2])
@pytest.mark.parametrize("floor", [0.0, 3.0, 100.0, MAX_PEAK_TOKENS * 3])
def test_clamp_peak_is_the_batch_paths_where_and_clip(raw: float, floor: float) -> None:
    batch = np.clip(np.where(np.isfinite([raw]), [raw], MAX_PEAK_TOKENS), np.maximum([floor], 1.0), MAX_PEAK_TOKENS)
    assert clamp_peak(raw, floor) == float(batch[0])

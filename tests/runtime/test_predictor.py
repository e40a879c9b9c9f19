from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from basin_runtime.predictor import MAX_PEAK_TOKENS, PeakPredictor, PredictorError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "models" / "peak_predictor.onnx"


def _rewrite(tmp: Path, change_key: str, value: str) -> Path:
    proto = onnx.load(SHIPPED)
    for entry in proto.metadata_props:
        if entry.key == change_key:
            entry.value = value
    path = tmp / "changed.onnx"
    onnx.save(proto, path)
    return path


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

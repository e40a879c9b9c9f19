"""Export publishes to models/ only a model that changed: a re-run on unchanged data leaves git clean.

Rules:
- The shipped tau-bench model is "published"; the "new" file is the same graph with other bytes
  (its metadata metrics changed, as floating-point noise between machines changes them), or with other
  params in its metadata, or another model's graph under the same metadata (predictions far apart).
- The parity rows are the model's own training-like sessions (a small frame with the columns export reads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pandas as pd
import pytest

from basin_pipeline.export import parity_set, publish_models, published_difference
from basin_pipeline.onnx_export import serialize, set_metadata

ROOT = Path(__file__).resolve().parents[2]
TAU = ROOT / "models" / "peak_predictor-tau-bench-airline.onnx"
TERMINAL = ROOT / "models" / "peak_predictor-terminal-bench.onnx"
FRAME = pd.DataFrame({"benchmark": ["tau-bench-airline"] * 4,
                      "task_text": ["book a flight to Paris", "cancel my reservation", "change seat 12A", "refund"],
                      "first_prompt_tokens": [3900, 3910, 3920, 3930]})


def _variant(source: Path, target: Path, like: Path | None = None, **changes: str) -> Path:
    """`source`'s graph with the metadata of `like` (default: its own), with some keys changed."""
    proto = onnx.load(source)
    metadata = {p.key: p.value for p in onnx.load(like or source).metadata_props} | changes
    set_metadata(proto, metadata)
    target.write_bytes(serialize(proto))
    return target


def _published(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(TAU, folder / TAU.name)
    return folder


def test_a_model_whose_predictions_match_within_the_tolerance_is_kept_byte_for_byte(tmp_path: Path) -> None:
    folder = _published(tmp_path)
    new = _variant(TAU, tmp_path / TAU.name, **{"basin.metrics": json.dumps({"cv_objective": 0.123456})})
    assert new.read_bytes() != TAU.read_bytes()
    assert published_difference(folder / TAU.name, new, parity_set(FRAME)) == 0.0
    publish_models({"tau-bench-airline": new}, folder, publish=True, synthetic=False, frame=FRAME, rtol=1e-4)
    assert (folder / TAU.name).read_bytes() == TAU.read_bytes()
    # the stage's own copy becomes the shipped bytes, so what the simulate stage runs (and names by its
    # SHA-256 in metrics/simulate.json) is the model that ships (issue 45)
    assert new.read_bytes() == TAU.read_bytes()


@pytest.mark.parametrize("change", ["params", "predictions", "missing"])
def test_a_changed_model_is_published(tmp_path: Path, change: str) -> None:
    folder = _published(tmp_path)
    if change == "params":
        new = _variant(TAU, tmp_path / TAU.name, **{"basin.params": json.dumps({"alpha": 1.0})})
    elif change == "predictions":  # another graph under tau's metadata: same data, params, benchmarks
        new = _variant(TERMINAL, tmp_path / TAU.name, like=TAU)
        difference = published_difference(folder / TAU.name, new, parity_set(FRAME))
        assert difference is not None and difference > 1e-4
    else:
        (folder / TAU.name).unlink()
        new = _variant(TAU, tmp_path / TAU.name, **{"basin.metrics": "{}"})
    publish_models({"tau-bench-airline": new}, folder, publish=True, synthetic=False, frame=FRAME, rtol=1e-4)
    assert (folder / TAU.name).read_bytes() == new.read_bytes()

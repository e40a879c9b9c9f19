"""best.json through `TrainedModels` and summary.json through `FrameSummary`: the committed files round-trip byte
for byte; a bad file is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from basin_pipeline.features import ModelParams
from basin_pipeline.featurize import FrameSummary
from basin_pipeline.trained import POOLED, TrainedModels, TrainedModelsError

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "data" / "train" / "best.json"


def test_the_committed_best_json_reads_and_writes_back_the_same_bytes(tmp_path: Path) -> None:
    if not COMMITTED.exists():
        pytest.skip("data/train/best.json is not checked out (dvc pull)")
    best = TrainedModels.read(COMMITTED)
    assert POOLED in best and isinstance(best[POOLED].params, ModelParams)
    assert best[POOLED].benchmarks == tuple(sorted(best[POOLED].cv_spearman))
    best.write(tmp_path / "best.json")
    assert (tmp_path / "best.json").read_bytes() == COMMITTED.read_bytes()


def test_a_benchmark_without_its_own_model_is_served_by_the_pooled_one(tmp_path: Path) -> None:
    path = _write(tmp_path, {"pooled": _record(alpha=2.0), "a": _record(alpha=0.5)})
    best = TrainedModels.read(path)
    assert best.serving("a").params.alpha == 0.5 and best.serving("b").params.alpha == 2.0
    assert list(best) == ["pooled", "a"]


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.pop("cv_objective"), r"models\.pooled: missing key 'cv_objective'"),
    (lambda r: r.update(rows="12"), r"models\.pooled\.rows: expected an integer, got '12'"),
    (lambda r: r["params"].update(colour=1), r"models\.pooled\.params: .*colour"),
    (lambda r: r["cv_spearman"].update(a="high"), r"models\.pooled\.cv_spearman\.a: expected a number"),
    (lambda r: r.update(benchmarks="a"), r"models\.pooled\.benchmarks: expected a list of names"),
])
def test_a_missing_or_malformed_key_names_the_file_and_the_key(tmp_path: Path, change: object, message: str) -> None:
    record = _record(alpha=1.0)
    change(record)  # type: ignore[operator]
    path = _write(tmp_path, {"pooled": record})
    with pytest.raises(TrainedModelsError, match=re.escape(f"{path}: ") + message):
        TrainedModels.read(path)


def test_a_file_without_models_names_it(tmp_path: Path) -> None:
    path = tmp_path / "best.json"
    path.write_text("{}")
    with pytest.raises(TrainedModelsError, match=re.escape(f"{path}: missing key 'models'")):
        TrainedModels.read(path)


def _record(alpha: float) -> dict[str, object]:
    return {"params": ModelParams(alpha=alpha).to_dict(), "cv_objective": 0.4, "cv_spearman": {"a": 0.4, "b": None},
            "best_trial": 3, "rows": 20, "benchmarks": ["a", "b"]}


def _write(folder: Path, models: dict[str, object]) -> Path:
    path = folder / "best.json"
    path.write_text(json.dumps({"models": models}))
    return path


def test_the_committed_frame_summary_reads_and_writes_back_the_same_bytes(tmp_path: Path) -> None:
    committed = ROOT / "data" / "features" / "summary.json"
    if not committed.exists():
        pytest.skip("data/features/summary.json is not checked out (dvc pull)")
    summary = FrameSummary.read(committed)
    assert summary.rows == sum(summary.benchmarks.values())
    summary.write(tmp_path / "summary.json")
    assert (tmp_path / "summary.json").read_bytes() == committed.read_bytes()
    (tmp_path / "bad.json").write_text(json.dumps({"rows": 1}))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'bad.json'}: missing key")):
        FrameSummary.read(tmp_path / "bad.json")

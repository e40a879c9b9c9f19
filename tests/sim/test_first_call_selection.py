"""The simulator's first call as train's selection shipped it (issue 49, part 5; basin_sim/experiments/served.py):
each benchmark's file beside the model file serves its sessions and m(q), and the out-of-fold peaks are the selected
procedure's; `--first-call pooled` is the model file alone and the pooled column, as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from basin_runtime.predictor import PeakPredictor
from basin_runtime.session_table import Session
from basin_sim.experiments.predictions import PredictionsError, peaks_tag, predict_pool
from basin_sim.experiments.run_setup import Inputs, reserving_for
from basin_sim.experiments.served import ServedByBenchmark, benchmark_files, load_served, served_tag
from tests.sim.builders import session

MODELS = Path(__file__).resolve().parents[2] / "models"
BENCH = "terminal-bench"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The pooled model file, one benchmark's file and its online model beside it."""
    for name in ("peak_predictor.onnx", f"peak_predictor-{BENCH}.onnx", f"peak_predictor-{BENCH}.online.onnx"):
        shutil.copy(MODELS / name, tmp_path / name)
    return tmp_path


def _pool() -> list[Session]:
    tb = session("tb", [3_000, 9_000], benchmark=BENCH)
    other = session("other", [3_000, 9_000], benchmark="elsewhere")
    return [tb, other]


def test_each_benchmarks_file_serves_its_sessions_and_their_multiplier(model_dir: Path) -> None:
    assert benchmark_files(model_dir / "peak_predictor.onnx") == {BENCH: model_dir / f"peak_predictor-{BENCH}.onnx"}
    served = load_served(model_dir / "peak_predictor.onnx", "selected")
    assert isinstance(served, ServedByBenchmark)
    own, pooled = PeakPredictor.load(model_dir / f"peak_predictor-{BENCH}.onnx"), \
        PeakPredictor.load(model_dir / "peak_predictor.onnx")
    assert served.multiplier(0.9, BENCH) == own.multiplier(0.9, BENCH) != pooled.multiplier(0.9, BENCH)
    assert served.multiplier(0.9, "elsewhere") == pooled.multiplier(0.9, "elsewhere")
    tb, other = _pool()
    peaks = predict_pool(served, [tb, other])
    assert peaks["tb"] == pytest.approx(own.predict(tb.task_text, tb.first_prompt_tokens))
    assert peaks["other"] == pytest.approx(pooled.predict(other.task_text, other.first_prompt_tokens))
    assert isinstance(load_served(model_dir / "peak_predictor.onnx", "pooled"), PeakPredictor)


def test_basin_is_told_the_selected_peaks_and_the_served_files_multipliers(model_dir: Path, tmp_path: Path) -> None:
    table = tmp_path / "oof.parquet"
    pq.write_table(pa.table({"session_id": ["tb", "other"], "pooled_predicted": [10_000.0, 11_000.0],
                             "selected_predicted": [20_000.0, 21_000.0]}), table)
    model = model_dir / "peak_predictor.onnx"
    selected, pooled = (Inputs(model=model, out_of_fold=table, first_call=c) for c in ("selected", "pooled"))
    told = reserving_for(load_served(model, "selected"), _pool(), 1.0, selected, 0.9)
    assert told.peaks == {"tb": 20_000.0, "other": 21_000.0}
    own = PeakPredictor.load(model_dir / f"peak_predictor-{BENCH}.onnx")
    assert told.multipliers["tb"] == own.multiplier(0.9, BENCH)
    before = reserving_for(load_served(model, "pooled"), _pool(), 1.0, pooled, 0.9)
    assert before.peaks == {"tb": 10_000.0, "other": 11_000.0}
    assert before.multipliers["tb"] == PeakPredictor.load(model).multiplier(0.9, BENCH)
    # the knee calibrations of the two are kept apart; the pooled one's key is the one it always was
    assert pooled.peaks_tag() == peaks_tag("out-of-fold", table) and served_tag(model, "pooled") == ""
    assert selected.peaks_tag() != pooled.peaks_tag() and BENCH in selected.peaks_tag()


def test_a_table_without_the_selected_column_names_the_fix(model_dir: Path, tmp_path: Path) -> None:
    table = tmp_path / "old.parquet"
    pq.write_table(pa.table({"session_id": ["tb"], "pooled_predicted": [10_000.0]}), table)
    model = model_dir / "peak_predictor.onnx"
    with pytest.raises(PredictionsError, match=r"selected_predicted.*--first-call pooled"):
        reserving_for(load_served(model, "selected"), _pool(), 1.0, Inputs(model=model, out_of_fold=table), 0.9)


def test_the_no_selection_ablation_is_told_the_pooled_files_peaks_in_its_own_calibration(tmp_path: Path) -> None:
    from basin_sim.experiments import compare
    from basin_sim.experiments.ablations import ABLATIONS, calibration_tag
    from tests.sim.test_compare import DEPLOYMENT, SCENARIO

    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    shutil.copy(MODELS / "peak_predictor.onnx", tmp_path / "peak_predictor.onnx")  # one synthetic benchmark's own
    shutil.copy(MODELS / f"peak_predictor-{BENCH}.onnx", tmp_path / "peak_predictor-synthetic-terminal.onnx")
    grid = compare.Grid((str(tmp_path / "s.yaml"),), (str(tmp_path / "d.yaml"),), ("none",),
                        ("basin", "basin:no-selection"))
    inputs = compare.Inputs(sessions=tmp_path / "absent.parquet", synthetic=True, overload_rate=0.1,
                            model=tmp_path / "peak_predictor.onnx", predictions="in-sample")
    cells, _, _ = compare._cells(compare.CompareSetup((grid,), seeds=(1,), inputs=inputs))
    (cell,) = cells.values()
    assert ABLATIONS["basin:no-selection"].reservation == "pooled-first-call"
    assert cell.unselected is not None and cell.reserved_as("pooled-first-call") == cell.unselected
    pooled = PeakPredictor.load(tmp_path / "peak_predictor.onnx")
    terminal = [s for s in cell.pool if s.benchmark == "synthetic-terminal"]
    others = [s for s in cell.pool if s.benchmark != "synthetic-terminal"]
    assert terminal and others
    for s in others:  # served by the model file either way
        assert cell.unselected.peaks[s.session_id] == cell.reserving.peaks[s.session_id]
    assert any(cell.unselected.peaks[s.session_id] != cell.reserving.peaks[s.session_id] for s in terminal)
    for s in terminal[:3]:
        assert cell.unselected.peaks[s.session_id] == pytest.approx(pooled.predict(s.task_text, s.first_prompt_tokens))
        assert cell.unselected.multipliers[s.session_id] == pooled.multiplier(0.9, "synthetic-terminal")
    assert cell.unselected_tag != cell.peaks_tag  # its knee is keyed apart from basin's
    sha = cell.predictor_sha256
    assert calibration_tag("pooled-first-call", sha, 0.9) != calibration_tag("predicted", sha, 0.9)

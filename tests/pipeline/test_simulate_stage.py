"""The simulate stage end to end on tiny scenarios and the shipped model: the headline row over seeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from basin_pipeline import simulate as stage
from basin_runtime.calibration import load_calibration

MODEL = Path("models/peak_predictor.onnx")


@pytest.mark.integration
@pytest.mark.skipif(not MODEL.exists(), reason="the shipped predictor is not in this checkout")
def test_the_stage_runs_the_headline_row_over_seeds_with_paired_ratios(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    scenarios = []
    for name, factor in (("tiny-surge", 0.2), ("tiny-steady", 0.1)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: {name}\nduration_s: 540\nwarmup_s: 60\nrate: [{{from_s: 0, x_overload: {factor}}}]\n"
                        "goodput_window: {from_s: 60, to_s: 540}\n")
        scenarios.append(str(path))
    out, headline = tmp_path / "sim" / "metrics.json", tmp_path / "sim" / "goodput.json"
    calibration_path = tmp_path / "sim" / "calibration.json"
    assert stage.main(["--model", str(MODEL), "--sessions", str(tmp_path / "absent.parquet"), "--synthetic",
                       "--predictions", "in-sample",
                       "--out-metrics", str(out), "--headline", str(headline), "--plot-dir", str(tmp_path / "plots"),
                       "--out-calibration", str(calibration_path), "--ramp-step-s", "300",
                       "--scenario", scenarios[0], "--steady-scenario", scenarios[1], "--seeds", "1", "2",
                       "--overload-rate", "0.36", "--jobs", "2",
                       "--rates-file", str(tmp_path / "rates.json"),
                       "--calibrations-file", str(tmp_path / "calibrations.json")]) == 0
    metrics = json.loads(out.read_text())
    calibration = load_calibration(calibration_path)  # the gateway reads what the stage measured
    assert calibration.reservation_ratio > 1.0  # predicted peaks exceed the contexts of live sessions
    assert calibration.reservation_quantile == 0.9 and calibration.predictor_sha256 is not None
    assert metrics["calibration"]["knee_tokens"] == calibration.knee_tokens
    assert set(metrics["goodput"]) == {"sglang", "continuum", "basin-proto", "basin", "basin_steady"}
    assert all(cell["seeds"] == 2 for cell in metrics["goodput"].values())
    assert (metrics["scenario"], metrics["steady_scenario"], metrics["seeds"]) == ("tiny-surge", "tiny-steady", [1, 2])
    basin, continuum = (metrics["goodput"][p]["per_seed"] for p in ("basin", "continuum"))
    assert metrics["goodput"]["basin"]["mean"] == pytest.approx(sum(basin) / 2, rel=1e-3)
    ratios = [b / c for b, c in zip(basin, continuum, strict=True)]
    assert metrics["basin_over_continuum"]["mean"] == pytest.approx(sum(ratios) / 2, rel=1e-3)  # paired by seed
    assert metrics["basin_over_own_steady"]["seeds"] == 2
    written = json.loads(headline.read_text())
    assert set(written) == {"basin_per_h", "basin_sd", "vs_continuum", "vs_continuum_sd", "vs_steady", "vs_steady_sd",
                            "proto_vs_continuum", "proto_vs_continuum_sd"}
    proto = metrics["goodput"]["basin-proto"]["per_seed"]
    assert written["proto_vs_continuum"] == pytest.approx(
        sum(p / c for p, c in zip(proto, continuum, strict=True)) / 2, rel=1e-3)
    assert written["vs_continuum"] == pytest.approx(metrics["basin_over_continuum"]["mean"], rel=1e-3)
    assert list((tmp_path / "plots").glob("*.png"))
    _assert_logged_as_a_run(uri, metrics)


def _assert_logged_as_a_run(uri: str, metrics: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from basin_pipeline.tracking import EXPERIMENT

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "simulate" and run.data.params["deployment"] == metrics["deployment"]
    assert run.data.params["scenario"] == "tiny-surge"
    for key, value in metrics["goodput"]["basin"].items():
        if isinstance(value, int | float):  # per-seed lists stay in the file
            assert run.data.metrics[f"goodput/basin/{key}"] == pytest.approx(value, rel=1e-3)  # file: 4 digits
    assert run.data.metrics["basin_over_continuum/mean"] == pytest.approx(metrics["basin_over_continuum"]["mean"],
                                                                          rel=1e-3)

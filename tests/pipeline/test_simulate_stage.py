"""The simulate stage end to end on a tiny scenario and the shipped model (its reservation multipliers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from basin_runtime.calibration import load_calibration
from pipeline import simulate as stage

MODEL = Path("models/peak_predictor.onnx")


@pytest.mark.skipif(not MODEL.exists(), reason="the shipped predictor is not in this checkout")
def test_the_stage_writes_goodput_per_policy_and_per_reservation_quantile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text("name: tiny\nduration_s: 540\nwarmup_s: 60\nrate: [{from_s: 0, x_overload: 0.1}]\n"
                        "goodput_window: {from_s: 60, to_s: 540}\n")
    out, calibration_path = tmp_path / "sim" / "metrics.json", tmp_path / "sim" / "calibration.json"
    assert stage.main(["--model", str(MODEL), "--sessions", str(tmp_path / "absent.parquet"),
                       "--out-metrics", str(out), "--plot-dir", str(tmp_path),
                       "--out-calibration", str(calibration_path), "--ramp-step-s", "300",
                       "--scenario-override", str(scenario), "--overload-rate", "0.36"]) == 0
    metrics = json.loads(out.read_text())
    calibration = load_calibration(calibration_path)  # the gateway reads what the stage measured
    assert calibration.reservation_ratio > 1.0  # predicted peaks exceed the contexts of live sessions
    assert calibration.budget_tokens() > calibration.budget_tokens("prototype")
    assert metrics["calibration"]["knee_tokens"] == calibration.knee_tokens
    assert metrics["basin_over_surge_100_continuum"] is None or metrics["basin_over_surge_100_continuum"] > 0
    assert set(metrics["runs"]) == {f"{s}/{p}" for s, p in stage.RUNS}
    assert metrics["reservation_quantile"] == 0.9
    sweep = metrics["quantile_sweep"]
    assert set(sweep) == {"q0.5", "q0.9", "q0.95"}
    assert sweep["q0.5"]["multiplier_all_rows"] < sweep["q0.9"]["multiplier_all_rows"] < \
        sweep["q0.95"]["multiplier_all_rows"]
    fixed_r = {q: row["r_fixed"]["reservation_ratio"] for q, row in sweep.items()}
    assert len(set(fixed_r.values())) == 1 and fixed_r["q0.9"] == calibration.reservation_ratio
    assert sweep["q0.9"]["r_remeasured"] == sweep["q0.9"]["r_fixed"]  # the served q: one calibration
    # r re-measured grows with what is reserved
    assert sweep["q0.5"]["r_remeasured"]["reservation_ratio"] < sweep["q0.95"]["r_remeasured"]["reservation_ratio"]
    for row in sweep.values():
        for entry in (row["r_fixed"], row["r_remeasured"]):
            assert entry["sessions_admitted"] > 0 and 0 <= entry["sessions_overflowed"] <= entry["sessions_admitted"]
    assert list(tmp_path.glob("*.png"))
    _assert_logged_as_a_run(uri, metrics)


def _assert_logged_as_a_run(uri: str, metrics: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import EXPERIMENT

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "simulate" and run.data.params["deployment"] == metrics["deployment"]
    for key, value in metrics["runs"]["surge-100/basin"].items():
        if value is not None:
            assert run.data.metrics[f"runs/surge-100/basin/{key}"] == pytest.approx(value, rel=1e-5)  # file: 6 digits
    assert run.data.metrics["quantile_sweep/q0.95/r_fixed/sessions_admitted"] == \
        metrics["quantile_sweep"]["q0.95"]["r_fixed"]["sessions_admitted"]

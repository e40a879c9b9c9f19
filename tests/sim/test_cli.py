"""`python -m basin_sim`: one JSON line, plots, and errors that name the known choices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_runtime.session_table import write_sessions
from basin_sim.cli import main
from basin_sim.synthetic import generate_corpus

SCENARIO = """name: tiny-surge
description: a short surge for tests
duration_s: 1200
warmup_s: 120
window_start_s: 600
surge: {start_s: 300, end_s: 600, rate_factor: 2.0}
"""
DEPLOYMENT = """name: tiny
profile: h100-qwen3.6-35b-a3b
num_prefill: 1
num_decode: 1
overload_rate_gpu_per_s: 0.1
overload_rate_host_per_s: null
overload_rate_gpu_synthetic_per_s: 0.1
overload_rate_host_synthetic_per_s: null
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    write_sessions(tmp_path / "sessions.parquet", generate_corpus(2, 10))
    return {"scenario": str(tmp_path / "s.yaml"), "deployment": str(tmp_path / "d.yaml"),
            "sessions": str(tmp_path / "sessions.parquet"), "dir": str(tmp_path)}


def test_run_prints_one_json_summary_line_and_writes_the_timeline_plot(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--seed", "3", "--json", "--quiet", "--sessions", files["sessions"], "--plot-dir", files["dir"]]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["workload"] == "table" and summary["base_rate_per_s"] == pytest.approx(0.05)
    assert summary["sessions_arrived"] > 0 and 0 <= summary["sessions_good"] <= summary["sessions_arrived"]
    assert summary["goodput_per_hour"] == pytest.approx(summary["sessions_good"] / (600 / 3600))
    for key in ("hit_rate_pre", "hit_rate_post"):
        assert 0 < summary[key] <= 1
    assert (Path(files["dir"]) / "tiny-surge_tiny_gpu_sglang_seed3.png").stat().st_size > 10_000


def test_without_a_session_table_it_says_it_uses_the_synthetic_corpus(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--json", "--quiet", "--sessions", str(Path(files["dir"]) / "missing.parquet")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["workload"] == "synthetic"
    assert "SYNTHETIC corpus" in caplog.text


@pytest.mark.parametrize(("argv", "message"), [
    (["--scenario", "surge-1000", "--deployment", "1p3d", "--policy", "sglang"],
     "unknown scenario 'surge-1000'; known scenarios: "
     "kill-burst, kill-burst-keep, steady, surge-100, surge-200, surge-33"),
    (["--scenario", "steady", "--deployment", "9p9d", "--policy", "sglang"], "known deployments: 1p1d, 1p3d"),
    (["--scenario", "steady", "--deployment", "1p3d", "--policy", "vllm"],
     "unknown policy 'vllm'; known policies: sglang, hicache"),
    (["--scenario", "steady", "--deployment", "1p3d", "--policy", "hicache", "--cache", "gpu"],
     "policy 'hicache' needs the host tier"),
])
def test_bad_input_exits_2_with_a_message_naming_the_choices(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *argv, "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_basin_loads_the_shipped_predictor_and_refuses_a_missing_one(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
            "--json", "--quiet", "--sessions", files["sessions"], "--model", str(model), "--reservation-scale", "0.6"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "basin" and summary["reservation_scale"] == 0.6
    assert summary["sessions_arrived"] > 0
    with pytest.raises(SystemExit) as info:
        main([*argv[:-4], "--model", str(Path(files["dir"]) / "nope.onnx")])
    assert info.value.code == 2
    assert "nope.onnx: no such predictor file" in capsys.readouterr().err

"""`python -m basin_sim.compare`: the grid runs, the table has one row per scenario x deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_sim.compare import main, markdown
from tests.sim.test_cli import DEPLOYMENT, SCENARIO

MODEL = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"


def test_the_table_is_the_mean_over_seeds_per_policy_column() -> None:
    rows = [{"scenario": "s", "deployment": "d", "policy": "basin", "seed": k, "goodput_per_hour": g}
            for k, g in ((1, 100.0), (2, 300.0))]
    rows.append({"scenario": "s", "deployment": "d", "policy": "sglang", "seed": 1, "goodput_per_hour": 1234.0})
    table = markdown(rows, ["sglang", "continuum", "basin"])
    assert table.splitlines()[0] == "| scenario | deployment | sglang | continuum | basin |"
    assert table.splitlines()[2] == "| s | d | 1,234 | - | 200 |"


def test_the_grid_runs_every_cell_with_a_calibrated_basin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    out = tmp_path / "compare.json"
    assert main(["--scenarios", str(tmp_path / "s.yaml"), "--deployments", str(tmp_path / "d.yaml"),
                 "--policies", "sglang", "basin", "--seeds", "1", "2", "--jobs", "1", "--model", str(MODEL),
                 "--sessions", str(tmp_path / "absent.parquet"), "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| scenario | deployment | sglang | basin |" and len(table) == 3
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 4 and {r["seed"] for r in result["runs"]} == {1, 2}
    assert result["calibrations"]["tiny"]["reservation_ratio"] > 1.0


def test_an_unknown_scenario_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenarios", "no-such-scenario", "--model", str(MODEL), "--synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m basin_sim.compare: error:") and "no-such-scenario" in err

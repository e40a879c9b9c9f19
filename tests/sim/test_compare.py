"""`basin-sim compare`: the grid runs over seeds; the table has mean ± sd and the share of seeds stuck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_sim.calibrate.rates import RateCache, rate_key
from basin_sim.catalog import load_deployment, load_scenario
from basin_sim.cli import main as cli_main
from basin_sim.compare import aggregate, main, markdown
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.test_cli import DEPLOYMENT, SCENARIO

MODEL = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"


def row(policy: str, seed: int, goodput: float, stuck: bool) -> dict[str, object]:
    return {"scenario": "s", "deployment": "d", "policy": policy, "seed": seed, "goodput_per_hour": goodput,
            "is_stuck": stuck}


def test_a_cell_is_the_mean_and_sd_over_seeds_and_the_share_stuck() -> None:
    rows = [row("basin", 1, 100.0, False), row("basin", 2, 300.0, True), row("sglang", 1, 1234.0, False)]
    cells = aggregate(rows)
    assert cells[("s", "d", "basin")] == {"seeds": 2, "goodput_mean": 200.0, "goodput_sd": pytest.approx(141.421, 1e-4),
                                          "share_stuck": 0.5}
    table = markdown(rows, ["sglang", "continuum", "basin"])
    assert table.splitlines()[0] == "| scenario | deployment | sglang | continuum | basin |"
    assert table.splitlines()[2] == "| s | d | 1,234 ± 0 (stuck 0%) | - | 200 ± 141 (stuck 50%) |"


def test_the_grid_runs_every_cell_and_seed_with_a_calibrated_basin(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    scenario = load_scenario(str(tmp_path / "s.yaml"))
    pool = workload_pool(generate_corpus(7, 300), scenario.workload)  # the synthetic corpus the CLI falls back to
    rates = RateCache(tmp_path / "rates.json")
    rates.put(rate_key(load_deployment(str(tmp_path / "d.yaml")).build("gpu"), scenario.workload, scenario.clients,
                       pool), 0.1, {"command": "seeded by the test"})
    out = tmp_path / "compare.json"
    assert cli_main(["compare", "--scenarios", str(tmp_path / "s.yaml"), "--deployments", str(tmp_path / "d.yaml"),
                     "--policies", "sglang", "basin", "--seeds", "1", "2", "--jobs", "1", "--model", str(MODEL),
                     "--sessions", str(tmp_path / "absent.parquet"), "--rates-file", str(rates.path),
                     "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| scenario | deployment | sglang | basin |" and len(table) == 3
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 4 and {r["seed"] for r in result["runs"]} == {1, 2}
    cell = result["cells"]["tiny-surge/tiny"]
    assert cell["overload_rate_per_s"] == 0.1 and cell["calibration"]["reservation_ratio"] > 1.0
    assert result["summary"]["tiny-surge/tiny/basin"]["seeds"] == 2


def test_an_unknown_scenario_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenarios", "no-such-scenario", "--model", str(MODEL), "--synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("basin-sim compare: error:") and "no-such-scenario" in err

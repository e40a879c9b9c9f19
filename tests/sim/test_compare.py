"""`basin-sim compare`: the grid runs over seeds; the table has mean ± sd and the share of seeds stuck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_sim.catalog import load_deployment, load_scenario
from basin_sim.experiments.calibrate.rates import RateCache, rate_key
from basin_sim.experiments.cli import main as cli_main
from basin_sim.experiments.compare import aggregate, main, markdown, paired
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.test_cli import DEPLOYMENT, SCENARIO

MODEL = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"


def row(policy: str, seed: int, goodput: float, stuck: bool, lending: str = "none", shed: float = 0.0,
        wait_s: float = 1.0, hit: tuple[float, float] = (0.9, 0.8)) -> dict[str, object]:
    return {"scenario": "s", "deployment": "d", "lending": lending, "policy": policy, "seed": seed,
            "goodput_per_hour": goodput, "is_stuck": stuck, "shed_share": shed, "first_call_wait_p50_s": wait_s,
            "hit_rate_pre": hit[0], "hit_rate_post": hit[1]}


def test_a_cell_is_the_mean_and_sd_over_seeds_with_drop_wait_shed_and_the_share_stuck() -> None:
    rows = [row("basin", 1, 100.0, False, shed=0.1, wait_s=10.0), row("basin", 2, 300.0, True, wait_s=30.0,
                                                                       hit=(0.9, 0.5)),
            row("sglang", 1, 1234.0, False), row("sglang", 1, 50.0, True, lending="decode-memory")]
    cells = aggregate(rows)
    assert cells[("s", "d", "none", "basin")] == {
        "seeds": 2, "goodput_mean": 200.0, "goodput_sd": pytest.approx(141.421, 1e-4),
        "hit_rate_drop_points": pytest.approx(25.0), "first_call_wait_p50_s": 20.0,
        "shed_share": pytest.approx(0.05), "share_stuck": 0.5, "held_cache_share": None, "pin_tool_time_share": None,
        "pin_ttl_mean_s": None, "pin_queue_delay_s": None}
    pinned = [{**row("continuum", seed, 90.0, False), "held_cache_share": share, "pin_tool_time_share": 0.5,
               "pin_ttl_mean_s": 2.0, "pin_queue_delay_s": delay}
              for seed, share, delay in ((1, 0.2, 3.0), (2, 0.4, 5.0))]
    assert aggregate(pinned)[("s", "d", "none", "continuum")]["held_cache_share"] == pytest.approx(0.3)
    table = markdown([*rows, *pinned], ["sglang", "continuum", "basin"]).splitlines()
    assert table[0].startswith("| scenario | deployment | lending | policy | goodput /h | hit-rate drop")
    assert table[2:] == ["| s | d | none | sglang | 1,234 ± 0 | 10.0 | 1.0 s | 0.0% | 0% | - |",
                         "| s | d | none | continuum | 90 ± 0 | 10.0 | 1.0 s | 0.0% | 0% | 30%, 50%, T 4.0 s |",
                         "| s | d | none | basin | 200 ± 141 | 25.0 | 20.0 s | 5.0% | 50% | - |",
                         "| s | d | decode-memory | sglang | 50 ± 0 | 10.0 | 1.0 s | 0.0% | 100% | - |"]


def test_paired_ratios_are_per_seed_in_the_same_cell_and_against_the_reference_without_lending() -> None:
    rows = [row("continuum", 1, 100.0, False), row("continuum", 2, 200.0, False),
            row("basin", 1, 150.0, False), row("basin", 2, 100.0, False),
            row("continuum", 1, 50.0, False, lending="decode-memory"), row("continuum", 2, 0.0, False,
                                                                          lending="decode-memory"),
            row("basin", 1, 100.0, False, lending="decode-memory"), row("basin", 2, 300.0, False,
                                                                      lending="decode-memory")]
    table = paired(rows).splitlines()
    assert table[0] == ("| scenario | deployment | lending | label | / continuum (same lending) | / continuum without "
                        "lending | seeds ahead |")
    # none: 1.5 and 0.5; decode-memory: 2.0 (seed 2's continuum is 0: left out) and against none 1.0 and 1.5
    assert table[2:] == ["| s | d | none | basin | 1.000 ± 0.707 | 1.000 ± 0.707 | 1 of 2 |",
                         "| s | d | decode-memory | basin | 2.000 ± 0.000 | 1.250 ± 0.354 | 1 of 1 |"]


@pytest.mark.integration
def test_the_grid_runs_every_cell_and_seed_with_a_calibrated_basin(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    (tmp_path / "d-host.yaml").write_text(DEPLOYMENT.replace("name: tiny", "name: tiny-host").replace("cache: gpu",
                                                                                                      "cache: host"))
    scenario = load_scenario(str(tmp_path / "s.yaml"))
    pool = workload_pool(generate_corpus(7, 300), scenario.workload)  # the synthetic corpus the CLI falls back to
    rates = RateCache(tmp_path / "rates.json")
    rates.put(rate_key(load_deployment(str(tmp_path / "d.yaml")).build("gpu"), scenario.workload, scenario.clients,
                       pool), 0.1, {"command": "seeded by the test"})
    out, knees = tmp_path / "compare.json", tmp_path / "calibrations.json"
    argv = ["compare", "--scenarios", str(tmp_path / "s.yaml"), "--deployments", str(tmp_path / "d.yaml"),
            str(tmp_path / "d-host.yaml"), "--policies", "sglang", "basin", "--seeds", "1", "2", "--jobs", "1",
            "--model", str(MODEL), "--predictions", "in-sample", "--synthetic", "--sessions",
            str(tmp_path / "absent.parquet"),
            "--rates-file", str(rates.path),
            "--calibrations-file", str(knees), "--lending", "none", "decode-memory", "--out", str(out)]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[0].startswith("| scenario | deployment | lending | policy |") and len(table) == 2 + 8
    assert captured.err.count("Basin calibration measured now") == 2  # one knee ramp per lending switch: the
    result = json.loads(out.read_text())                              # host tier's shape is the GPU one's
    assert len(result["runs"]) == 16 and {r["seed"] for r in result["runs"]} == {1, 2}
    assert {(r["deployment"], r["lending"], r["policy"]) for r in result["runs"]} == {
        (d, lend, p) for d in ("tiny", "tiny-host") for lend in ("none", "decode-memory") for p in ("sglang", "basin")}
    assert result["cells"]["tiny-surge/tiny-host/none"]["calibration"] == \
        result["cells"]["tiny-surge/tiny/none"]["calibration"]
    cell = result["cells"]["tiny-surge/tiny/none"]
    assert cell["overload_rate_per_s"] == 0.1 and cell["calibration"]["reservation_ratio"] > 1.0
    assert cell["calibration"]["lending"] == "none"
    assert result["cells"]["tiny-surge/tiny/decode-memory"]["calibration"]["lending"] == "decode-memory"
    assert result["summary"]["tiny-surge/tiny/none/basin"]["seeds"] == 2
    assert len(json.loads(knees.read_text())) == 2
    assert cli_main(argv) == 0  # the second time both calibrations come from the cache
    assert "measured now" not in capsys.readouterr().err


def test_an_unknown_scenario_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenarios", "no-such-scenario", "--model", str(MODEL), "--synthetic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("basin-sim compare: error:") and "no-such-scenario" in err


def test_an_unknown_policy_is_one_line_exit_2_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenarios", "no-such-scenario", "--policies", "sglang", "nosuch+session-cache"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("basin-sim compare: error: unknown policy 'nosuch+session-cache'; known: sglang")
    assert "(each may end in +session-cache)" in err and "no-such-scenario" not in err


@pytest.mark.parametrize("preset", ["paper", "recorded-h100", "field", "held-out"])
def test_the_presets_name_only_shipped_scenarios_deployments_policies_and_ablations(preset: str) -> None:
    from basin_sim.experiments.ablations import ABLATIONS, split_label
    from basin_sim.experiments.compare import PRESETS
    from basin_sim.policies import policy_names

    for grid in PRESETS[preset]:
        for name in grid.scenarios:
            load_scenario(name)
        for name in grid.deployments:
            load_deployment(name)
        assert {split_label(label)[0] for label in grid.labels} <= set(policy_names()) | set(ABLATIONS)


def test_the_paper_preset_is_the_paper_regime_on_its_h200_node_with_and_without_lending() -> None:
    from basin_sim.experiments.ablations import ABLATIONS
    from basin_sim.experiments.compare import PRESETS

    policies, steady, ablations = PRESETS["paper"]
    assert set(policies.scenarios) == {"paper-timed-surge-100", "paper-timed-kill-burst", "paper-timed-kill-burst-keep",
                                       "paper-swebench-pro-surge-100"}
    assert all(load_scenario(name).workload.timing == "qwen3.6-35b-a3b" for name in policies.scenarios)
    assert load_deployment("1p3d").build().profile.name.startswith("h200")
    assert policies.deployments == steady.deployments == ablations.deployments == ("1p3d",)
    assert policies.lending == steady.lending == ("none", "decode-memory")
    assert set(policies.labels) == set(steady.labels) == {"sglang", "continuum", "basin-proto", "basin"}
    assert set(ablations.labels) == set(ABLATIONS) - {"basin"} and ablations.scenarios == policies.scenarios


def test_the_field_preset_runs_every_baseline_and_basin_with_and_without_the_session_cache() -> None:
    from basin_sim.experiments.compare import PAPER_SURGES, PRESETS

    (grid, ablations) = PRESETS["field"]
    assert set(grid.scenarios) == {*PAPER_SURGES, "paper-timed-steady", "paper-swebench-pro-steady"}
    assert grid.deployments == ("1p3d",) and grid.lending == ("none",)
    field = {"sglang", "continuum", "continuum-fixed-ttl", "budgeter", "thunderagent", "concur", "basin"}
    assert set(grid.labels) == field | {f"{name}+session-cache" for name in field}
    assert set(ablations.scenarios) == set(PAPER_SURGES) and (ablations.deployments, ablations.lending) == (
        ("1p3d",), ("none",))
    assert set(ablations.labels) == {"basin:no-revisions", "basin:no-task-memory", "basin:no-recovery",
                                     "basin:knee-budget", "basin:no-selection"}


def test_the_held_out_set_is_other_deployments_rates_and_seeds_and_each_scenario_generates(
        real_session_table: Path) -> None:
    from basin_sim.experiments.compare import PAPER_SURGES, PRESETS
    from basin_sim.simulate import pool_unloaded_s
    from basin_sim.unloaded import UnloadedTimes
    from basin_sim.workload.pool import load_pool, workload_pool
    from basin_sim.workload.scenarios import generate_sessions

    (grid,) = PRESETS["held-out"]
    (field, _) = PRESETS["field"]
    assert grid.seeds == tuple(range(11, 21)) and not set(grid.seeds) & set(range(1, 11))
    assert {"1p3d-h100", "3p1d"} <= set(grid.deployments)
    assert not set(grid.scenarios) & {*PAPER_SURGES, *field.scenarios}
    assert set(grid.labels) == {label for label in field.labels if not label.endswith("+session-cache")}
    (corpus, _), unloaded = load_pool(real_session_table, False), UnloadedTimes(load_deployment("1p3d").build())
    for name in grid.scenarios:
        scenario = load_scenario(name)
        pool = workload_pool(corpus, scenario.workload)
        specs = generate_sessions(scenario, pool, 0.1, 11, pool_unloaded_s(pool, unloaded))
        assert specs and (not scenario.bursts or any(spec.is_burst for spec in specs)), name


@pytest.mark.integration
def test_a_grid_with_its_own_seeds_runs_them(tmp_path: Path) -> None:
    from basin_sim.experiments import compare

    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    grid = compare.Grid((str(tmp_path / "s.yaml"),), (str(tmp_path / "d.yaml"),), ("none",), ("sglang",), (11, 12))
    inputs = compare.Inputs(sessions=tmp_path / "absent.parquet", synthetic=True, overload_rate=0.1)
    setup = compare.CompareSetup((grid,), seeds=(1, 2, 3), inputs=inputs)
    result = compare.run_grids(setup)
    assert [r["seed"] for r in result.rows] == [11, 12] and result.seeds == (11, 12)


def test_a_session_cache_label_is_its_policy_on_the_deployment_with_the_session_cache() -> None:
    from basin_sim.experiments.ablations import split_label

    assert split_label("thunderagent+session-cache") == ("thunderagent", True)
    assert split_label("basin:oracle-peak+session-cache") == ("basin:oracle-peak", True)
    assert split_label("sglang") == ("sglang", False)


def test_the_recorded_preset_keeps_the_earlier_evaluation() -> None:
    from basin_sim.experiments.compare import PRESETS

    grids = PRESETS["recorded-h100"]
    headline = grids[0]
    assert set(headline.scenarios) == {"surge-100-terminal-bench", "surge-100-swebench"}
    assert headline.lending == ("none", "decode-memory") and {"continuum", "basin", "budgeter"} <= set(headline.labels)
    stock = grids[1]  # stock SGLang's lending, on the host tier its storage backend needs
    assert (stock.deployments, stock.lending, stock.labels) == (("1p3d-h100-host",), ("storage-offload",),
                                                                headline.labels)
    assert load_scenario("surge-100-terminal-bench").workload.benchmarks == ("terminal-bench",)


@pytest.mark.integration
def test_field_rows_carry_what_each_baseline_did_and_the_plots_redraw_from_the_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from basin_sim.experiments.plots import main as plots_main

    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    out, plots = tmp_path / "compare.json", tmp_path / "plots"
    argv = ["compare", "--scenarios", str(tmp_path / "s.yaml"), "--deployments", str(tmp_path / "d.yaml"),
            "--policies", "sglang", "sglang+session-cache", "thunderagent", "concur", "--seeds", "1", "--jobs", "1",
            "--synthetic", "--sessions", str(tmp_path / "absent.parquet"), "--overload-rate", "0.1",
            "--lending", "none", "--out", str(out), "--plot-dir", str(plots)]
    assert cli_main(argv) == 0
    capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["labels"] == ["sglang", "sglang+session-cache", "thunderagent", "concur"]
    runs = {r["policy"]: r for r in result["runs"]}
    assert "session_cache" not in runs["sglang"] and "session_cache" not in runs["thunderagent"]
    assert runs["sglang+session-cache"]["session_cache"]["mode"] == "true"
    assert runs["sglang+session-cache"]["session_cache"]["references_taken"] > 0
    assert "pauses" in runs["thunderagent"] and "pauses" not in runs["sglang"]
    assert runs["concur"]["admission_window_per_minute"] and "admission_window_min" not in runs["thunderagent"]
    assert all(len(r["minute_hit_rate"]) == len(r["minute_first_call_wait_s"]) > 0 for r in runs.values())
    drawn = sorted(p.name for p in plots.iterdir())
    assert drawn == ["compare-tiny-surge.png", "minutes-tiny-surge-tiny-none.png"]
    assert plots_main([str(out), "--plot-dir", str(tmp_path / "again")]) == 0
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == drawn
    (tmp_path / "bad.json").write_text('{"runs": []}')
    assert plots_main([str(tmp_path / "bad.json"), "--plot-dir", str(tmp_path / "bad")]) == 2
    assert "bad.json is not a compare run's JSON" in capsys.readouterr().err

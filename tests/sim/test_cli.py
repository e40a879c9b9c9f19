"""`basin-sim` (basin_sim/experiments/cli.py): one JSON line, plots, help, and errors that name the known choices."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from basin_sim.experiments import cli, compare, run_setup
from basin_sim.experiments.calibrate import rates as rates_module
from basin_sim.experiments.calibrate.overload import Calibration
from basin_sim.experiments.cli import main
from basin_sim.policies import policy_names
from basin_sim.workload import pool as pool_module
from tests.sim.builders import seeded_files

SCENARIO = """name: tiny-surge
description: a short surge for tests
duration_s: 1080
warmup_s: 120
rate:
  - {from_s: 0, x_overload: 0.5}
  - {from_s: 180, x_overload: 1.0}
  - {from_s: 480, x_overload: 0.5}
goodput_window: {from_s: 480, to_s: 1080}
"""
DEPLOYMENT = """name: tiny
profile: h100-qwen3.6-35b-a3b
num_prefill: 1
num_decode: 1
cache: gpu
"""
RATE = ["--overload-rate", "0.1"]
IN_SAMPLE = ["--predictions", "in-sample"]  # these tables are made up: no out-of-fold table for them


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    return {"scenario": str(tmp_path / "s.yaml"), **seeded_files(tmp_path, DEPLOYMENT)}


def test_run_prints_one_json_summary_line_and_writes_the_timeline_plot(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--seed", "3", "--json", "--quiet", "--sessions", files["sessions"], "--plot-dir", files["dir"], *RATE]
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


def test_run_without_json_prints_one_line_per_key_and_the_timeline_only_as_its_length(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--quiet", "--sessions", files["sessions"], *RATE]
    assert main(argv) == 0
    shown = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.strip().splitlines())
    assert shown["policy"] == "sglang" and float(shown["goodput_per_hour"]) >= 0
    assert shown["timeline"].startswith("[") and "entries: --json prints them" in shown["timeline"]


def test_without_a_session_table_it_stops_naming_where_it_looked_and_the_command_that_builds_it(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--json", "--quiet", *RATE]
    missing = Path(files["dir"]) / "missing.parquet"
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--sessions", str(missing)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert ": error: no session table at " in err and f"no session table at {missing}:" in err
    assert "`make repro`" in err and "--sessions PATH" in err and "--synthetic" in err
    # started outside the project with the default relative path: it looks here and in the checkout
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    (checkout / "data").mkdir(parents=True)
    (checkout / "dvc.yaml").write_text("stages: {}\n")
    elsewhere.mkdir()
    monkeypatch.setattr(pool_module, "PROJECT_ROOT", checkout)
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"no session table at {elsewhere / 'data/sessions.parquet'} nor {checkout / 'data/sessions.parquet'}:" in err
    shutil.copy(files["sessions"], checkout / "data" / "sessions.parquet")
    assert main(argv) == 0  # the checkout's table
    assert json.loads(capsys.readouterr().out)["workload"] == "table"
    assert main([*argv, "--synthetic"]) == 0  # the synthetic corpus only when asked for
    assert json.loads(capsys.readouterr().out)["workload"] == "synthetic"


@pytest.mark.parametrize(("argv", "message"), [
    (["--scenario", "surge-1000", "--deployment", "1p3d-h100", "--policy", "sglang"],
     "unknown scenario 'surge-1000'; known scenarios: closed-agents, heldout-swepro-burst-3x-keep"),
    (["--scenario", "steady", "--deployment", "9p9d", "--policy", "sglang"],
     "known deployments: 100p300d, 1p1d, 1p3d, 1p3d-h100"),
    (["--scenario", "steady", "--deployment", "1p3d-h100", "--policy", "vllm"],
     "unknown policy 'vllm'; known policies: sglang, hicache"),
    (["--scenario", "steady", "--deployment", "1p3d-h100", "--policy", "hicache", "--cache", "gpu"],
     "policy 'hicache' needs the host tier"),
])
def test_bad_input_exits_2_with_a_message_naming_the_choices(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *argv, "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_reservation_multipliers_are_the_files_row_for_each_sessions_benchmark() -> None:
    from basin_runtime.predictor import PeakPredictor
    from basin_sim.experiments.predictions import reservation_multipliers, reserved_peaks
    from tests.sim.builders import session

    model = PeakPredictor.load(Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx")
    pool = [session("s", [100], benchmark="swebench-verified"), session("t", [100], benchmark="terminal-bench"),
            session("x", [100], benchmark="my-own-agent")]
    got = reservation_multipliers(model, pool, 0.95)
    assert got == {"s": model.multiplier(0.95, "swebench-verified"), "t": model.multiplier(0.95, "terminal-bench"),
                   "x": model.multiplier(0.95)}
    assert len(set(got.values())) == 3 and reservation_multipliers(model, pool, None) == {}
    assert reserved_peaks({"s": 1000.0, "t": 10.0}, got, 2.0) == {"s": 2000.0 * got["s"], "t": 20.0 * got["t"]}
    assert reserved_peaks({"s": 1000.0}, {}) == {"s": 1000.0}


def test_online_revisions_are_the_files_re_estimates_at_the_calls_each_session_reaches() -> None:
    from basin_runtime.predictor import PeakPredictor
    from basin_sim.experiments.predictions import online_revisions
    from tests.sim.builders import session

    model = PeakPredictor.load(Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx")
    pool = [session("long", [1000, 2000, 4000, 6000, 9000]), session("short", [1000, 1500])]
    peaks = {"long": 5000.0, "short": 3000.0}
    got = online_revisions(model, pool, peaks, 0.9, (3, 5))
    assert set(got["long"]) == {3, 5} and got["short"] == {}
    assert model.online is not None
    for k in (3, 5):
        estimate, m = got["long"][k]
        prompts = [c.prompt_tokens for c in pool[0].calls[:k]]
        completions = [c.completion_tokens for c in pool[0].calls[:k - 1]]
        assert estimate == pytest.approx(model.online.predict(5000.0, prompts, completions))
        assert m == model.online_multiplier(0.9, k) and estimate >= prompts[-1]
    assert online_revisions(model, pool, peaks, 0.9, ()) == {}


def test_basin_loads_the_shipped_predictor_and_refuses_a_missing_one(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    model = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
            "--json", "--quiet", "--sessions", files["sessions"], *RATE, "--no-calibration", "--model", str(model),
            *IN_SAMPLE,
            "--reservation-scale", "0.6"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["policy"] == "basin" and summary["reservation_scale"] == 0.6
    assert summary["calibration_source"].startswith("none (--no-calibration")
    assert summary["reservation_quantile"] == 0.9  # the gateway's default
    assert summary["sessions_arrived"] > 0 and 0 <= summary["sessions_overflowed"] <= summary["sessions_admitted"]
    assert isinstance(summary["revisions"], int)  # counted; applying them is tested in test_basin_policies
    with pytest.raises(SystemExit) as info:
        main([*argv[:-6], "--model", str(Path(files["dir"]) / "nope.onnx")])
    assert info.value.code == 2
    assert "nope.onnx: no such predictor file" in capsys.readouterr().err


def test_a_missing_model_is_named_before_any_measurement_or_table_is_read(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 45: `--model models/nope.onnx` spent 1 min 52 s calibrating before it said the file was missing.
    def never(*_: object, **__: object) -> None:
        raise AssertionError("work done before the inputs were checked")

    monkeypatch.setattr(run_setup, "load_pool", never)
    monkeypatch.setattr(run_setup, "overload_rate_for", never)
    monkeypatch.setattr(run_setup, "cached_knee_calibration", never)
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
            "--quiet", "--sessions", files["sessions"], "--model", str(Path(files["dir"]) / "missing.onnx")]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    missing = Path(files["dir"]) / "missing.onnx"
    assert capsys.readouterr().err == f"basin-sim: error: {missing}: no such predictor file\n"
    for wrong, message in ((["--calibration", str(Path(files["dir"]) / "none.json")], "none.json: no such file"),
                           (["--out-of-fold", str(Path(files["dir"]) / "none.parquet"), "--model",
                             str(Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx")],
                            "none.parquet")):
        with pytest.raises(SystemExit):
            main([*argv[:-2], *wrong])
        assert message in capsys.readouterr().err


def test_a_plain_sglang_summary_holds_only_what_sglang_has(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 45: a plain-SGLang run printed reservation_quantile and seven `pin_* None`.
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--seed", "3", "--quiet",
            "--sessions", files["sessions"], *RATE]
    shown = {}
    for policy in ("sglang", "continuum"):
        assert main([*argv, "--policy", policy, "--json"]) == 0
        shown[policy] = json.loads(capsys.readouterr().out)
    assert not {k for k in shown["sglang"] if k.startswith("pin_")}
    assert not {"reservation_quantile", "reservation_scale", "knee_tokens", "sessions_admitted",
                "calibration_source", "suspensions"} & set(shown["sglang"])
    assert {"pin_answers", "pin_ttl_mean_s"} <= set(shown["continuum"]) and "goodput_per_hour" in shown["sglang"]
    assert main([*argv, "--policy", "sglang"]) == 0
    table = capsys.readouterr().out
    assert "goodput_per_hour" in table and "pin_" not in table and "reservation_quantile" not in table


def test_continuum_fixed_ttl_runs_from_the_cli_and_only_it_reports_the_slow_tool_skips(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--seed", "3", "--quiet",
            "--sessions", files["sessions"], *RATE, "--json"]
    shown = {}
    for policy in ("continuum", "continuum-fixed-ttl"):
        assert main([*argv, "--policy", policy]) == 0
        shown[policy] = json.loads(capsys.readouterr().out)
    fixed = shown["continuum-fixed-ttl"]
    assert fixed["policy"] == "continuum-fixed-ttl" and fixed["pin_answers"] > 0
    # every answer is pinned 2 s or skipped for a slow tool (the pool parses no "no tool call")
    assert fixed["pin_answer_share"] + fixed["pin_slow_tool_share"] == pytest.approx(1.0)
    assert fixed["pin_ttl_mean_s"] == pytest.approx(2.0 * fixed["pin_answer_share"])
    assert fixed["pin_held_mean_s"] > 0 and "pin_eta" not in fixed
    assert not {"pin_slow_tool_share", "pin_held_mean_s"} & set(shown["continuum"])


def test_the_top_level_help_names_every_subcommand_with_an_example_under_one_program_name(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: basin-sim ") and "python -m" not in text
    for command in ("run", "compare", "calibrate", "knee", "risk", "ramp"):
        assert f"\n    {command} " in text or f"\n    {command}\n" in text, command
        assert f"\n  basin-sim {command} --" in text, command
    for policy in policy_names():  # every registered policy, each on its own line
        assert f"\n  {policy} " in text or f"\n  {policy}\n" in text, policy
    assert "PREDICT" in text and "MEASURE" in text  # risk against ramp


def test_every_option_of_every_subcommand_has_help_and_shows_its_default() -> None:
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        if name == "compare":
            command = compare._parser()
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (name, action.option_strings)
        text = command.format_help()
        assert text.startswith(f"usage: basin-sim {name}"), name
    run = commands["run"].format_help()
    assert "seed of the run's arrivals" in run and "(default: 1)" in run


@pytest.mark.integration
def test_basin_without_a_calibration_file_calibrates_once_and_then_uses_the_cache(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """No silent uncalibrated Basin: the first run measures the knee ramp and says so; the next one reads it;
    another quantile (another reservation) is another entry."""
    model = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
    cache = Path(files["dir"]) / "calibrations.json"
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
            "--json", "--quiet", "--sessions", files["sessions"], *RATE, "--model", str(model), *IN_SAMPLE,
            "--calibrations-file", str(cache)]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["calibration_source"] == "measured now" and "running the knee ramp now" in caplog.text
    entries = json.loads(cache.read_text())
    [entry] = entries.values()
    assert entry["reservation_quantile"] == 0.9 and entry["calibration"]["reservation_ratio"] > 1
    assert first["knee_tokens"] == entry["calibration"]["knee_tokens"]
    assert first["reservation_ratio"] == entry["calibration"]["reservation_ratio"]
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["calibration_source"] == "cache" and again["knee_tokens"] == first["knee_tokens"]
    assert json.loads(cache.read_text()) == entries
    assert main([*argv, "--reservation-quantile", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration_source"] == "measured now"
    assert len(json.loads(cache.read_text())) == 2
    assert main([*argv, "--lending", "decode-memory"]) == 0  # lending moves the knee: another entry
    lent = json.loads(capsys.readouterr().out)
    assert (lent["calibration_source"], lent["lending"]) == ("measured now", "decode-memory")
    entries = json.loads(cache.read_text())
    assert sorted(e["calibration"]["lending"] for e in entries.values()) == ["decode-memory", "none", "none"]


def test_knee_writes_a_calibration_file_the_gateway_reads_and_run_uses_it(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    from basin_runtime.calibration import load_calibration

    model = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
    out = Path(files["dir"]) / "calibration.json"
    assert main(["knee", "--deployment", files["deployment"], "--sessions", files["sessions"], "--quiet",
                 "--step-s", "600", "--model", str(model), *IN_SAMPLE, "--out", str(out), "--rates-file",
                 files["rates"]]) == 0
    printed = capsys.readouterr().out
    assert printed.count("reserved/working set") == 8  # one line per ramp step
    calibration = load_calibration(out)
    assert 0 < calibration.knee_tokens <= 2 * calibration.cache_capacity_tokens
    assert calibration.reservation_ratio > 1.0
    # the plateau's first-token latency and call cycle: the latency gate a served Basin engages behind
    assert calibration.ttft_plateau_s is not None and calibration.call_cycle_plateau_s is not None
    assert 0 < calibration.ttft_plateau_s < calibration.call_cycle_plateau_s  # a cycle holds a whole call
    gate = calibration.latency_gate_s()
    assert gate == pytest.approx(calibration.ttft_plateau_s + 3 * calibration.call_cycle_plateau_s)
    assert main(["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
                 "--json", "--quiet", "--sessions", files["sessions"], "--model", str(model), *IN_SAMPLE,
                 "--calibration", str(out), *RATE]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["knee_tokens"] == calibration.knee_tokens
    assert summary["reservation_ratio"] == calibration.reservation_ratio
    assert (calibration.predictor_sha256, calibration.reservation_quantile, calibration.lending) == \
        (hashlib.sha256(model.read_bytes()).hexdigest(), 0.9, "none")
    for other, said in ((["--reservation-quantile", "0.5"], "reservation quantile 0.9 (served: 0.5)"),
                        (["--lending", "decode-memory"], "lending 'none' (served: 'decode-memory')")):
        with pytest.raises(SystemExit) as info:  # r was measured for another quantile / lending: refused, said how
            main(["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
                  "--quiet", "--sessions", files["sessions"], "--model", str(model), *IN_SAMPLE, "--calibration",
                  str(out),
                  *RATE, *other])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert said in err and "re-measure with `basin-sim knee --model FILE --reservation-quantile Q" in err


def test_knee_without_a_model_writes_no_reservation_ratio_and_a_bad_calibration_exits_2(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(files["dir"]) / "proto.json"
    assert main(["knee", "--deployment", files["deployment"], "--sessions", files["sessions"], "--quiet",
                 "--step-s", "600", "--no-model", "--out", str(out), "--rates-file", files["rates"]]) == 0
    assert "reservation_ratio" not in json.loads(out.read_text())
    capsys.readouterr()
    bad = Path(files["dir"]) / "bad.json"
    bad.write_text('{"knee_tokens": 5}')
    with pytest.raises(SystemExit) as info:
        main(["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin-proto",
              "--quiet", "--sessions", files["sessions"], "--calibration", str(bad), *RATE])
    assert info.value.code == 2
    assert "bad.json: missing ['cache_capacity_tokens']" in capsys.readouterr().err


def test_risk_prints_the_fluid_model_points_and_a_verdict(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["risk", "--deployment", files["deployment"], "--sessions", files["sessions"], "--quiet",
                 "--step-s", "600", "--rates-file", files["rates"]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("X(N): N=")
    assert lines[-1].startswith("tiny: cache knee reached at ") and "live sessions" in lines[-1]
    assert lines[-1].endswith(("cache-first", "decode-first"))  # the --json fields: tests/sim/test_risk.py


def test_a_shape_and_workload_without_a_recorded_rate_is_measured_once_cached_and_said(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[float] = []

    def fake_search(deployment: object, policy: str, pool: object, settings: object, report: object = None
                    ) -> Calibration:
        measured.append(0.12)  # the real search takes minutes; its arithmetic is tested in test_calibrate.py
        assert policy == "sglang" and deployment.host_cache_tokens == 0
        return Calibration(0.12, ((0.05, 0), (0.1, 2), (0.2, 5)))

    monkeypatch.setattr(rates_module, "find_overload_rate", fake_search)
    rates = Path(files["dir"]) / "new-rates.json"
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "sglang",
            "--json", "--quiet", "--sessions", files["sessions"], "--rates-file", str(rates)]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["overload_rate_source"] == "measured now" and first["overload_rate_per_s"] == 0.12
    assert "calibrating now" in caplog.text and str(rates) in caplog.text
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["overload_rate_source"] == "cache" and measured == [0.12]  # measured once
    assert main([*argv[:-2], "--rates-file", str(rates), "--cache", "host"]) == 0  # same shape, host tier
    assert json.loads(capsys.readouterr().out)["overload_rate_per_s"] == 0.12 and measured == [0.12]
    assert first["base_rate_per_s"] == pytest.approx(0.5 * 0.12)


def test_basin_takes_each_peak_from_the_out_of_fold_table_by_default_and_names_a_missing_one(
        files: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from basin_runtime.session_table import read_sessions

    model = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"
    ids = [s.session_id for s in read_sessions(Path(files["sessions"]))]
    held = ids[: len(ids) // 2]  # the other half is not in the table: predicted by the shipped model, counted
    table = tmp_path / "oof.parquet"
    pq.write_table(pa.table({"session_id": held, "pooled_predicted": [50_000.0] * len(held)}), table)
    # issue 49: a table with the pooled model's column only, so the pooled first call, named (the default is now
    # the selected procedure's column, tests/sim/test_first_call_selection.py)
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--policy", "basin",
            "--json", "--quiet", "--sessions", files["sessions"], *RATE, "--no-calibration", "--model", str(model),
            "--first-call", "pooled"]
    assert main([*argv, "--out-of-fold", str(table), "--online-out-of-fold", str(tmp_path / "no-online.parquet")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["predictions"] == {"out-of-fold": len(held),
                                      "shipped model, session not in the training table": len(ids) - len(held)}
    assert summary["revisions"] == 0  # no out-of-fold online table: no revisions, never the in-sample model
    assert main([*argv, "--predictions", "in-sample"]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"] == {"in-sample": len(ids)}
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out-of-fold", str(tmp_path / "absent.parquet")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "absent.parquet" in err and "make repro" in err and "--predictions in-sample" in err


def test_a_scaled_pool_is_predicted_as_recorded_and_each_prediction_scaled(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from basin_sim.experiments.predictions import pool_peaks
    from basin_sim.workload.pool import scaled
    from tests.sim.builders import session

    class Doubling:  # predicts twice the first prompt it is shown
        def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> list[float]:
            return [2.0 * f for f in first_prompt_tokens]

    pool = [scaled(session("a", [1_000, 3_000]), 4.0), scaled(session("b", [500, 800]), 4.0)]
    assert pool[0].first_prompt_tokens == 4_000
    peaks, sources = pool_peaks(Doubling(), pool, "in-sample", token_scale=4.0)
    assert peaks == {"a": 4 * 2 * 1_000.0, "b": 4 * 2 * 500.0} and sources == {"in-sample": 2}
    table = tmp_path / "oof.parquet"
    pq.write_table(pa.table({"session_id": ["a"], "pooled_predicted": [5_000.0]}), table)
    peaks, _ = pool_peaks(Doubling(), pool, "out-of-fold", table, token_scale=4.0)
    assert peaks == {"a": 4 * 5_000.0, "b": 4 * 2 * 500.0}


def test_thunderagent_runs_from_the_cli_with_its_pause_report(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--seed", "3", "--quiet",
            "--sessions", files["sessions"], "--policy", "thunderagent", "--json", *RATE]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"] == "thunderagent" and shown["sessions_arrived"] > 0
    assert {"pauses", "pause_marks", "pause_resumes", "pause_forced_resumes", "pause_soft_demote_windows",
            "pause_time_total_s", "pause_time_mean_s", "suspensions"} <= set(shown)
    assert not {k for k in shown if k.startswith("pin_")}


def test_concur_runs_from_the_cli_with_its_admission_window(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", "--scenario", files["scenario"], "--deployment", files["deployment"], "--seed", "3", "--quiet",
            "--sessions", files["sessions"], "--policy", "concur", "--json", *RATE]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"] == "concur" and shown["sessions_arrived"] > 0
    series = shown["admission_window_per_minute"]
    assert isinstance(series, list) and series and all(isinstance(w, int) and w >= 1 for w in series)
    assert shown["admission_window_min"] == min(series) and shown["admission_window_max"] == max(series)
    assert {"admission_increases", "admission_decreases", "admission_deferred", "admission_wait_total_s",
            "admission_wait_mean_s"} <= set(shown)
    assert not {k for k in shown if k.startswith(("pin_", "pause"))} and "suspensions" not in shown

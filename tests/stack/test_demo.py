"""`make demo`'s pieces: the gateway's time constants on the wall clock, the table, and a tiny whole run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from basin_runtime.session_log import SessionLogRecord
from basin_stack.demo import collapsed_before_surge, main, session_counts, table
from basin_stack.stack import gateway_config

TINY = ["--synthetic", "--max-sessions", "6", "--duration-s", "240", "--surge", "60", "120", "2", "--time-scale", "20",
        "--max-lag-model-s", "1000"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The simulator's overload-rate and knee caches, shared by the demo tests (a module fixture: one worker):
    the first demo measures the deployment's overload rate and knee (~25 s), the lending one adds only
    the knee with storage on."""
    folder = tmp_path_factory.mktemp("demo-caches")
    return ["--rates-file", str(folder / "rates.json"), "--calibrations-file", str(folder / "calibrations.json")]


def test_the_gateway_runs_every_time_constant_time_scale_times_faster() -> None:
    config = gateway_config({"tick_interval_s": 2.0, "policy": {"peak_completion_rate_per_s": 0.3}}, 20.0)
    assert config["tick_interval_s"] == pytest.approx(0.1)
    assert config["idle_timeout_s"] == pytest.approx(30.0)  # the default 600 s, scaled
    policy = config["policy"]
    assert policy["peak_completion_rate_per_s"] == pytest.approx(6.0)  # a rate: multiplied
    assert policy["tokens_per_s"] == pytest.approx(600.0)  # priority p = arrival + peak / 30, in wall seconds
    assert policy["shed_wait_s"] == pytest.approx(45.0)
    assert policy["budget_move_interval_s"] == pytest.approx(3.0)


def _summary(goodput: float, post_hit: float, valid: bool) -> dict[str, Any]:
    window = {"hit_rate": post_hit, "ttft_p50_s": 1.0, "ttft_p90_s": 2.0}
    return {"goodput_per_hour": goodput, "windows": {"pre": window, "surge": window, "post": window},
            "admission_wait_p50_s": 0.5, "admission_wait_p90_s": 3.0,
            "status_counts": {"finished": 9, "shed": 1, "aborted": 0, "error": 0},
            "lag_p99_model_s": 0.2 if valid else 5.0, "valid": valid}


def test_the_table_counts_every_session_once_shows_the_shed_share_and_flags_a_collapse_before_the_surge() -> None:
    # Issue 45: `357 / 0 / 0 / 0` out of 522, 165 unfinished never mentioned; a baseline collapsed before its surge
    # (hit rate 0.34) not flagged; 54% shed hidden in one cell.
    collapsed = {**_summary(0.0, 0.3, True), "sessions_planned": 522,
                 "status_counts": {"finished": 357, "shed": 0, "aborted": 0, "error": 0, "unfinished": 100}}
    shedding = {**_summary(300.0, 0.9, True), "sessions_planned": 522,
                "status_counts": {"finished": 239, "shed": 283, "aborted": 0, "error": 0, "unfinished": 0}}
    lines = table({"without": collapsed, "with": shedding}, steady_hit_rate=0.92).splitlines()
    assert "| sessions planned | 522 | 522 |" in lines
    assert "| finished / shed / aborted / error / unfinished | 357 / 0 / 0 / 0 / 165 | 239 / 283 / 0 / 0 / 0 |" in lines
    assert "| shed share (of sessions planned) | 0% | 54% |" in lines
    assert "| hit rate before the surge (steady reference 0.92) | 0.30 COLLAPSED BEFORE THE SURGE | 0.90 |" in lines
    assert session_counts(collapsed) == {"finished": 357, "shed": 0, "aborted": 0, "error": 0, "unfinished": 165}
    assert not collapsed_before_surge(shedding, 0.92) and not collapsed_before_surge(collapsed, None)
    assert collapsed_before_surge(collapsed, 0.41) and not collapsed_before_surge(collapsed, 0.39)  # 0.1 under


def test_the_table_puts_the_runs_side_by_side_and_marks_an_invalid_one() -> None:
    text = table({"without": _summary(0.0, 0.05, False), "with": _summary(204.0, 0.9, True)})
    lines = text.splitlines()
    assert lines[0] == "| | without gateway | with gateway |"
    assert "| goodput after the surge (sessions/h) | 0 | 204 |" in lines
    assert "| hit rate after the surge | 0.05 | 0.90 |" in lines
    assert "| emulator lag p99 (model s) | 5.00 INVALID | 0.20 |" in lines


@pytest.mark.e2e
def test_a_tiny_demo_runs_both_modes_through_emulators_smg_and_the_gateway(tmp_path: Path, caches: list[str]) -> None:
    out = tmp_path / "demo"
    code = main(["--out-dir", str(out), "--sessions", str(tmp_path / "absent.parquet"), *TINY, *caches])
    assert code == 0
    rates, knees = (json.loads(Path(caches[k]).read_text()) for k in (1, 3))
    assert len(rates) == 1 and len(knees) == 1  # measured now and kept for the next demo
    summary = (out / "summary.md").read_text()
    assert "| | without gateway | with gateway |" in summary
    for mode in ("without", "with"):
        run = json.loads((out / f"run-{mode}.json").read_text())
        assert [s["status"] for s in run["sessions"]] == ["finished"] * 6
        assert run["summary"]["cached_tokens"] > 0  # resent conversations hit the emulated prefix cache
        assert (out / f"timeline-{mode}.png").stat().st_size > 0
    logged = [SessionLogRecord.from_json(line) for path in sorted((out / "gateway-log").glob("*.jsonl"))
              for line in path.read_text().splitlines()]
    assert len(logged) == 6  # the with-gateway run's sessions, for the closed loop
    assert (out / "comparison.png").stat().st_size > 0
    assert not (out / "logs" / "without" / "gateway.log").exists()  # the baseline has no gateway in the path
    assert (out / "logs" / "with" / "gateway.log").exists()


@pytest.mark.e2e
def test_the_lending_demo_runs_decode_offload_off_and_on_with_the_recipe(tmp_path: Path, caches: list[str]) -> None:
    out = tmp_path / "demo"
    code = main(["--out-dir", str(out), "--sessions", str(tmp_path / "absent.parquet"), *TINY, *caches,
                 "--lending", "storage-offload"])
    assert code == 0
    rates, knees = (json.loads(Path(caches[k]).read_text()) for k in (1, 3))
    assert len(rates) == 1  # one overload rate for both lending switches: the same arrivals
    assert {entry["lending"] for entry in knees.values()} == {"none", "storage-offload"}
    assert "| | lending-off | lending-on |" in (out / "summary.md").read_text()
    assert json.loads((out / "calibration-storage-offload.json").read_text())["lending"] == "storage-offload"
    offloaded = {mode: any((out / "storage" / mode).rglob("*-*-*-*")) for mode in ("lending-off", "lending-on")}
    decode_logs = (out / "logs" / "lending-on").glob("decode*.log")
    assert all(run["status"] == "finished" for mode in ("lending-off", "lending-on")
               for run in json.loads((out / f"run-{mode}.json").read_text())["sessions"])
    assert offloaded == {"lending-off": True, "lending-on": True} and list(decode_logs)  # prefill backs up in both

"""The live knee ramp: step measurement from scrapes and samples, a ramp against a fake engine whose cache
forgets sessions beyond its capacity (a knee between the first and last steps), the calibration file."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from basin_loadgen.live_ramp import calibration_record, gauge_total, main, measure_step, run_live_ramp, total_counters
from basin_loadgen.metrics_scrape import TokenCounters
from basin_loadgen.replay import ConversationBuilder, RateSchedule, plan_sessions
from basin_loadgen.replay_client import ClientSettings, ReplayError
from basin_loadgen.replay_summary import CallRecord, SessionRecord, StateSample
from basin_runtime.calibration import load_calibration
from basin_runtime.session_table import write_sessions
from basin_runtime.tokenizer import get_tokenizer
from basin_sim.experiments.calibrate.ramp import RampStep, ramp_knee
from tests.loadgen.fake_openai import FakeEngine, FakeServer, running_fake
from tests.sim.builders import session

TOKENIZER = get_tokenizer()
ENGINE_A = ('sglang:prefill_effective_tokens_total{mode="device_hit"} 300\n'
            'sglang:prefill_effective_tokens_total{mode="compute"} 700\n'
            '# HELP sglang:max_total_num_tokens capacity\nsglang:max_total_num_tokens{model_name="m"} 5000\n')
ENGINE_B = ('sglang:prefill_effective_tokens_total{mode="host_hit"} 100\n'
            'sglang:prefill_effective_tokens_total{mode="compute"} 100\nsglang:max_total_num_tokens 3000.0\n')


def test_counters_and_capacity_sum_over_engines() -> None:
    assert total_counters([ENGINE_A, ENGINE_B], ["a", "b"]) == TokenCounters(400.0, 1200.0)
    assert gauge_total(ENGINE_A, "sglang:max_total_num_tokens") == 5000.0
    assert gauge_total(ENGINE_A + ENGINE_B, "sglang:max_total_num_tokens") == 8000.0
    assert gauge_total(ENGINE_A, "sglang:num_running_reqs") is None
    with pytest.raises(ReplayError, match=r"^b: no sglang"):
        total_counters([ENGINE_A, "up 1\n"], ["a", "b"])


def test_a_step_is_measured_over_its_second_half() -> None:
    calls = [CallRecord(0, 4.0, 100, 100, 5, 4.1, 4.5, 5.0), CallRecord(1, 12.0, 200, 200, 5, 12.1, 12.5, 13.0),
             CallRecord(2, 18.0, 300, 300, 5, 18.1, 18.5, None, error="HTTP 500")]
    done = SessionRecord("a", "p", "b", 4.0, 2, status="finished", end_s=13.0, calls=calls[:2])
    failed = SessionRecord("b", "p", "b", 18.0, 1, status="error", end_s=18.6, calls=calls[2:])
    samples = [StateSample(t, live, 0, busy, ws) for t, live, busy, ws in
               [(9.0, 9, 9, 9_000), (10.0, 2, 1, 2_000), (15.0, 4, 1, 4_000), (20.0, 9, 9, 9_000)]]
    step = measure_step(0.5, 10.0, 20.0, TokenCounters(100, 1000), TokenCounters(400, 2000), samples,
                        [done, failed], 10_000)
    # one first token in the second half (12.0 -> 12.5), one session done there (4.0 -> 13.0, 2 calls)
    assert step == RampStep(0.5, 0.3, 0.3, 3.0, 0.1, 0.1, 1 / 3, ttft_p50_s=0.5, call_cycle_p50_s=4.5)
    idle = measure_step(0.5, 10.0, 20.0, TokenCounters(1, 1), TokenCounters(1, 1), [], [], 10_000)
    assert (idle.hit_rate, idle.load, idle.live_sessions, idle.decode_busy_share) == (0.0, 0.0, 0.0, 0.0)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with running_fake() as server:
        yield server


@pytest.fixture
def engine(fake: FakeServer) -> FakeEngine:
    return fake.engine.reset(capacity_tokens=8_000)


POOL = [session(f"s{k}", [600 + 300 * i for i in range(5)], completion=20, gap_s=5.0) for k in range(10)]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_ramp_past_the_engines_cache_finds_a_knee_and_writes_a_calibration_the_gateway_reads(
        fake: FakeServer, engine: FakeEngine, tmp_path: Path) -> None:
    rates, step_s = [0.05, 0.1, 0.4, 0.8], 40.0
    plan = plan_sessions(POOL, RateSchedule.steps(rates, step_s), 1, "ramp")
    settings = ClientSettings(fake.base_url, time_scale=25.0, sample_s=1.0)
    seen: list[int] = []
    result = await run_live_ramp(settings, ConversationBuilder(POOL, TOKENIZER, "ramp"), plan, rates, step_s,
                                 [f"{fake.url}/metrics"], on_step=lambda k, _: seen.append(k))

    steps = result.steps
    assert seen == [0, 1, 2, 3] and [s.rate_per_s for s in steps] == rates
    assert result.capacity_tokens == 8_000  # from sglang:max_total_num_tokens
    assert steps[0].load < 0.5 and steps[0].hit_rate > 0.5  # calls 2..5 of a session hit (at most 0.7)
    assert steps[-1].load > 1.5 and steps[-1].hit_rate < 0.2  # the fake forgets sessions before they return
    assert steps[0].live_sessions < steps[-1].live_sessions
    knee = ramp_knee(steps)
    assert not knee.is_censored and steps[0].load < knee.load < steps[-1].load
    record = calibration_record(steps, result.capacity_tokens, "test ramp", step_s)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(record))
    calibration = load_calibration(path)
    assert calibration.cache_capacity_tokens == 8_000
    assert calibration.knee_tokens == pytest.approx(knee.load * 8_000, abs=1)
    assert calibration.hit_rate_plateau == pytest.approx(knee.plateau_hit_rate, abs=1e-4)
    assert "live stepped ramp (4 steps of 40 model s)" in record["notes"]


def test_the_cli_prints_each_step_and_writes_the_calibration(fake: FakeServer, engine: FakeEngine, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    table, out = tmp_path / "pool.parquet", tmp_path / "calibration.json"
    write_sessions(table, POOL)
    code = main(["--base-url", fake.base_url, "--engine-metrics", f"{fake.url}/metrics", "--rates", "0.1", "0.2",
                 "--step-s", "10", "--time-scale", "25", "--sessions", str(table), "--run-tag", "cli",
                 "--cache-capacity-tokens", "50000", "--out", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0
    lines = printed.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith("step ")] == [["step", "1/2"], ["step", "2/2"]]
    assert any(line.startswith("knee at load") for line in lines)
    calibration = load_calibration(out)
    assert calibration.cache_capacity_tokens == 50_000 and calibration.knee_tokens > 0


def test_an_unreachable_metrics_url_is_named(fake: FakeServer, engine: FakeEngine, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    table = tmp_path / "pool.parquet"
    write_sessions(table, POOL)
    with pytest.raises(SystemExit) as exited:
        main(["--base-url", fake.base_url, "--engine-metrics", url, "--rates", "0.1", "0.2", "--step-s", "10",
              "--sessions", str(table), "--quiet"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"cannot scrape {url}" in err and "Traceback" not in err

"""The risk test (`basin-sim risk`) and the limits ramp (`basin-sim ramp`): formula, first limit, JSON, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_sim.experiments.calibrate.fluid import SGLANG_RESERVED_DECODE_TOKENS, risk_test
from basin_sim.experiments.calibrate.ramp import RampStep, is_decode_full, ramp_limits, run_ramp
from basin_sim.experiments.cli import main
from basin_sim.timeline import Sample, Timeline
from tests.sim.builders import deployment, seeded_files, session


def test_the_decode_limit_counts_context_plus_sglangs_headroom_for_the_share_held() -> None:
    assert SGLANG_RESERVED_DECODE_TOKENS == 512  # --num-reserved-decode-tokens' default
    # A live session holds (10,000 + 512) x 0.4 = 4,204.8 decode tokens on average: 2.6M / 4,204.8 = 618.3.
    verdict = risk_test(knee_tokens=1_000_000, mean_context_tokens=10_000, decode_capacity_tokens=2_600_000,
                        decode_holding_share=0.4)
    assert verdict.decode_tokens_per_session == pytest.approx(4_204.8)
    assert verdict.decode_limit_sessions == pytest.approx(618.3409, rel=1e-6)
    assert verdict.cache_limit_sessions == pytest.approx(100.0)
    assert verdict.verdict == "cache-first"
    # The headroom matters for short contexts: 1,000-token sessions always held hold 1,512 each.
    short = risk_test(200_000, 1_000, 300_000, 1.0)
    assert short.decode_limit_sessions == pytest.approx(300_000 / 1_512)
    assert short.cache_limit_sessions == pytest.approx(200.0) and short.verdict == "decode-first"
    assert risk_test(1_000, 10, 1_000, 1.0, headroom_tokens=90).verdict == "decode-first"  # equal: not shown


@pytest.mark.parametrize(("args", "message"), [
    ((0.0, 10.0, 10.0, 0.5), "knee_tokens"),
    ((10.0, -1.0, 10.0, 0.5), "mean_context_tokens"),
    ((10.0, 10.0, 10.0, 0.0), "holding share"),
    ((10.0, 10.0, 10.0, 1.5), "holding share"),
])
def test_the_risk_test_refuses_bad_sizes_and_shares_naming_them(args: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        risk_test(*args)


def _step(hit: float, load: float, memory: float = 0.1, queued: float = 0.0) -> RampStep:
    return RampStep(0.1, load, hit, 10.0, 1.0, 0.1, 0.3, None, memory, queued, 0.4)


def test_first_limit_is_the_earlier_step_and_says_where_each_limit_was_hit() -> None:
    d = deployment(num_decode=2)
    plateau = [_step(0.95, 0.2), _step(0.96, 0.4), _step(0.95, 0.6)]
    cache = ramp_limits([*plateau, _step(0.5, 1.2), _step(0.3, 2.0, memory=0.97)], d)
    assert (cache.first_limit, cache.cache_step, cache.decode_step) == ("cache", 3, 4)
    decode = ramp_limits([*plateau, _step(0.95, 0.8, queued=2.0), _step(0.4, 2.0)], d)
    assert (decode.first_limit, decode.cache_step, decode.decode_step) == ("decode", 4, 3)
    neither = ramp_limits([*plateau, _step(0.94, 0.8, memory=0.949, queued=1.99)], d)
    assert (neither.first_limit, neither.cache_step, neither.decode_step) == ("none", None, None)
    tie = ramp_limits([*plateau, _step(0.5, 1.2, memory=0.99), _step(0.3, 2.0, memory=0.99)], d)
    assert (tie.first_limit, tie.cache_step, tie.decode_step) == ("decode", 3, 3)  # no timeline: not shown


def _minutes(low_from: int, full_from: int, d_tokens: int) -> Timeline:
    """A timeline of the step [900, 1200) s: hit rate 0.3 from minute `low_from`, decode full from `full_from`."""
    timeline = Timeline(60.0)
    for minute in range(20):
        k = minute - 15
        timeline.record_prefill(minute * 60.0 + 1, 1_000, 300 if k >= low_from else 950, 0)
        in_use = d_tokens if k >= full_from else d_tokens // 2
        timeline.record_sample(Sample(minute * 60.0 + 30, 10, 0, 0, 0, 0, 0, 0, 0, 0, 1, in_use))
    return timeline


def test_a_same_step_tie_goes_to_the_limit_whose_minutes_come_first() -> None:
    d = deployment()
    steps = [_step(0.95, 0.2), _step(0.96, 0.4), _step(0.95, 0.6), _step(0.5, 1.2, memory=0.99),
             _step(0.3, 2.0, memory=0.99)]
    early_cache = ramp_limits(steps, d, _minutes(low_from=1, full_from=3, d_tokens=100_000), 300.0)
    assert (early_cache.first_limit, early_cache.is_tie_broken_by_minute) == ("cache", True)
    early_decode = ramp_limits(steps, d, _minutes(low_from=2, full_from=1, d_tokens=100_000), 300.0)
    assert (early_decode.first_limit, early_decode.cache_step, early_decode.decode_step) == ("decode", 3, 3)
    same_minute = ramp_limits(steps, d, _minutes(low_from=2, full_from=2, d_tokens=100_000), 300.0)
    assert same_minute.first_limit == "decode"  # still tied: cache-first is not shown


def test_decode_is_full_at_95_percent_in_use_or_one_queued_request_per_instance() -> None:
    assert is_decode_full(_step(0.9, 0.1, memory=0.95), 1)
    assert not is_decode_full(_step(0.9, 0.1, memory=0.94, queued=2.9), 3)
    assert is_decode_full(_step(0.9, 0.1, queued=3.0), 3)


POOL = [session(f"s{k}", [2_000 + 1_000 * i for i in range(8)], completion=50, gap_s=5.0) for k in range(20)]
RATES = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]


def test_a_tiny_decode_memory_is_the_first_limit() -> None:
    d = deployment(cache_tokens=5_000_000, decode_tokens=30_000)
    timeline = Timeline(60.0)
    steps = run_ramp(d, POOL, RATES, step_s=240.0, timeline=timeline)
    limits = ramp_limits(steps, d, timeline, 240.0)
    assert limits.first_limit == "decode" and limits.cache_step is None and limits.decode_step is not None
    assert max(s.decode_memory_share for s in steps) <= 1.0
    assert steps[limits.decode_step].prealloc_queued >= 1 or steps[limits.decode_step].decode_memory_share >= 0.95


def test_a_tiny_prefill_cache_is_the_first_limit() -> None:
    d = deployment(cache_tokens=40_000, decode_tokens=50_000_000)
    timeline = Timeline(60.0)
    steps = run_ramp(d, POOL, RATES, step_s=240.0, timeline=timeline)
    limits = ramp_limits(steps, d, timeline, 240.0)
    assert limits.first_limit == "cache" and limits.cache_step is not None and limits.decode_step is None
    assert steps[limits.cache_step].hit_rate < limits.knee.plateau_hit_rate - 0.05
    assert all(s.decode_holding_share is not None and 0 <= s.decode_holding_share <= 1 for s in steps)
    # Past the knee requests wait for prefill with their decode memory pre-allocated: held, not decoding.
    last = steps[-1]
    assert last.decode_holding_share is not None and last.decode_holding_share > 0.8 > 0.1 > last.decode_busy_share


DEPLOYMENT = """name: tiny
profile: h100-qwen3.6-35b-a3b
num_prefill: 1
num_decode: 1
cache: gpu
"""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return seeded_files(tmp_path, DEPLOYMENT)


def _argv(command: str, files: dict[str, str], *extra: str) -> list[str]:
    return [command, "--deployment", files["deployment"], "--sessions", files["sessions"], "--quiet",
            "--rates-file", files["rates"], "--step-s", "300", "--fractions", "0.5", "1", "2", *extra]


def test_risk_json_is_one_object_with_the_verdict_and_both_limits(
        files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv("risk", files, "--json")) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["verdict"] in ("cache-first", "decode-first") and record["deployment"] == "tiny"
    assert record["decode_capacity_tokens"] == 1_300_000 and record["decode_headroom_tokens"] == 512
    held = (record["mean_context_tokens"] + 512) * record["decode_holding_share"]
    assert record["decode_tokens_per_session"] == pytest.approx(held)
    assert record["decode_limit_sessions"] == pytest.approx(1_300_000 / held)
    assert record["cache_limit_sessions"] == pytest.approx(record["knee_tokens"] / record["mean_context_tokens"])
    assert (record["cache_limit_sessions"] < record["decode_limit_sessions"]) == (record["verdict"] == "cache-first")
    assert record["overload_rate_per_s"] == 0.1 and record["fractions_of_overload_rate"] == [0.5, 1.0, 2.0]
    assert 0 < record["decode_holding_share"] <= 1
    in_engine = record["engine_decode_tokens_per_session"]  # the diagnostic: what the engine itself held
    assert in_engine > 0 and record["engine_decode_limit_sessions"] == pytest.approx(1_300_000 / in_engine)


def test_ramp_json_has_every_step_and_the_first_limit(files: dict[str, str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv("ramp", files, "--json")) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["first_limit"] in ("cache", "decode", "none")
    assert [s["index"] for s in record["steps"]] == [0, 1, 2]
    assert [s["rate_per_s"] for s in record["steps"]] == pytest.approx([0.05, 0.1, 0.2])
    assert record["thresholds"] == {"decode_memory_share": 0.95, "prealloc_queued_per_decode_instance": 1.0,
                                    "hit_rate_tolerance": 0.05, "confirm_steps": 2}
    for step in record["steps"]:
        assert 0 <= step["decode_memory_share"] <= 1 and step["prealloc_queued"] >= 0 and 0 <= step["hit_rate"] <= 1
    limit_steps = {"cache": record["cache_limit_step"], "decode": record["decode_limit_step"]}
    if record["first_limit"] == "none":
        assert limit_steps == {"cache": None, "decode": None}
    else:
        assert limit_steps[record["first_limit"]] is not None


def test_ramp_prints_a_line_per_step_without_json(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv("ramp", files)) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["0", "1", "2"]
    assert lines[-1].startswith("tiny: first limit ")


@pytest.mark.parametrize(("extra", "message"), [
    (["--fractions", "1"], "--fractions needs at least 2 rates"),
    (["--fractions", "0.5", "-1"], "--fractions needs at least 2 rates"),
    (["--step-s", "60"], "--step-s must be >= 120"),
    (["--tool-time-scale", "-1"], "--tool-time-scale must be >= 0"),
])
def test_bad_ramp_settings_exit_2_naming_the_option(files: dict[str, str], capsys: pytest.CaptureFixture[str],
                                                    extra: list[str], message: str) -> None:
    for command in ("risk", "ramp"):
        with pytest.raises(SystemExit) as info:
            main(_argv(command, files, *extra))
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_an_unknown_deployment_exits_2_listing_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("risk", "ramp"):
        with pytest.raises(SystemExit) as info:
            main([command, "--deployment", "9p9d", "--quiet", "--json"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "unknown deployment '9p9d'" in err and "1p3d-h100" in err

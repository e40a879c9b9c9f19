"""The knee on a small simulated ramp; hit rate from scraped /metrics text."""

from __future__ import annotations

import pytest

from basin_loadgen.metrics_scrape import TokenCounters, parse_counters, window_hit_rate
from basin_sim.experiments.calibrate.ramp import ramp_knee, run_ramp
from tests.sim.builders import deployment, session

SCRAPE = """# HELP sglang:prefill_effective_tokens_total Prefill tokens by where they came from
# TYPE sglang:prefill_effective_tokens_total counter
sglang:prefill_effective_tokens_total{engine_type="unified",mode="device_hit",model_name="q"} 900.0
sglang:prefill_effective_tokens_total{engine_type="unified",mode="host_hit",model_name="q"} 50.0
sglang:prefill_effective_tokens_total{engine_type="unified",mode="compute",model_name="q"} 50.0
sglang:cached_tokens_total{cache_source="device"} 1.0
"""


def test_metrics_text_gives_cached_and_total_tokens_and_a_window_hit_rate() -> None:
    after = parse_counters(SCRAPE)
    assert after == TokenCounters(950.0, 1000.0)
    assert window_hit_rate(TokenCounters(450.0, 500.0), after) == pytest.approx(0.5 / 0.5 * 500 / 500 * 0.5 / 0.5)
    assert window_hit_rate(after, after) is None
    legacy = "sglang:cached_tokens_total{cache_source=\"device\"} 30\nsglang:prompt_tokens_total 100\n"
    assert parse_counters(legacy) == TokenCounters(30.0, 100.0)
    with pytest.raises(ValueError, match="prefill_effective"):
        parse_counters("up 1\n")


def test_a_ramp_past_the_cache_finds_a_knee_below_the_overloaded_steps() -> None:
    pool = [session(f"s{k}", [2_000 + 1_000 * i for i in range(8)], completion=50, gap_s=5.0) for k in range(20)]
    d = deployment(cache_tokens=60_000, decode_tokens=400_000)
    steps = run_ramp(d, pool, [0.05, 0.1, 0.2, 0.4, 0.8, 1.6], step_s=120.0)
    assert [s.rate_per_s for s in steps] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
    assert steps[0].hit_rate > 0.7 and steps[-1].load > 1.0
    knee = ramp_knee(steps)
    assert not knee.is_censored
    assert steps[0].load < knee.load < steps[-1].load


def test_the_ramp_measures_reservations_over_contexts_of_live_sessions() -> None:
    pool = [session(f"s{k}", [2_000 + 1_000 * i for i in range(8)], completion=50, gap_s=5.0) for k in range(20)]
    d = deployment(cache_tokens=60_000, decode_tokens=400_000)
    peak = 9_050  # the last prompt plus its answer: every live session's context is below it
    steps = run_ramp(d, pool, [0.05, 0.1, 0.2], step_s=120.0, reservations={s.session_id: peak for s in pool})
    for step in steps:
        assert step.reservation_ratio is not None
        # contexts run from 2,000 to 9,000 tokens, so the reserved peak is 1x..4.5x each context
        assert 1.0 < step.reservation_ratio < 4.6
    small = run_ramp(d, pool, [0.05], step_s=120.0, reservations={s.session_id: 1.0 for s in pool})
    assert small[0].reservation_ratio == 1.0  # reservations below the contexts hold the contexts
    assert run_ramp(d, pool, [0.05], step_s=120.0)[0].reservation_ratio is None

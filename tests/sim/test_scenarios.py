"""Whole runs on a small deployment: a surge pushes the working set over the cache and the hit rate
falls; the same seed gives the same summary; the run JSON's fields by hand-checkable numbers."""

from __future__ import annotations

import itertools

import pytest

from basin_sim.catalog import load_profile
from basin_sim.engine import Engine
from basin_sim.policies.fcfs import FcfsPolicy
from basin_sim.profile import Deployment
from basin_sim.simulate import RunResult, RunSpec, run_scenario
from basin_sim.workload.scenarios import PopulationSpec, RateStep, Scenario
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import deployment, session, spec

POOL = generate_corpus(3, 40)
CACHE_TOKENS = 200_000
SMALL = Deployment("small", load_profile("h100-qwen3.6-35b-a3b"), 1, 1, CACHE_TOKENS, 1_300_000)
WARMUP_S = 600.0


def run(surge_x: float | None, seed: int = 1, policy: str = "sglang") -> RunResult:
    steps = [RateStep(0.0, 1.0)]
    if surge_x:
        steps += [RateStep(600.0, surge_x), RateStep(1_800.0, 1.0)]
    scenario = Scenario("small", duration_s=3_000.0, warmup_s=WARMUP_S, goodput_from_s=1_800.0,
                        goodput_to_s=3_000.0, rate=tuple(steps))
    return run_scenario(RunSpec(scenario, SMALL, policy, seed, 0.03, max_drain_s=600.0), POOL)


def surge_window(result: RunResult) -> tuple[float, int]:
    start, end = WARMUP_S + 600.0, WARMUP_S + 1_800.0
    samples = [s.working_set_tokens for s in result.timeline.samples if start <= s.time_s < end]
    rate = result.timeline.hit_rate(start, end)
    assert rate is not None
    return rate, max(samples)


def test_a_surge_raises_the_working_set_over_the_cache_and_lowers_the_hit_rate() -> None:
    steady, surged = run(None), run(4.0)
    steady_hit, steady_ws = surge_window(steady)
    surge_hit, surge_ws = surge_window(surged)
    assert steady_ws < CACHE_TOKENS and steady_hit > 0.9
    assert surge_ws > 2 * CACHE_TOKENS and surge_hit < steady_hit - 0.3
    assert surged.summary["hit_rate_pre"] > 0.9  # the same before the surge
    assert not steady.summary["is_stuck"]


def test_the_same_seed_gives_the_same_summary() -> None:
    first, again, other = run(4.0, seed=7), run(4.0, seed=7), run(4.0, seed=8)
    assert first.summary == again.summary
    assert first.outcomes == again.outcomes
    assert other.summary != first.summary


def test_the_summary_counts_window_sessions_and_the_timeline_starts_after_warmup() -> None:
    result = run(4.0)
    summary, window = result.summary, (WARMUP_S + 1_800.0, WARMUP_S + 3_000.0)
    arrived = [o for o in result.outcomes if not o.is_burst and window[0] <= o.arrival_s < window[1]]
    assert summary["sessions_arrived"] == len(arrived) > 0
    assert summary["goodput_per_hour"] == pytest.approx(summary["sessions_good"] / (1_200.0 / 3600.0))
    assert summary["base_rate_per_s"] == pytest.approx(0.03)
    timeline = summary["timeline"]
    assert timeline[0]["t_s"] == 0.0 and [e["t_s"] for e in timeline[:3]] == [0.0, 60.0, 120.0]
    assert len(timeline) == int(summary["simulated_s"] // 60)
    after_warmup = [o for o in result.outcomes if WARMUP_S <= o.arrival_s < WARMUP_S + 60.0 * len(timeline)]
    assert sum(e["arrivals"] for e in timeline) == len(after_warmup)  # warm-up arrivals are in no minute
    assert all(e["cache_tokens"] == CACHE_TOKENS for e in timeline)
    assert result.timeline.hit_rate(WARMUP_S, WARMUP_S + 60.0) == timeline[0]["hit_rate"]


def test_the_prefill_busy_fraction_is_batch_time_over_the_window() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000])))  # one uncached 2,000-token prefill: 10 ms + 2,000 x 0.1 ms
    engine.run_until(100.0)
    (batch,) = engine.prefill[0].busy_intervals
    assert batch == (0.0, pytest.approx(0.21))
    assert engine.prefill[0].busy_s(0.0, 100.0) == pytest.approx(0.21)
    assert engine.prefill[0].busy_s(0.1, 100.0) == pytest.approx(0.11)  # only the overlap counts
    summary = run(4.0).summary
    assert 0 < summary["prefill_busy_fraction"] <= 1


def _tiny_run(scenario: Scenario, dep: Deployment, pool: list, seed: int = 1) -> RunResult:  # type: ignore[type-arg]
    return run_scenario(RunSpec(scenario, dep, "sglang", seed, 0.0, max_drain_s=600.0), pool)


def test_a_closed_population_keeps_its_agents_busy_back_to_back() -> None:
    # One agent, one kind of session (two calls, 100 tokens each answer, a 1 s tool gap): alone on the
    # tiny deployment it takes its unloaded time, so each session starts when the last one ends.
    pool = [session("only", [2_000, 2_300], completion=100, gap_s=1.0)]
    scenario = Scenario("closed", duration_s=600.0, warmup_s=60.0, goodput_from_s=0.0, goodput_to_s=600.0,
                        population=PopulationSpec(agents=1))
    result = _tiny_run(scenario, deployment(), pool)
    runs = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert all(b.arrival_s == pytest.approx(a.ended_s) for a, b in itertools.pairwise(runs))
    summary = result.summary
    in_window = [o for o in runs if 60.0 <= o.arrival_s < 660.0]
    assert summary["sessions_arrived"] == len(in_window) == summary["sessions_good"]  # alone: all good
    assert summary["goodput_per_hour"] == pytest.approx(len(in_window) / (600.0 / 3600.0))
    assert summary["sessions_shed"] == summary["sessions_abandoned"] == 0
    assert 0 < summary["first_call_wait_p50_s"] <= 0.217  # prefill 0.21 s + transfer 0.007 s at most
    assert all(e["live_sessions"] <= 1 for e in summary["timeline"])


def test_three_prefills_share_the_calls_and_the_json_has_every_field() -> None:
    pool = generate_corpus(3, 20)
    three = deployment(cache_tokens=400_000, decode_tokens=2_000_000, num_prefill=3, num_decode=2)
    scenario = Scenario("steady", duration_s=1_200.0, warmup_s=120.0, goodput_from_s=300.0, goodput_to_s=1_200.0,
                        rate=(RateStep(0.0, 1.0),))
    summary = run_scenario(RunSpec(scenario, three, "sglang", 1, 0.05, max_drain_s=300.0), pool).summary
    shares = summary["prefill_share"]
    assert len(shares) == 3 and sum(shares) == pytest.approx(1.0) and min(shares) > 0.15
    for key in ("goodput_per_hour", "sessions_arrived", "sessions_good", "sessions_shed", "sessions_abandoned",
                "base_rate_per_s", "hit_rate_pre", "hit_rate_post", "first_call_wait_p50_s", "ttft_p50_post_s",
                "prefill_busy_fraction", "recovered_after_s", "is_stuck", "timeline", "prefill_share"):
        assert key in summary, key
    entry = summary["timeline"][0]
    assert set(entry) == {"t_s", "hit_rate", "live_sessions", "live_burst_sessions", "held_sessions",
                          "working_set_tokens", "cache_tokens", "ttft_p50_s", "arrivals", "completions", "queued",
                          "timeouts", "retries"}
    assert entry["cache_tokens"] == 3 * 400_000 and summary["base_rate_per_s"] == pytest.approx(0.05)

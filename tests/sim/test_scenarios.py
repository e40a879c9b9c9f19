"""Whole runs on a small deployment: a surge pushes the working set over the cache and the hit rate
falls; the same seed gives the same summary."""

from __future__ import annotations

from basin_sim.catalog import load_profile
from basin_sim.profile import Deployment
from basin_sim.simulate import RunResult, RunSpec, run_scenario
from basin_sim.workload.scenarios import Scenario, Surge
from basin_sim.workload.synthetic import generate_corpus

POOL = generate_corpus(3, 40)
CACHE_TOKENS = 200_000
SMALL = Deployment("small", load_profile("h100-qwen3.6-35b-a3b"), 1, 1, CACHE_TOKENS, 1_300_000)


def run(surge_factor: float | None, seed: int = 1, policy: str = "sglang") -> RunResult:
    surge = Surge(1_200.0, 2_400.0, surge_factor) if surge_factor else None
    scenario = Scenario("small", "", duration_s=3_600.0, warmup_s=600.0, window_start_s=2_400.0,
                        load_fraction=1.0, surge=surge)
    return run_scenario(RunSpec(scenario, SMALL, policy, seed, 0.03, max_drain_s=600.0), POOL)


def surge_window(result: RunResult) -> tuple[float, int]:
    samples = [s.working_set_tokens for s in result.timeline.samples if 1_200.0 <= s.time_s < 2_400.0]
    rate = result.timeline.hit_rate(1_200.0, 2_400.0)
    assert rate is not None
    return rate, max(samples)


def test_a_surge_raises_the_working_set_over_the_cache_and_lowers_the_hit_rate() -> None:
    steady, surged = run(None), run(4.0)
    steady_hit, steady_ws = surge_window(steady)
    surge_hit, surge_ws = surge_window(surged)
    assert steady_ws < CACHE_TOKENS and steady_hit > 0.9
    assert surge_ws > 2 * CACHE_TOKENS and surge_hit < steady_hit - 0.3
    assert surged.summary["hit_rate_pre"] > 0.9  # the same before the surge
    assert surged.summary["collapse_after_s"] is not None and steady.summary["collapse_after_s"] is None


def test_the_same_seed_gives_the_same_summary() -> None:
    first, again, other = run(4.0, seed=7), run(4.0, seed=7), run(4.0, seed=8)
    assert first.summary == again.summary
    assert first.outcomes == again.outcomes
    assert other.summary != first.summary
    for key in ("goodput_per_hour", "hit_rate_pre", "hit_rate_post", "sessions_arrived", "sessions_good"):
        assert key in first.summary

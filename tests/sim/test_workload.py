"""Workloads: Poisson arrivals with surges, kill-bursts of short sessions, shared prefixes, gaps."""

from __future__ import annotations

import pytest

from basin_runtime.session_table import Call, Session
from basin_sim.workload.scenarios import (
    DEFAULT_GAP_S,
    Burst,
    Scenario,
    ScenarioError,
    Surge,
    generate_sessions,
    shared_prefix_tokens,
    to_spec,
)
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import session

POOL = generate_corpus(3, 30)
SURGE = Scenario("s", "", duration_s=20_000.0, warmup_s=0.0, window_start_s=15_000.0,
                 surge=Surge(5_000.0, 15_000.0, 3.0))


def count(specs: list, start: float, end: float) -> int:  # type: ignore[type-arg]
    return sum(start <= s.arrival_s < end and not s.is_burst for s in specs)


def test_arrivals_follow_the_rate_and_triple_in_the_surge() -> None:
    specs = generate_sessions(SURGE, POOL, 0.1, seed=1)
    before, during, after = count(specs, 0, 5_000), count(specs, 5_000, 15_000), count(specs, 15_000, 20_000)
    assert 500 * 0.8 < before < 500 * 1.2  # Poisson(500): +-20% is > 4 sd
    assert 3_000 * 0.9 < during < 3_000 * 1.1
    assert 500 * 0.8 < after < 500 * 1.2
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert len({s.session_id for s in specs}) == len(specs)


def test_the_same_seed_gives_the_same_sessions_and_a_burst_does_not_move_them() -> None:
    base = generate_sessions(SURGE, POOL, 0.05, seed=4)
    assert generate_sessions(SURGE, POOL, 0.05, seed=4) == base
    assert generate_sessions(SURGE, POOL, 0.05, seed=5) != base
    burst = Scenario("b", "", 20_000.0, 0.0, 15_000.0, surge=SURGE.surge, burst=Burst(1_000.0, 2_000.0, 4.0, 3, True))
    with_burst = generate_sessions(burst, POOL, 0.05, seed=4)
    assert [s for s in with_burst if not s.is_burst] == base


def test_burst_sessions_are_short_and_flagged() -> None:
    scenario = Scenario("b", "", 5_000.0, 0.0, 3_000.0, burst=Burst(1_000.0, 3_000.0, 10.0, 3, True))
    burst = [s for s in generate_sessions(scenario, POOL, 0.05, seed=2) if s.is_burst]
    assert 1_000 * 0.8 < len(burst) < 1_000 * 1.2
    assert all(1_000.0 <= s.arrival_s < 3_000.0 and s.session.n_calls <= 3 for s in burst)
    assert any(s.session.n_calls == 3 for s in burst)


def test_shared_prefix_is_the_smallest_first_prompt_and_missing_gaps_get_the_default() -> None:
    pool = [session("a", [3_000, 4_000]), session("b", [2_500, 2_600], benchmark="other"),
            session("c", [2_000], benchmark="bench")]
    assert shared_prefix_tokens(pool) == {"bench": 2_000, "other": 2_500}
    calls = (Call(3_000, 100, gap_s=7.0), Call(3_500, 100, gap_s=None), Call(4_000, 100))
    trace = Session("d", "bench", "test", "agent", "model", "task-d", "a task", "", "t", calls)
    assert to_spec("d", trace, 0.0, {"bench": 2_000}).gaps_s == (7.0, DEFAULT_GAP_S)

def test_inconsistent_scenarios_are_refused() -> None:
    with pytest.raises(ScenarioError, match="window_start_s"):
        Scenario("x", "", duration_s=100.0, warmup_s=0.0, window_start_s=200.0)
    with pytest.raises(ScenarioError, match="must end by window_start_s"):
        Scenario("x", "", 1_000.0, 0.0, 500.0, surge=Surge(100.0, 600.0, 2.0))

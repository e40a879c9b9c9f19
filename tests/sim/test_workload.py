"""Workloads: piecewise-constant Poisson arrivals, bursts drawn by unloaded time, shared prefixes, gaps."""

from __future__ import annotations

import statistics

import pytest

from basin_runtime.session_table import Call, Session
from basin_sim.workload.pool import scaled, token_scale, workload_pool
from basin_sim.workload.scenarios import (
    DEFAULT_GAP_S,
    BurstSpec,
    PopulationSpec,
    RateStep,
    Scenario,
    ScenarioError,
    WorkloadSpec,
    burst_kills,
    generate_sessions,
    shared_prefix_tokens,
    to_spec,
)
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import session

POOL = generate_corpus(3, 30)
SURGE = Scenario("s", duration_s=20_000.0, warmup_s=1_200.0, goodput_from_s=15_000.0, goodput_to_s=20_000.0,
                 rate=(RateStep(0.0, 1.0), RateStep(5_000.0, 3.0), RateStep(15_000.0, 1.0)))
UNLOADED = {s.session_id: 60.0 * s.n_calls for s in POOL}  # a stand-in unloaded time: one minute a call


def unloaded(s: Session) -> float:
    return UNLOADED[s.session_id]


def count(specs: list, start: float, end: float) -> int:  # type: ignore[type-arg]
    return sum(start <= s.arrival_s < end and not s.is_burst for s in specs)


def test_arrivals_follow_the_rate_steps_in_engine_time_with_warmup_at_the_first_rate() -> None:
    specs = generate_sessions(SURGE, POOL, 0.1, seed=1)
    warmup, before = count(specs, 0, 1_200), count(specs, 1_200, 6_200)
    during, after = count(specs, 6_200, 16_200), count(specs, 16_200, 21_200)
    assert 120 * 0.6 < warmup < 120 * 1.4  # Poisson(120): +-40% is > 4 sd
    assert 500 * 0.8 < before < 500 * 1.2  # Poisson(500): +-20% is > 4 sd
    assert 3_000 * 0.9 < during < 3_000 * 1.1
    assert 500 * 0.8 < after < 500 * 1.2
    assert count(specs, 21_200, 1e9) == 0  # arrivals stop at duration_s
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert len({s.session_id for s in specs}) == len(specs)


def test_the_same_seed_gives_the_same_sessions_and_a_burst_does_not_move_them() -> None:
    base = generate_sessions(SURGE, POOL, 0.05, seed=4)
    assert generate_sessions(SURGE, POOL, 0.05, seed=4) == base
    assert generate_sessions(SURGE, POOL, 0.05, seed=5) != base
    burst = Scenario("b", 20_000.0, 1_200.0, 15_000.0, 20_000.0, rate=SURGE.rate,
                     bursts=(BurstSpec(1_000.0, 2_000.0, 4.0, 1e9),))
    with_burst = generate_sessions(burst, POOL, 0.05, seed=4, unloaded_s=unloaded)
    assert [s for s in with_burst if not s.is_burst] == base


def test_bursts_draw_whole_sessions_by_unloaded_time_on_their_own_streams_and_are_killed() -> None:
    limit = 60.0 * 8  # sessions of at most 8 calls
    two = (BurstSpec(1_000.0, 3_000.0, 10.0, limit, kill_at_s=3_000.0), BurstSpec(4_000.0, 5_000.0, 10.0, 1e9))
    scenario = Scenario("b", 6_000.0, 0.0, 5_000.0, 6_000.0, rate=(RateStep(0.0, 1.0),), bursts=two)
    specs = generate_sessions(scenario, POOL, 0.05, seed=2, unloaded_s=unloaded)
    first = [s for s in specs if s.session_id.startswith("burst0-")]
    second = [s for s in specs if s.session_id.startswith("burst1-")]
    assert 1_000 * 0.8 < len(first) < 1_000 * 1.2 and 500 * 0.7 < len(second) < 500 * 1.3
    assert all(1_000.0 <= s.arrival_s < 3_000.0 and s.is_burst for s in first)
    pool_calls = {s.session_id: s.n_calls for s in POOL}
    assert all(s.session.n_calls == pool_calls[s.session.session_id] <= 8 for s in first)  # never truncated
    alone = generate_sessions(Scenario("b", 6_000.0, 0.0, 5_000.0, 6_000.0, rate=(RateStep(0.0, 1.0),),
                                       bursts=two[:1]), POOL, 0.05, seed=2, unloaded_s=unloaded)
    assert [s for s in alone if s.is_burst] == first  # the second burst's stream does not move the first's
    assert burst_kills(scenario, specs) == [(3_000.0, [s.session_id for s in first])]


def test_a_burst_with_too_few_candidates_is_an_error_naming_it() -> None:
    scenario = Scenario("b", 6_000.0, 0.0, 5_000.0, 6_000.0, rate=(RateStep(0.0, 1.0),),
                        bursts=(BurstSpec(1_000.0, 2_000.0, 1.0, 59.0),))
    with pytest.raises(ScenarioError, match=r"bursts\[0\]: only 0 pool sessions .*max_unloaded_s=59"):
        generate_sessions(scenario, POOL, 0.05, seed=1, unloaded_s=unloaded)


def test_shared_prefix_is_the_smallest_first_prompt_and_missing_gaps_get_the_default() -> None:
    pool = [session("a", [3_000, 4_000]), session("b", [2_500, 2_600], benchmark="other"),
            session("c", [2_000], benchmark="bench")]
    assert shared_prefix_tokens(pool) == {"bench": 2_000, "other": 2_500}
    calls = (Call(3_000, 100, gap_s=7.0), Call(3_500, 100, gap_s=None), Call(4_000, 100))
    trace = Session("d", "bench", "test", "agent", "model", "task-d", "a task", "", "t", calls)
    assert to_spec("d", trace, 0.0, {"bench": 2_000}).gaps_s == (7.0, DEFAULT_GAP_S)


@pytest.mark.parametrize(("changes", "message"), [
    ({"goodput_to_s": 200.0}, "goodput_window needs"),
    ({"rate": (RateStep(10.0, 1.0),)}, r"rate\[0\].from_s must be 0"),
    ({"rate": (RateStep(0.0, 1.0), RateStep(0.0, 2.0))}, r"rate\[1\].from_s must grow"),
    ({"rate": (RateStep(0.0, -1.0),)}, r"rate\[0\].x_overload must be >= 0"),
    ({"rate": ()}, "exactly one of `rate`"),
    ({"population": PopulationSpec(3)}, "exactly one of `rate`"),
    ({"bursts": (BurstSpec(50.0, 150.0, 1.0, 10.0),)}, r"bursts\[0\]: need 0 <= from_s < to_s <= duration_s"),
    ({"bursts": (BurstSpec(10.0, 20.0, 1.0, 10.0, kill_at_s=5.0),)}, r"bursts\[0\]: kill_at_s"),
    ({"workload": WorkloadSpec(median_peak_tokens=0.5)}, r"workload.median_peak_tokens must be a number >= 1"),
    ({"workload": WorkloadSpec(preset="paper-terminal-bench", median_peak_tokens=9e4)}, r"\(not a preset\)"),
])
def test_inconsistent_scenarios_are_refused_naming_the_field(changes: dict, message: str) -> None:  # type: ignore[type-arg]
    fields = {"name": "x", "duration_s": 100.0, "warmup_s": 0.0, "goodput_from_s": 0.0, "goodput_to_s": 100.0,
              "rate": (RateStep(0.0, 1.0),), **changes}
    with pytest.raises(ScenarioError, match=message):
        Scenario(**fields)


def test_a_workload_scaled_to_a_median_peak_keeps_each_sessions_shape_at_the_new_size() -> None:
    base = generate_corpus(4, 60)
    workload = WorkloadSpec(benchmarks=("synthetic-swebench",), median_peak_tokens=100_000)
    chosen = [s for s in base if s.benchmark == "synthetic-swebench"]
    scale = token_scale(base, workload)
    assert scale == pytest.approx(100_000 / statistics.median(s.peak_prompt_tokens for s in chosen))
    pool = workload_pool(base, workload)
    recorded = workload_pool(base, WorkloadSpec(benchmarks=("synthetic-swebench",)))
    assert statistics.median(s.peak_prompt_tokens for s in pool) == pytest.approx(100_000, rel=1e-3)
    for big, small in zip(pool, recorded, strict=True):
        assert (big.session_id, big.task_text, big.n_calls) == (small.session_id, small.task_text, small.n_calls)
        assert [c.completion_tokens for c in big.calls] == [c.completion_tokens for c in small.calls]
        assert [c.gap_s for c in big.calls] == [c.gap_s for c in small.calls]  # tool time of the recorded session
        assert [c.prompt_tokens for c in big.calls] == [round(c.prompt_tokens * scale) for c in small.calls]
    assert token_scale(base, WorkloadSpec()) == 1.0 and scaled(chosen[0], 1.0) is chosen[0]


def test_the_pool_draws_sourced_tool_time_by_default_and_recorded_keeps_the_recorded_gaps() -> None:
    base = [session(f"t{k}", [1000, 1500, 2100, 2800], gap_s=0.04, benchmark="terminal-bench") for k in range(50)]
    recorded = workload_pool(base, WorkloadSpec(tool_time="recorded"))
    sourced = workload_pool(base, WorkloadSpec())
    assert all(c.gap_s == 0.04 for s in recorded for c in s.calls[:-1])  # print times, kept as recorded
    gaps = [c.gap_s for s in sourced for c in s.calls[:-1]]
    assert all(g is not None and g >= 0 for g in gaps) and len(set(gaps)) == len(gaps)  # drawn, one per step
    assert workload_pool(base, WorkloadSpec()) == sourced  # seeded by session id: the same in every pool
    with pytest.raises(ScenarioError, match=r"workload\.tool_time must be `sourced` or `recorded`"):
        Scenario("x", 600, 60, 0, 600, rate=(RateStep(0, per_min=1.0),), workload=WorkloadSpec(tool_time="timed"))

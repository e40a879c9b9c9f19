"""Continuum's public code (policies/continuum_fixed.py): the fixed 2 s pin, the slow-tool skip, the pin kept while
the job's next call waits, program-level FCFS with pinned jobs first, and where it parts from `continuum`."""

from __future__ import annotations

import pytest

from basin_sim.engine import Engine
from basin_sim.lifecycle import Stage, Status
from basin_sim.policies import ContinuumFixedTtlPolicy, ContinuumPolicy, PolicyContext, make_policy
from basin_sim.policies.continuum_fixed import FIXED_THRESHOLD_S
from tests.sim.builders import deployment, session, spec, until_answered


def _fixed() -> ContinuumFixedTtlPolicy:
    policy = make_policy("continuum-fixed-ttl", PolicyContext(deployment()))
    assert isinstance(policy, ContinuumFixedTtlPolicy)
    return policy


def test_a_fast_tool_gets_the_2_s_pin_and_it_goes_at_its_end_when_no_call_waits() -> None:
    policy = _fixed()
    engine = Engine(deployment(), policy, tick_s=0.05)
    assert engine.pins is policy
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=2.5), 0.0))  # first-seen tool: mean 0
    cache = engine.prefill[0].cache
    t = until_answered(engine, "a", 1, step=0.001)
    engine.run_until(t + FIXED_THRESHOLD_S - 0.1)
    assert cache.is_held("a") and cache.held_tokens > 0
    engine.run_until(t + FIXED_THRESHOLD_S + 0.1)
    assert not cache.is_held("a") and cache.pinned_tokens == 0  # ended at its TTL: the tool still runs


def test_a_fast_tool_is_pinned_after_every_call_but_the_last() -> None:
    policy = _fixed()
    engine = Engine(deployment(), policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=1.0), 0.0))
    engine.run_until(30.0)
    assert engine.runs["a"].status == Status.FINISHED
    report = policy.report()
    assert (pins := report.pins) is not None and (fixed := report.fixed_ttl) is not None
    assert pins.pin_answers == 2 and pins.pin_answer_share == 1.0 and pins.pin_ttl_mean_s == FIXED_THRESHOLD_S
    assert pins.pin_tool_time_share == 1.0 and fixed.pin_slow_tool_share == 0.0
    assert fixed.pin_held_mean_s == pytest.approx(1.0, abs=0.05)  # taken over by the next call after its 1 s tool
    assert engine.prefill[0].cache.pinned_tokens == 0


def test_no_pin_after_a_tool_whose_mean_gap_exceeds_2_s_for_any_job_calling_it() -> None:
    policy = _fixed()
    engine = Engine(deployment(), policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=3.0), 0.0))  # slow tool of benchmark "bench"
    t = until_answered(engine, "a", 2, step=0.001)  # the first gap (3 s) is seen: bench's mean is 3 s
    engine.run_until(t + 0.1)
    assert not engine.prefill[0].cache.is_held("a")
    engine.add(spec(session("b", [2_000, 3_000], gap_s=0.5), t + 0.2))  # same tool class: skipped too
    engine.add(spec(session("c", [2_000, 3_000], gap_s=0.5, benchmark="other"), t + 0.2))  # first-seen: pinned
    tb = until_answered(engine, "b", 1, step=0.001)
    engine.run_until(tb + 0.01)
    assert not engine.prefill[0].cache.is_held("b")
    engine.run_until(60.0)
    report = policy.report()
    assert (pins := report.pins) is not None and (fixed := report.fixed_ttl) is not None
    assert pins.pin_answers == 4 and pins.pin_answer_share == 0.5  # a's first and c's
    assert fixed.pin_slow_tool_share == 0.5  # a's second and b's
    assert pins.pin_ttl_mean_s == FIXED_THRESHOLD_S / 2


def _waiting_behind_a_long_prefill(policy: ContinuumPolicy | ContinuumFixedTtlPolicy) -> Engine:
    """a's second call comes 1 s after its answer, inside its pin, and waits ~4 s behind b's chunked prefill."""
    engine = Engine(deployment(), policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=1.0), 0.0))
    t = until_answered(engine, "a", 1, step=0.001)
    engine.add(spec(session("b", [40_000]), t + 0.5))  # ten 4,096-token chunks, 0.42 s each
    engine.run_until(t + FIXED_THRESHOLD_S + 0.5)
    return engine


def test_the_pin_outlives_its_ttl_while_the_jobs_next_call_waits() -> None:
    policy = _fixed()
    engine = _waiting_behind_a_long_prefill(policy)
    request = engine.runs["a"].request
    assert request is not None and request.stage == Stage.PREFILL_WAIT
    assert engine.prefill[0].cache.is_held("a") and policy.keeps_pin("a")  # past its 2 s end
    engine.run_until(30.0)
    assert engine.runs["a"].status == Status.FINISHED and not policy.keeps_pin("a")
    assert engine.prefill[0].cache.pinned_tokens == 0
    fixed = policy.report().fixed_ttl
    assert fixed is not None and fixed.pin_held_mean_s is not None and fixed.pin_held_mean_s > 4.0


def test_where_continuum_lets_the_pin_go_at_its_ttl_while_the_call_waits() -> None:
    policy = make_policy("continuum", PolicyContext(deployment(), pin_ttl_s=FIXED_THRESHOLD_S))
    assert isinstance(policy, ContinuumPolicy)
    engine = _waiting_behind_a_long_prefill(policy)
    request = engine.runs["a"].request
    assert request is not None and request.stage == Stage.PREFILL_WAIT
    assert not engine.prefill[0].cache.is_held("a")


def test_slow_tools_part_it_from_continuums_cold_start_which_pins_every_answer() -> None:
    d = deployment()
    runs = {}
    for name in ("continuum", "continuum-fixed-ttl"):
        policy = make_policy(name, PolicyContext(d))
        engine = Engine(d, policy, tick_s=0.05)
        engine.add(spec(session("a", [2_000, 3_000, 4_000, 5_000], gap_s=3.0), 0.0))
        engine.run_until(60.0)
        assert engine.runs["a"].status == Status.FINISHED
        runs[name] = policy.report().pins
    continuum, fixed = runs["continuum"], runs["continuum-fixed-ttl"]
    assert continuum is not None and fixed is not None
    assert continuum.pin_answer_share == 1.0  # T_default for every answer at cold start
    assert fixed.pin_answer_share == pytest.approx(1 / 3)  # only before the tool's first gap was seen


def test_program_level_fcfs_by_the_jobs_first_arrival_with_pinned_jobs_first() -> None:
    policy = _fixed()
    for job, at in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        policy.on_arrival(job, at, session(job, [1_000, 1_000, 1_000], gap_s=1.0))
    assert [policy.priority(j, 3.0) for j in "abc"] == [0.0, 1.0, 2.0]
    policy.ttl_after_answer_s("c", 10.0, 1_000)  # c pinned until 12 s
    policy.ttl_after_answer_s("a", 10.0, 1_000)  # a pinned until 12 s
    policy.ttl_after_answer_s("b", 10.0, 1_000)  # b pinned until 12 s
    policy.on_call("c", 11.0, 1_000)  # inside its pin
    policy.on_call("b", 11.5, 1_000)  # inside its pin
    policy.on_call("a", 12.5, 1_000)  # after its pin ended
    order = sorted("abc", key=lambda j: policy.priority(j, 12.5))
    assert order == ["b", "c", "a"]  # pinned jobs by first arrival, then the rest by first arrival
    policy.on_scheduled("b", 13.0)
    policy.on_scheduled("c", 13.0)
    assert [policy.priority(j, 14.0) for j in "abc"] == [0.0, 1.0, 2.0]  # a later call keeps the job's arrival


def _first_prefilled(name: str) -> str:
    """e (first arrival, its call after its pin ended) and a (later, its call inside its pin) both wait behind
    b's chunked prefill; whose call starts first?"""
    ttl = FIXED_THRESHOLD_S if name == "continuum" else None
    policy = make_policy(name, PolicyContext(deployment(), pin_ttl_s=ttl))
    engine = Engine(deployment(), policy, tick_s=0.05)
    engine.add(spec(session("e", [2_000, 7_000], gap_s=2.5, benchmark="x"), 0.0))  # answered ~2.2 s, back ~4.7 s
    engine.add(spec(session("a", [2_000, 7_000], gap_s=1.0), 1.0))  # answered ~3.2 s, back ~4.2 s, pinned
    engine.add(spec(session("b", [40_000]), 3.5))  # chunks until ~7.3 s: its last leaves room for one call
    while True:
        engine.run_until(engine.now + 0.01)
        started = [j for j in "ea" if engine.runs[j].next_call == 1 and (r := engine.runs[j].request) is not None
                   and r.stage not in (Stage.PREALLOC, Stage.PREFILL_WAIT)]
        if started:
            return "".join(started)


def test_in_a_run_a_pinned_jobs_call_goes_before_an_earlier_jobs_unpinned_one() -> None:
    assert _first_prefilled("continuum-fixed-ttl") == "a"
    assert _first_prefilled("continuum") == "e"  # there: the earlier job first, pinned or not

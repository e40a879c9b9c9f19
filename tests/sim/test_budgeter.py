"""The vLLM study's budgeter: who is suspended when the pool overflows, who comes back and in which order,
and the engine parking a suspended session's call at the door until it is resumed."""

from __future__ import annotations

import math

import pytest

from basin_sim.engine import Engine, EngineError
from basin_sim.lifecycle import Status
from basin_sim.policies import BudgeterPolicy, Decisions, PolicyContext, make_policy
from basin_sim.policies.fcfs import FcfsPolicy
from tests.sim.builders import deployment, session, spec

POOL = 10_000


def _admitted(policy: BudgeterPolicy, *names: str, first: int = 2_000) -> None:
    for t, sid in enumerate(names):
        assert policy.on_arrival(sid, float(t), session(sid, [first])) == Decisions(admit=(sid,))


def test_the_pool_is_the_prefill_cache_and_admission_waits_for_room_in_arrival_order() -> None:
    policy = make_policy("budgeter", PolicyContext(deployment(cache_tokens=4_000, num_prefill=2)))
    assert isinstance(policy, BudgeterPolicy) and policy.pool_tokens == 8_000
    _admitted(policy, "a", "b", first=3_000)
    assert policy.on_arrival("c", 2.0, session("c", [3_000])) == Decisions()  # 9,000 > 8,000: waits
    assert policy.on_arrival("d", 3.0, session("d", [100])) == Decisions()  # fits, but behind c
    assert policy.on_session_end("a", 4.0) == Decisions(admit=("c", "d"))
    assert policy.demand_tokens == 6_100


def test_overflow_suspends_the_newest_until_the_bound_holds_and_they_resume_oldest_first() -> None:
    policy = BudgeterPolicy(POOL)
    _admitted(policy, "a", "b", "c", "d")  # 8,000
    assert policy.on_call("a", 5.0, 5_000) == Decisions(suspend=("d",))  # 11,000 -> d out -> 9,000
    assert policy.on_call("b", 6.0, 4_000) == Decisions(suspend=("c",))  # 11,000 -> c out -> 9,000
    assert policy.demand_tokens == 9_000
    assert policy.on_arrival("e", 7.0, session("e", [100])) == Decisions()  # nobody new while c, d wait
    assert policy.on_call("d", 8.0, 2_500) == Decisions()  # d's parked call: its context is now known
    assert policy.on_session_end("a", 9.0) == Decisions(admit=("e",), resume=("c", "d"))
    assert policy.demand_tokens == 4_000 + 2_000 + 2_500 + 100


def test_one_overflow_suspends_as_many_as_it_takes_newest_first_never_the_oldest() -> None:
    policy = BudgeterPolicy(POOL)
    _admitted(policy, "a", "b", "c", "d")
    assert policy.on_call("a", 5.0, 9_000) == Decisions(suspend=("d", "c", "b"))  # 15,000 -> 9,000
    lone = BudgeterPolicy(POOL)
    _admitted(lone, "a")
    assert lone.on_call("a", 1.0, 25_000) == Decisions()  # alone over the pool: it still runs
    assert lone.on_arrival("b", 2.0, session("b", [10])) == Decisions()


def test_a_suspended_session_stays_out_while_demand_is_above_the_resume_fraction() -> None:
    policy = BudgeterPolicy(POOL)
    _admitted(policy, "a", "b", "c")  # 6,000
    assert policy.on_call("a", 3.0, 5_000) == Decisions()  # 9,000
    assert policy.on_call("b", 4.0, 3_500) == Decisions(suspend=("c",))  # 10,500 -> 8,500
    assert policy.on_call("b", 5.0, 4_500) == Decisions()  # 9,500: c's 2,000 would not fit anyway
    assert policy.on_session_end("x", 6.0) == Decisions()
    assert policy.on_call("b", 7.0, 4_100) == Decisions()  # 9,100: above 0.9 x pool, so c waits
    assert policy.on_session_end("a", 8.0) == Decisions(resume=("c",))  # 4,100 < 9,000 and 6,100 fits


def test_the_engine_parks_a_suspended_sessions_next_call_until_it_is_resumed() -> None:
    """a grows past the pool at its second call: b (newest) is suspended; b's next call waits at the door
    (no request, its client timers off) until a ends, and its TTFT counts the wait."""
    d = deployment(cache_tokens=POOL, decode_tokens=100_000)
    engine = Engine(d, make_policy("budgeter", PolicyContext(d)), tick_s=None)
    engine.add(spec(session("a", [4_000, 8_000], completion=100, gap_s=0.5), 0.0))
    engine.add(spec(session("b", [4_000, 4_200], completion=100, gap_s=0.5), 0.1))
    parked_at = None
    for step in range(1, 400):
        engine.run_until(step * 0.05)
        engine.check()
        b = engine.runs["b"]
        if b.parked and parked_at is None:
            parked_at = engine.now
            assert b.request is None and engine.runs["a"].status == Status.LIVE
    engine.run_until(math.inf)
    engine.check()
    a_end, b_end = engine.runs["a"].ended_s, engine.runs["b"].ended_s
    assert parked_at is not None and engine.suspensions == 1
    assert engine.runs["b"].status == Status.FINISHED and a_end is not None and b_end is not None and b_end > a_end
    b_second_ttft = engine.timeline.ttft_s[-1]
    assert b_second_ttft > a_end - parked_at  # from the park, not from the resume


def test_the_engine_refuses_to_suspend_a_session_that_is_not_live_or_resume_one_not_suspended() -> None:
    class Rogue(FcfsPolicy):
        def __init__(self, decisions: Decisions) -> None:
            super().__init__("rogue")
            self.decisions = decisions

        def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
            return self.decisions

    for decisions, match in ((Decisions(suspend=("ghost",)), "suspend session 'ghost', which is unknown"),
                             (Decisions(resume=("a",)), "resume session 'a', which is not suspended")):
        engine = Engine(deployment(), Rogue(decisions), tick_s=None)
        engine.add(spec(session("a", [1_000]), 0.0))
        with pytest.raises(EngineError, match=match):
            engine.run_until(1.0)

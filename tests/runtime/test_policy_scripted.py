"""Scripted-time tests of the policy core: every step asserts the whole snapshot.

Each test walks one rule with a hand-written clock. `Tracker` holds the expected snapshot; a step
states only what changed (`dataclasses.replace`), but the comparison is always against the whole
`PolicySnapshot`. Illegal steps must raise `PolicyError` and leave the state byte-for-byte equal.

Every test runs against both state backends (the `backend` fixture): the policy in process, and the
policy shared through a real Redis (`redis_policy.RedisPolicy`: each step sequenced by the Redis stream and
answered from this replica's copy). After a Redis test, another replica started on the same stream must
hold exactly the same state.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, cast

import pytest

from basin_runtime.policy import (
    Admitted,
    BudgetMoved,
    ClockError,
    DuplicateSessionError,
    Event,
    LendingLedger,
    LentEntry,
    Policy,
    PolicyConfig,
    PolicyError,
    PolicySnapshot,
    Reclaimed,
    Requeued,
    Shed,
    UnknownSessionError,
    WriteBackPlan,
    admitted_ids,
    reference_budget_tokens,
)
from basin_runtime.policy.shedding import ArrivalRateMeter
from tests.runtime.redis_policy import RedisPolicy


class _Backends:
    """What `new_policy` builds in the running test (the `backend` fixture sets it)."""

    build: Callable[[PolicyConfig], Policy] = Policy


def new_policy(config: PolicyConfig) -> Policy:
    """A policy on the running test's backend."""
    return _Backends.build(config)


@pytest.fixture(autouse=True, params=["in-process", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "in-process":
        yield request.param
        return
    server, loop = request.getfixturevalue("redis_server"), request.getfixturevalue("redis_loop")
    made: list[RedisPolicy] = []

    def build(config: PolicyConfig) -> Policy:
        made.append(RedisPolicy(config, server.url, loop))
        return cast(Policy, made[-1])

    _Backends.build = build
    try:
        yield request.param
    finally:
        _Backends.build = Policy
        for policy in made:
            try:
                policy.check_replicas_agree()
            finally:
                policy.close()


class Tracker:
    """The expected snapshot of one policy, checked whole after every step."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        budget = policy.config.budget_tokens
        self.expected = PolicySnapshot(
            now_s=None,
            live=(),
            queued=(),
            reserved_tokens=0,
            working_set_tokens=0,
            budget_tokens=budget,
            reference_budget_tokens=budget,
            is_engaged=policy.config.always_engaged,
        )
        self.check()

    def check(self, **changes: Any) -> None:
        """Apply `changes` to the expected snapshot and compare the whole snapshot."""
        for key in ("live", "queued"):
            if key in changes:
                changes[key] = tuple(changes[key])
        self.expected = replace(self.expected, **changes)
        assert self.policy.snapshot() == self.expected


def make(budget_tokens: int = 1000, **overrides: Any) -> tuple[Policy, Tracker]:
    policy = new_policy(PolicyConfig(budget_tokens=budget_tokens, **overrides))
    return policy, Tracker(policy)


def arrives(policy: Policy, session_id: str, now: float, peak: float, context: int) -> bool:
    """`arrive`; True if its events admit the arriving session at once (and admit nobody else)."""
    events = policy.arrive(session_id, now, peak, context)
    assert all(isinstance(e, Admitted) and e.session_id == session_id for e in events), events
    return bool(events)


def admits(events: list[Event]) -> list[str]:
    """The ids a step admitted, checking that every event it returned is an admission."""
    assert all(isinstance(e, Admitted) for e in events), events
    return list(admitted_ids(events))


def assert_illegal(policy: Policy, step: Callable[[], object], error: type[PolicyError], match: str) -> None:
    """`step` raises `error` (a PolicyError) and changes nothing, not even hidden state."""
    before_snapshot = policy.snapshot()
    before_state = pickle.dumps(policy)
    with pytest.raises(error, match=match):
        step()
    assert policy.snapshot() == before_snapshot
    assert pickle.dumps(policy) == before_state


# --- the paper's example -----------------------------------------------------------------------


def test_paper_example_new_session_waits_until_one_finishes() -> None:
    policy, t = make(1_000_000, always_engaged=True)
    sessions = [("s1", 300_000, 20_000), ("s2", 250_000, 15_000), ("s3", 200_000, 10_000)]
    sessions += [("s4", 120_000, 8_000), ("s5", 80_000, 5_000)]
    live: list[str] = []
    reserved = working_set = 0
    for now, (sid, peak, context) in enumerate(sessions):
        assert arrives(policy, sid, float(now), peak, context) is True
        live.append(sid)
        reserved += peak
        working_set += context
        t.check(now_s=float(now), live=live, reserved_tokens=reserved, working_set_tokens=working_set)
    assert reserved == 950_000

    assert arrives(policy, "new", 10.0, 80_000, 6_000) is False  # 950K + 80K > 1M
    t.check(now_s=10.0, queued=["new"])
    assert policy.priority_of("new") == 10.0 + 80_000 / 30
    assert policy.state_of("new") == "queued"
    assert policy.has_capacity(80_000) is False
    assert policy.has_capacity(50_000) is True  # would jump the queue and fit exactly: 1M <= 1M
    t.check()

    assert policy.tick(300.0) == []  # nothing finished: it keeps waiting
    t.check(now_s=300.0)

    # the admission keeps its wait and reservation, whichever step made it
    assert policy.finish("s4", 600.0) == [Admitted("new", 600.0, 10.0 + 80_000 / 30, 590.0, 80_000)]
    t.check(
        now_s=600.0,
        live=["s1", "s2", "s3", "s5", "new"],
        queued=[],
        reserved_tokens=950_000 - 120_000 + 80_000,
        working_set_tokens=58_000 - 8_000 + 6_000,
    )
    assert policy.state_of("new") == "live"
    assert policy.is_live("new") and not policy.is_queued("new")


# --- engagement ----------------------------------------------------------------------------------


def test_not_engaged_admits_at_once_until_the_working_set_exceeds_the_budget() -> None:
    policy, t = make(1000)
    assert arrives(policy, "a", 0.0, 5000, 100) is True  # peak far over budget: not engaged yet
    t.check(now_s=0.0, live=["a"], reserved_tokens=5000, working_set_tokens=100)
    assert arrives(policy, "b", 1.0, 5000, 900) is True  # its own context counts: 100 + 900 is not over
    t.check(now_s=1.0, live=["a", "b"], reserved_tokens=10_000, working_set_tokens=1000)
    assert admits(policy.observe("a", 2.0, 101)) == []
    t.check(now_s=2.0, working_set_tokens=1001, is_engaged=True)

    assert arrives(policy, "c", 3.0, 10, 10) is False
    t.check(now_s=3.0, queued=["c"])
    assert admits(policy.finish("a", 4.0)) == []  # working set back under budget, but c is queued
    t.check(now_s=4.0, live=["b"], reserved_tokens=5000, working_set_tokens=900, is_engaged=True)
    assert admits(policy.finish("b", 5.0)) == ["c"]  # nobody live: the head goes in
    t.check(now_s=5.0, live=["c"], queued=[], reserved_tokens=10, working_set_tokens=10, is_engaged=False)


def test_an_arrivals_own_context_engages_admission_so_long_histories_never_pile_past_the_budget() -> None:
    # Issue 36 item 1: first calls carrying ~150k tokens of made-up turns against a 216k budget, each predicted
    # small. Judged on the state before the arrival, the second one went in (working set 300k, 39% over).
    policy, t = make(216_000)
    assert arrives(policy, "a", 0.0, 2_541, 150_000) is True  # 150k <= 216k: not engaged
    t.check(now_s=0.0, live=["a"], reserved_tokens=150_000, working_set_tokens=150_000)
    for k, now in enumerate((1.0, 2.0, 3.0), start=1):  # each would make 300k: admission engages, none fits
        assert arrives(policy, f"h{k}", now, 2_541, 150_000) is False
    t.check(now_s=3.0, queued=["h1", "h2", "h3"], is_engaged=True)
    assert admits(policy.finish("a", 4.0)) == ["h1"]  # nobody live: the head goes in alone
    t.check(now_s=4.0, live=["h1"], queued=["h2", "h3"], reserved_tokens=150_000, working_set_tokens=150_000)


def test_with_a_reservation_ratio_the_working_set_engages_at_the_budget_over_r() -> None:
    # B = r x knee side: 3000 reservation tokens with r = 3 is a working set of 1000 contexts
    policy, t = make(3000, reservation_ratio=3.0)
    assert arrives(policy, "a", 0.0, 2000, 600) is True
    t.check(now_s=0.0, live=["a"], reserved_tokens=2000, working_set_tokens=600)
    assert arrives(policy, "b", 1.0, 2000, 400) is True  # 600 x 3 <= 3000: not engaged yet
    t.check(now_s=1.0, live=["a", "b"], reserved_tokens=4000, working_set_tokens=1000)
    assert admits(policy.observe("b", 2.0, 401)) == []  # 1001 x 3 > 3000: engaged
    t.check(now_s=2.0, working_set_tokens=1001, is_engaged=True)
    assert arrives(policy, "c", 3.0, 10, 10) is False  # reservations 4000 + 10 > 3000: it waits
    t.check(now_s=3.0, queued=["c"])
    assert admits(policy.finish("a", 4.0)) == ["c"]  # 2000 + 10 fits
    t.check(now_s=4.0, live=["b", "c"], queued=[], reserved_tokens=2010, working_set_tokens=411, is_engaged=False)


def test_with_a_latency_gate_the_working_set_engages_admission_only_while_the_engines_are_slow() -> None:
    policy, t = make(1000, latency_gate_s=2.0)
    assert arrives(policy, "a", 0.0, 5000, 1200) is True  # nobody live: in
    t.check(now_s=0.0, live=["a"], reserved_tokens=5000, working_set_tokens=1200)
    assert policy.is_pressed is False  # no latency reported yet: not slow
    assert arrives(policy, "b", 1.0, 5000, 100) is True  # over the budget, but the engines keep up
    t.check(now_s=1.0, live=["a", "b"], reserved_tokens=10_000, working_set_tokens=1300)
    assert policy.tick(2.0, ttft_s=1.9) == []  # still under the gate
    t.check(now_s=2.0)
    assert policy.tick(3.0, ttft_s=2.0) == []  # at the gate: the engines are slow, the working set engages
    t.check(now_s=3.0, is_engaged=True)
    assert arrives(policy, "c", 4.0, 10, 10) is False
    t.check(now_s=4.0, queued=["c"])
    assert policy.tick(5.0, ttft_s=0.3) == []  # fast again, but c is queued: still engaged until it goes in
    t.check(now_s=5.0)
    assert policy.tick(6.0) == []  # no new evidence: the last report stands
    assert policy.is_pressed is False
    assert admits(policy.finish("a", 7.0)) == []  # 5000 + 10 > 1000: c waits for the budget, not for latency
    t.check(now_s=7.0, live=["b"], reserved_tokens=5000, working_set_tokens=100)
    assert admits(policy.finish("b", 8.0)) == ["c"]
    t.check(now_s=8.0, live=["c"], queued=[], reserved_tokens=10, working_set_tokens=10, is_engaged=False)
    assert_illegal(policy, lambda: policy.tick(9.0, ttft_s=-1.0), PolicyError, "ttft_s must be >= 0")
    assert_illegal(policy, lambda: policy.tick(9.0, ttft_s=math.nan), PolicyError, "ttft_s must be finite")
    with pytest.raises(PolicyError, match="latency_gate_s must be > 0"):
        PolicyConfig(budget_tokens=1000, latency_gate_s=0.0)


def test_a_reservation_ratio_under_1_is_refused() -> None:
    with pytest.raises(PolicyError, match="reservation_ratio must be >= 1"):
        PolicyConfig(budget_tokens=1000, reservation_ratio=0.5)


def test_always_engaged_checks_reservations_even_with_an_empty_cache() -> None:
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "a", 0.0, 600, 0) is True
    t.check(now_s=0.0, live=["a"], reserved_tokens=600)
    assert arrives(policy, "b", 0.0, 401, 0) is False
    t.check(queued=["b"])
    assert arrives(policy, "c", 0.0, 400, 0) is True  # c's p is smaller than b's and it fits exactly
    t.check(live=["a", "c"], reserved_tokens=1000)


# --- admission rule ----------------------------------------------------------------------------


def test_lone_head_is_admitted_over_budget() -> None:
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "big", 0.0, 5000, 3000) is True  # nobody live: in, over budget
    t.check(now_s=0.0, live=["big"], reserved_tokens=5000, working_set_tokens=3000)
    assert arrives(policy, "tiny", 1.0, 1, 1) is False
    t.check(now_s=1.0, queued=["tiny"])
    assert admits(policy.finish("big", 2.0)) == ["tiny"]
    t.check(now_s=2.0, live=["tiny"], queued=[], reserved_tokens=1, working_set_tokens=1)


def test_head_blocks_smaller_sessions_behind_it() -> None:
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "a", 0.0, 600, 0) is True
    t.check(now_s=0.0, live=["a"], reserved_tokens=600)
    assert arrives(policy, "b", 1.0, 500, 0) is False  # p = 1 + 500/30
    t.check(now_s=1.0, queued=["b"])
    assert arrives(policy, "c", 20.0, 100, 0) is False  # p = 20 + 100/30, behind b; fits, still waits
    t.check(now_s=20.0, queued=["b", "c"])
    assert policy.has_capacity(100) is False  # it would queue behind b too
    assert admits(policy.finish("a", 30.0)) == ["b", "c"]
    t.check(now_s=30.0, live=["b", "c"], queued=[], reserved_tokens=600)


def test_withdrawing_the_head_lets_the_next_one_in() -> None:
    policy, t = make(1000, always_engaged=True)
    policy.arrive("a", 0.0, 600, 0)
    policy.arrive("b", 1.0, 500, 0)
    policy.arrive("c", 20.0, 100, 0)
    t.check(now_s=20.0, live=["a"], queued=["b", "c"], reserved_tokens=600)
    assert admits(policy.finish("c", 21.0)) == []  # withdraw from the back: nothing changes for b
    t.check(now_s=21.0, queued=["b"])
    policy.arrive("d", 22.0, 100, 0)
    t.check(now_s=22.0, queued=["b", "d"])
    assert admits(policy.finish("b", 23.0)) == ["d"]  # the head gave up: d fits
    t.check(now_s=23.0, live=["a", "d"], queued=[], reserved_tokens=700)
    with pytest.raises(UnknownSessionError, match="'b'"):
        policy.state_of("b")


# --- priority ------------------------------------------------------------------------------------


def test_priority_order_and_ties_by_arrival() -> None:
    policy, t = make(100, always_engaged=True)
    policy.arrive("blocker", 0.0, 100, 0)
    t.check(now_s=0.0, live=["blocker"], reserved_tokens=100)
    policy.arrive("x", 0.0, 300, 0)  # p = 10
    policy.arrive("y", 5.0, 150, 0)  # p = 10, arrived later
    policy.arrive("z", 5.0, 60, 0)  # p = 7
    policy.arrive("w", 5.0, 75, 0)  # p = 7.5
    t.check(now_s=5.0, queued=["z", "w", "x", "y"])
    assert [policy.priority_of(s) for s in ("x", "y", "z", "w")] == [10.0, 10.0, 7.0, 7.5]
    assert policy.priority_of("blocker") == 0.0 + 100 / 30

    steps = [("blocker", "z", 60), ("z", "w", 75), ("w", "x", 300), ("x", "y", 150)]
    for now, (finished, admitted, reserved) in enumerate(steps, start=10):
        assert admits(policy.finish(finished, float(now))) == [admitted]  # x and y go in as lone heads
        t.check(now_s=float(now), live=[admitted], queued=t.expected.queued[1:], reserved_tokens=reserved)
    t.check(queued=[])


def test_tokens_per_s_sets_the_priority_scale() -> None:
    policy, t = make(100, always_engaged=True, tokens_per_s=10.0)
    policy.arrive("a", 2.0, 50, 0)
    assert policy.priority_of("a") == 7.0
    t.check(now_s=2.0, live=["a"], reserved_tokens=50)


def test_prototype_mode_orders_by_arrival_and_reserves_current_context() -> None:
    policy, t = make(1000, always_engaged=True, mode="prototype")
    assert arrives(policy, "a", 0.0, 900_000, 300) is True
    t.check(now_s=0.0, live=["a"], reserved_tokens=300, working_set_tokens=300)
    assert policy.priority_of("a") == 0.0
    assert arrives(policy, "b", 1.0, 900_000, 800) is False  # 300 + 800 > 1000
    assert arrives(policy, "c", 2.0, 1, 100) is False  # tiny peak, but arrival order: behind b
    t.check(now_s=2.0, queued=["b", "c"])
    # a's reservation is its context: 200 + 800 fits; the event carries b's wait and reservation
    assert policy.observe("a", 3.0, 200) == [Admitted("b", 3.0, 1.0, 2.0, 800)]
    t.check(now_s=3.0, live=["a", "b"], queued=["c"], reserved_tokens=1000, working_set_tokens=1000)
    assert admits(policy.observe("c", 4.0, 0)) == ["c"]  # queued c's context shrank to 0: fits
    t.check(now_s=4.0, live=["a", "b", "c"], queued=[])


# --- observe --------------------------------------------------------------------------------------


def test_observe_growth_past_the_prediction_keeps_the_reserved_sum_exact() -> None:
    policy, t = make(1000, always_engaged=True, can_outgrow_reservation=True)  # the ablation: growth unchecked
    policy.arrive("a", 0.0, 499.2, 100)  # reservation is the peak rounded up: 500
    t.check(now_s=0.0, live=["a"], reserved_tokens=500, working_set_tokens=100)
    assert admits(policy.observe("a", 1.0, 400)) == []
    t.check(now_s=1.0, working_set_tokens=400)
    assert arrives(policy, "b", 2.0, 400, 0) is True
    t.check(now_s=2.0, live=["a", "b"], reserved_tokens=900)
    assert admits(policy.observe("a", 3.0, 700)) == []  # grew past its prediction
    t.check(now_s=3.0, reserved_tokens=1100, working_set_tokens=700)
    assert arrives(policy, "c", 4.0, 0, 0) is False  # 1100 + 0 > 1000
    t.check(now_s=4.0, queued=["c"])
    assert admits(policy.observe("a", 5.0, 550)) == ["c"]  # shrank (compaction): 550 + 400 + 0 fits
    t.check(now_s=5.0, live=["a", "b", "c"], queued=[], reserved_tokens=950, working_set_tokens=550)
    assert admits(policy.observe("a", 6.0, 100)) == []  # back under its prediction: reserves the peak
    t.check(now_s=6.0, reserved_tokens=900, working_set_tokens=100)


def test_a_later_call_past_its_reservation_is_re_reserved_and_waits_in_the_queue_when_it_does_not_fit() -> None:
    """The two-step attack: a tiny first call admitted on a small prediction, then a made-up history."""
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "owner", 0.0, 300, 100) is True
    assert arrives(policy, "small", 1.0, 250, 50) is True  # predicted growth: 250 - 50 = 200
    t.check(now_s=1.0, live=["owner", "small"], reserved_tokens=550, working_set_tokens=150)
    events = policy.observe("small", 2.0, 900)  # passes its 250: re-reserved 900 + 200 = 1100; 300 + 1100 > 1000
    assert events == [Requeued("small", 2.0, 1.0 + 250 / 30, 900, 1100, 300, 1000, events[0].reason)]
    assert "outgrew its reservation of 250" in events[0].reason and "does not fit" in events[0].reason
    t.check(now_s=2.0, live=["owner"], queued=["small"], reserved_tokens=300, working_set_tokens=100)
    assert policy.record_of("small").has_run and policy.state_of("small") == "queued"
    assert arrives(policy, "late", 3.0, 600, 10) is False  # it would fit, but the held session is ahead of it
    t.check(now_s=3.0, queued=["small", "late"])
    events = policy.finish("owner", 4.0)  # alone now: the lone-head rule lets it in over budget
    assert events == [Admitted("small", 4.0, 1.0 + 250 / 30, 2.0, 1100, is_resumed=True)]
    t.check(now_s=4.0, live=["small"], queued=["late"], reserved_tokens=1100, working_set_tokens=900)


def test_a_later_call_past_its_reservation_that_fits_runs_on_re_reserved() -> None:
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "a", 0.0, 300, 100) is True
    assert arrives(policy, "b", 1.0, 200, 100) is True
    assert admits(policy.observe("b", 2.0, 400)) == []  # 400 + (200 - 100) = 500; 300 + 500 <= 1000
    t.check(now_s=2.0, live=["a", "b"], reserved_tokens=800, working_set_tokens=500)
    assert admits(policy.observe("b", 3.0, 450)) == []  # within its new reservation: nothing moves but the context
    t.check(now_s=3.0, working_set_tokens=550)
    assert admits(policy.revise("b", 4.0, 300)) == []  # a revision replaces the re-reservation: max(300, 450)
    t.check(now_s=4.0, reserved_tokens=750)


def test_a_later_call_past_its_reservation_while_not_engaged_is_re_reserved_and_runs() -> None:
    policy, t = make(1000)
    assert arrives(policy, "a", 0.0, 100, 10) is True
    assert admits(policy.observe("a", 1.0, 300)) == []  # 300 x 1 <= 1000: not engaged
    t.check(now_s=1.0, live=["a"], reserved_tokens=390, working_set_tokens=300)
    assert admits(policy.observe("a", 2.0, 1200)) == []  # engages, but alone: the lone-head rule
    t.check(now_s=2.0, reserved_tokens=1290, working_set_tokens=1200, is_engaged=True)


def test_a_held_session_waits_behind_a_head_ahead_of_it_and_is_never_shed() -> None:
    policy, t = make(1000, always_engaged=True, peak_completion_rate_per_s=0.001, shed_wait_s=10.0)
    assert arrives(policy, "big", 0.0, 900, 100) is True
    assert arrives(policy, "cheap", 1.0, 50, 50) is True  # reserved 950
    assert arrives(policy, "first", 2.0, 10, 10) is True  # 950 + 10 fits
    t.check(now_s=2.0, live=["big", "cheap", "first"], reserved_tokens=960, working_set_tokens=160)
    events = policy.observe("cheap", 3.0, 300)  # re-reserved 300 + 0; 910 + 300 > 1000
    assert [type(e) for e in events] == [Requeued]
    t.check(now_s=3.0, live=["big", "first"], queued=["cheap"], reserved_tokens=910, working_set_tokens=110)
    assert policy.tick(40.0) == []  # the only one waiting was admitted before: it is not shed
    t.check(now_s=40.0)


def test_the_ablation_lets_a_call_outgrow_its_reservation_and_prototype_mode_reserves_contexts() -> None:
    policy, t = make(1000, always_engaged=True, can_outgrow_reservation=True)
    assert arrives(policy, "a", 0.0, 300, 100) is True
    assert arrives(policy, "b", 1.0, 250, 50) is True
    assert admits(policy.observe("b", 2.0, 900)) == []  # passes the budget, as before the rule
    t.check(now_s=2.0, live=["a", "b"], reserved_tokens=1200, working_set_tokens=1000)
    proto, p = make(1000, always_engaged=True, mode="prototype")
    assert arrives(proto, "a", 0.0, 300, 100) is True
    assert admits(proto.observe("a", 1.0, 5000)) == []  # prototype reserves contexts: no re-reservation
    p.check(now_s=1.0, live=["a"], reserved_tokens=5000, working_set_tokens=5000)


def test_a_held_session_survives_the_state_round_trip_and_an_illegal_step_changes_nothing() -> None:
    policy, _ = make(1000, always_engaged=True)
    policy.arrive("a", 0.0, 600, 100)
    policy.arrive("b", 1.0, 300, 100)
    assert isinstance(policy.observe("b", 2.0, 700)[0], Requeued)
    state = json.loads(json.dumps(policy.to_state()))
    restored = Policy.from_state(state)
    assert restored.to_state() == state and restored.snapshot() == policy.snapshot()
    assert restored.finish("a", 3.0) == policy.finish("a", 3.0)
    assert_illegal(policy, lambda: policy.observe("b", 4.0, -1), PolicyError, "must be >= 0")
    bad = json.loads(json.dumps(state))
    bad["live"][0][10] = False
    with pytest.raises(PolicyError, match="has_run must be a bool"):
        Policy.from_state(bad)


def test_a_reservation_multiplier_scales_the_reservation_not_the_priority() -> None:
    """The paper's 950K live plus a new session whose 80K prediction is reserved at m = 1.5 (120K)."""
    policy, t = make(1_000_000, always_engaged=True)
    assert arrives(policy, "live", 0.0, 950_000, 50_000) is True
    events = policy.arrive("new", 10.0, 80_000, 6_000, reservation_multiplier=1.5)
    assert events == []  # 950K + 120K > 1M, though 950K + 80K would not be
    assert policy.priority_of("new") == 10.0 + 80_000 / 30  # the bare prediction orders it
    assert policy.has_capacity(40_000, reservation_multiplier=1.25) is True  # ahead of it; 950K + 50K fits
    assert policy.has_capacity(40_000, reservation_multiplier=1.5) is False  # 950K + 60K does not
    assert policy.finish("live", 20.0) == [Admitted("new", 20.0, 10.0 + 80_000 / 30, 10.0, 120_000)]
    t.check(now_s=20.0, live=["new"], reserved_tokens=120_000, working_set_tokens=6_000)
    assert admits(policy.observe("new", 21.0, 130_000)) == []  # past m x prediction: context + predicted growth
    t.check(now_s=21.0, reserved_tokens=130_000 + 114_000, working_set_tokens=130_000)  # alone, so it runs
    small, _ = make(1000, always_engaged=True)
    small.arrive("a", 0.0, 99.5, 10, reservation_multiplier=0.9)  # m < 1 at low q: ceil(89.55) = 90
    assert small.snapshot().reserved_tokens == 90


def test_a_revision_down_releases_budget_and_admits_the_head_priority_unchanged() -> None:
    """The paper's example: 950K reserved, an 80K newcomer waits; s1's online re-estimate 300K -> 200K
    frees 100K and the newcomer goes in on that step; s1 keeps its arrival priority."""
    policy, t = make(1_000_000, always_engaged=True)
    for now, (sid, peak, context) in enumerate([("s1", 300_000, 20_000), ("s2", 650_000, 15_000)]):
        assert arrives(policy, sid, float(now), peak, context)
    assert not arrives(policy, "new", 10.0, 80_000, 6_000)
    before = policy.priority_of("s1")
    assert policy.revise("s1", 20.0, 200_000) == [Admitted("new", 20.0, 10.0 + 80_000 / 30, 10.0, 80_000)]
    assert policy.priority_of("s1") == before == 0.0 + 300_000 / 30
    t.check(now_s=20.0, live=["s1", "s2", "new"], queued=[], reserved_tokens=200_000 + 650_000 + 80_000,
            working_set_tokens=41_000)


def test_a_revision_up_never_evicts_and_holds_the_queue_until_enough_finishes() -> None:
    policy, t = make(1_000_000, always_engaged=True)
    assert arrives(policy, "a", 0.0, 400_000, 10_000) and arrives(policy, "b", 1.0, 400_000, 10_000)
    assert policy.revise("a", 2.0, 500_000, 1.5) == []  # 750K + 400K > 1M: over budget, nobody evicted
    t.check(now_s=2.0, live=["a", "b"], reserved_tokens=1_150_000, working_set_tokens=20_000)
    assert not arrives(policy, "c", 3.0, 10_000, 1_000)  # even a small newcomer waits now
    assert policy.finish("b", 4.0) == [Admitted("c", 4.0, 3.0 + 10_000 / 30, 1.0, 10_000)]
    t.check(now_s=4.0, live=["a", "c"], queued=[], reserved_tokens=760_000, working_set_tokens=11_000)
    assert admits(policy.revise("a", 5.0, 1_000, 1.0)) == []  # down to its context: the context holds
    t.check(now_s=5.0, reserved_tokens=10_000 + 10_000, working_set_tokens=11_000)


def test_a_queued_sessions_revision_keeps_its_place_and_may_let_it_in() -> None:
    policy, t = make(1000, always_engaged=True)
    assert arrives(policy, "live", 0.0, 900, 100)
    assert not arrives(policy, "head", 1.0, 300, 10) and not arrives(policy, "next", 2.0, 50_000, 10)
    assert policy.snapshot().queued == ("head", "next")
    assert admits(policy.revise("next", 3.0, 10)) == []  # priority fixed at arrival: still behind head
    t.check(now_s=3.0, queued=["head", "next"], live=["live"], reserved_tokens=900, working_set_tokens=100)
    assert admits(policy.revise("head", 4.0, 50)) == ["head", "next"]  # 900 + 50 + 10 fits: both go in
    proto = new_policy(PolicyConfig(budget_tokens=1000, mode="prototype", always_engaged=True))
    proto.arrive("p", 0.0, 10, 100)
    assert proto.revise("p", 1.0, 5_000, 2.0) == [] and proto.snapshot().reserved_tokens == 100  # contexts


def test_observe_a_queued_session_updates_its_reservation() -> None:
    policy, t = make(1000, always_engaged=True)
    policy.arrive("a", 0.0, 600, 0)
    assert arrives(policy, "b", 1.0, 300, 450) is False  # context already past its peak: 450
    t.check(now_s=1.0, live=["a"], queued=["b"], reserved_tokens=600)
    assert admits(policy.observe("b", 2.0, 350)) == ["b"]  # queued contexts do not count in the working set
    t.check(now_s=2.0, live=["a", "b"], queued=[], reserved_tokens=950, working_set_tokens=350)


# --- budget moves -------------------------------------------------------------------------------


def test_budget_moves_up_while_queued_down_when_hits_fall_within_bounds_and_interval() -> None:
    # B = 1000: step 20, bounds 850..1100, one move per 60 s, plateau 0.9 - 0.05 = 0.85.
    policy, t = make(1000, always_engaged=True, budget_move_interval_s=60.0)
    policy.arrive("a", 0.0, 900, 0)
    policy.arrive("b", 0.0, 150, 0)
    t.check(now_s=0.0, live=["a"], queued=["b"], reserved_tokens=900)
    assert policy.tick(0.0) == []  # no hit rate: no move
    assert policy.tick(0.0, 0.85) == [BudgetMoved(0.0, 1000, 1020, 1000, 0.85, _LOOSEN)]
    t.check(budget_tokens=1020)
    assert policy.tick(59.0, 0.99) == []  # interval
    t.check(now_s=59.0)
    assert policy.tick(60.0, 0.99) == [BudgetMoved(60.0, 1020, 1040, 1000, 0.99, _LOOSEN)]
    t.check(now_s=60.0, budget_tokens=1040)
    events = policy.tick(120.0, 0.99)
    assert events == [
        BudgetMoved(120.0, 1040, 1060, 1000, 0.99, _LOOSEN),
        Admitted("b", 120.0, 5.0, 120.0, 150),
    ]
    t.check(now_s=120.0, live=["a", "b"], queued=[], reserved_tokens=1050, budget_tokens=1060)
    assert policy.tick(180.0, 0.99) == []  # nobody queued: no reason to loosen
    t.check(now_s=180.0)
    # Tighten: 1060 -> 1040 -> ... -> 860 -> 850 (bound); never evicts a or b.
    expected_budgets = [1040, 1020, 1000, 980, 960, 940, 920, 900, 880, 860, 850]
    for i, budget in enumerate(expected_budgets):
        now = 240.0 + 60.0 * i
        [moved] = policy.tick(now, 0.8499)
        assert moved == BudgetMoved(now, t.expected.budget_tokens, budget, 1000, 0.8499, _TIGHTEN)
        t.check(now_s=now, budget_tokens=budget)
    assert policy.tick(1000.0, 0.0) == []  # at the lower bound
    t.check(now_s=1000.0)


def test_budget_is_bounded_above_and_a_clipped_move_does_not_restart_the_interval() -> None:
    policy, t = make(1000, always_engaged=True, budget_move_interval_s=10.0)
    policy.arrive("a", 0.0, 2000, 0)
    policy.arrive("b", 0.0, 2000, 0)
    t.check(now_s=0.0, live=["a"], queued=["b"], reserved_tokens=2000)
    for i, budget in enumerate([1020, 1040, 1060, 1080, 1100]):
        [moved] = policy.tick(10.0 * i, 1.0)
        assert moved.new_budget_tokens == budget
    t.check(now_s=40.0, budget_tokens=1100)
    assert policy.tick(50.0, 1.0) == []  # upper bound: clipped to nothing, not a move
    t.check(now_s=50.0)
    # Had the clipped move at 50 restarted the interval, 51 would be blocked; the last real move
    # was at 40, so the budget may tighten at once.
    assert policy.tick(51.0, 0.1) == [BudgetMoved(51.0, 1100, 1080, 1000, 0.1, _TIGHTEN)]
    t.check(now_s=51.0, budget_tokens=1080)
    assert policy.tick(60.0, 0.1) == []  # 9 s after that move
    t.check(now_s=60.0)


def test_operator_reference_change_reclamps_and_never_evicts() -> None:
    policy, t = make(1_000_000, always_engaged=True)
    policy.arrive("a", 0.0, 600_000, 10)
    policy.arrive("b", 1.0, 300_000, 10)
    policy.arrive("c", 2.0, 300_000, 10)
    t.check(now_s=2.0, live=["a", "b"], queued=["c"], reserved_tokens=900_000, working_set_tokens=20)
    events = policy.set_reference_budget(500_000, 3.0)
    assert events == [BudgetMoved(3.0, 1_000_000, 550_000, 500_000, None, _operator(500_000))]
    t.check(now_s=3.0, budget_tokens=550_000, reference_budget_tokens=500_000)  # a and b stay live
    assert admits(policy.finish("b", 4.0)) == []  # 600K + 300K > 550K
    t.check(now_s=4.0, live=["a"], reserved_tokens=600_000, working_set_tokens=10)
    events = policy.set_reference_budget(2_000_000)  # now defaults to the last now seen
    assert events == [
        BudgetMoved(4.0, 550_000, 1_700_000, 2_000_000, None, _operator(2_000_000)),
        Admitted("c", 4.0, 2.0 + 300_000 / 30, 2.0, 300_000),
    ]
    t.check(
        live=["a", "c"],
        queued=[],
        reserved_tokens=900_000,
        working_set_tokens=20,
        budget_tokens=1_700_000,
        reference_budget_tokens=2_000_000,
    )
    assert policy.set_reference_budget(1_600_000, 5.0)[0].new_budget_tokens == 1_700_000  # in bounds
    t.check(now_s=5.0, reference_budget_tokens=1_600_000)


# --- shedding --------------------------------------------------------------------------------------


def _shedding_policy(**overrides: Any) -> tuple[Policy, Tracker]:
    config: dict[str, Any] = dict(always_engaged=True, peak_completion_rate_per_s=0.001)
    policy, t = make(1000, **{**config, **overrides})
    policy.arrive("a", 0.0, 1000, 0)
    policy.arrive("b", 1.0, 300, 0)  # p = 11
    policy.arrive("c", 2.0, 600, 0)  # p = 22
    policy.arrive("d", 3.0, 60, 0)  # p = 5
    t.check(now_s=3.0, live=["a"], queued=["d", "b", "c"], reserved_tokens=1000)
    return policy, t


def test_shedding_drops_the_lowest_priority_one_per_tick_with_a_reason() -> None:
    policy, t = _shedding_policy()
    assert policy.tick(902.0) == []  # the head (d, arrived at 3) waited 899 s
    t.check(now_s=902.0)
    rate = 4 / 903.0  # since start (0), shorter than the 3600 s window
    [shed] = policy.tick(903.0)
    reason = f"arrival rate {rate:.3g}/s exceeds peak completion rate 0.001/s; queue head waited 900 s"
    assert shed == Shed("c", 903.0, 22.0, 901.0, rate, 0.001, 900.0, reason)
    assert reason == "arrival rate 0.00443/s exceeds peak completion rate 0.001/s; queue head waited 900 s"
    t.check(now_s=903.0, queued=["d", "b"])
    with pytest.raises(UnknownSessionError, match="'c'"):
        policy.state_of("c")
    assert [e.session_id for e in policy.tick(903.0) if isinstance(e, Shed)] == ["b"]
    t.check(queued=["d"])
    assert [e.session_id for e in policy.tick(903.0) if isinstance(e, Shed)] == ["d"]  # the head itself
    t.check(queued=[])
    assert policy.tick(903.0) == []
    t.check()
    assert arrives(policy, "c", 904.0, 10, 0) is False  # a shed id may come back as a new session
    t.check(now_s=904.0, queued=["c"])


def test_no_shedding_when_arrivals_do_not_outrun_completions() -> None:
    policy, t = _shedding_policy(peak_completion_rate_per_s=0.005)  # 4/903 = 0.0044 < 0.005
    assert policy.tick(5000.0) == []
    t.check(now_s=5000.0)


def test_no_shedding_when_it_is_off_or_the_window_holds_no_arrivals() -> None:
    policy, t = _shedding_policy(peak_completion_rate_per_s=None)
    assert policy.tick(5000.0) == []
    t.check(now_s=5000.0)
    policy, t = _shedding_policy(arrival_window_s=100.0)  # arrivals at 0..3 left the window
    assert policy.tick(903.0) == []
    t.check(now_s=903.0)


def test_shedding_waits_for_the_head_not_for_the_victim() -> None:
    policy, t = _shedding_policy(shed_wait_s=10.0)
    assert arrives(policy, "e", 12.0, 3000, 0) is False  # p = 112, arrived last
    t.check(now_s=12.0, queued=["d", "b", "c", "e"])
    [shed] = policy.tick(13.0)  # d waited 10 s; e itself waited only 1 s
    assert isinstance(shed, Shed) and shed.session_id == "e" and shed.waited_s == 1.0
    assert shed.head_waited_s == 10.0
    t.check(now_s=13.0, queued=["d", "b", "c"])


def test_arrival_rate_window_is_half_open_and_since_start_when_shorter() -> None:
    meter = ArrivalRateMeter(window_s=100.0)
    assert meter.rate_per_s(0.0, started_s=0.0) is None  # no time has passed
    meter.record(0.0)
    meter.record(50.0)
    assert meter.rate_per_s(50.0, started_s=0.0) == 2 / 50  # since start: shorter than the window
    assert meter.rate_per_s(99.0, started_s=0.0) == 2 / 99
    assert meter.rate_per_s(100.0, started_s=0.0) == 1 / 100  # (0, 100]: the arrival at 0 is out
    assert meter.rate_per_s(149.5, started_s=0.0) == 1 / 100
    assert meter.rate_per_s(150.0, started_s=0.0) == 0.0


# --- illegal steps --------------------------------------------------------------------------------


def _busy_policy() -> Policy:
    policy, t = make(1000, always_engaged=True)
    policy.arrive("live", 0.0, 900, 100)
    policy.arrive("queued", 5.0, 500, 50)
    t.check(now_s=5.0, live=["live"], queued=["queued"], reserved_tokens=900, working_set_tokens=100)
    return policy


def _unchecked(value: object) -> Any:
    """A value of the wrong type, passed on purpose."""
    return value


ILLEGAL_STEPS: list[tuple[str, Callable[[Policy], object], type[PolicyError], str]] = [
    ("finish unknown", lambda p: p.finish("ghost", 6.0), UnknownSessionError, "finish: session 'ghost'"),
    (
        "observe unknown",
        lambda p: p.observe("ghost", 6.0, 1),
        UnknownSessionError,
        "observe: session 'ghost'",
    ),
    ("priority unknown", lambda p: p.priority_of("ghost"), UnknownSessionError, "'ghost'"),
    ("state unknown", lambda p: p.state_of("ghost"), UnknownSessionError, "'ghost'"),
    (
        "duplicate live",
        lambda p: p.arrive("live", 6.0, 1, 1),
        DuplicateSessionError,
        "'live' arrived again while live",
    ),
    ("duplicate queued", lambda p: p.arrive("queued", 6.0, 1, 1), DuplicateSessionError, "while queued"),
    ("arrive backwards", lambda p: p.arrive("new", 4.0, 1, 1), ClockError, r"now=4.0 runs backwards.*5.0"),
    ("observe backwards", lambda p: p.observe("live", 4.9, 1), ClockError, "now=4.9"),
    ("finish backwards", lambda p: p.finish("live", 0.0), ClockError, "now=0.0"),
    ("tick backwards", lambda p: p.tick(1.0), ClockError, "now=1.0"),
    ("reference backwards", lambda p: p.set_reference_budget(10, 1.0), ClockError, "now=1.0"),
    ("now nan", lambda p: p.tick(math.nan), PolicyError, "now must be finite"),
    ("now inf", lambda p: p.arrive("new", math.inf, 1, 1), PolicyError, "now must be finite"),
    ("now string", lambda p: p.tick(_unchecked("6")), PolicyError, "now must be a real number"),
    (
        "negative peak",
        lambda p: p.arrive("new", 6.0, -1.0, 1),
        PolicyError,
        "predicted_peak_tokens of session 'new'.*-1.0",
    ),
    (
        "nan peak",
        lambda p: p.arrive("new", 6.0, math.nan, 1),
        PolicyError,
        "predicted_peak_tokens of session 'new'.*finite",
    ),
    ("inf peak", lambda p: p.arrive("new", 6.0, math.inf, 1), PolicyError, "must be finite, got inf"),
    (
        "negative context",
        lambda p: p.arrive("new", 6.0, 1, -5),
        PolicyError,
        "context_tokens of session 'new' must be >= 0, got -5",
    ),
    (
        "fractional context",
        lambda p: p.arrive("new", 6.0, 1, _unchecked(2.5)),
        PolicyError,
        "whole number of tokens, got 2.5",
    ),
    (
        "nan context",
        lambda p: p.observe("live", 6.0, _unchecked(math.nan)),
        PolicyError,
        "context_tokens of session 'live'",
    ),
    (
        "negative observe",
        lambda p: p.observe("queued", 6.0, -1),
        PolicyError,
        "session 'queued' must be >= 0",
    ),
    ("observe unknown and bad", lambda p: p.observe("ghost", 6.0, -1), PolicyError, "'ghost'"),
    ("empty id", lambda p: p.arrive("", 6.0, 1, 1), PolicyError, "non-empty string"),
    ("hit rate over 1", lambda p: p.tick(6.0, 1.5), PolicyError, r"hit_rate must be in \[0, 1\], got 1.5"),
    ("hit rate nan", lambda p: p.tick(6.0, math.nan), PolicyError, "hit_rate must be finite"),
    ("zero reference", lambda p: p.set_reference_budget(0, 6.0), PolicyError, "must be > 0, got 0"),
    ("negative reference", lambda p: p.set_reference_budget(-3, 6.0), PolicyError, "got -3"),
    ("capacity check bad peak", lambda p: p.has_capacity(-1.0), PolicyError, "predicted_peak_tokens"),
    ("zero multiplier", lambda p: p.arrive("new", 6.0, 1, 1, 0.0), PolicyError,
     "reservation_multiplier of session 'new' must be > 0, got 0.0"),
    ("nan multiplier", lambda p: p.adopt("new", 6.0, 1, 1, math.nan), PolicyError, "reservation_multiplier.*finite"),
    ("capacity check bad multiplier", lambda p: p.has_capacity(1.0, 0, -2.0), PolicyError, "reservation_multiplier"),
    ("revise unknown", lambda p: p.revise("ghost", 6.0, 1.0), UnknownSessionError, "revise: session 'ghost'"),
    ("revise nan peak", lambda p: p.revise("live", 6.0, math.nan), PolicyError, "predicted_peak_tokens of session"),
    ("revise zero multiplier", lambda p: p.revise("queued", 6.0, 10.0, 0.0), PolicyError, "must be > 0"),
    ("revise backwards", lambda p: p.revise("live", 4.0, 10.0), ClockError, "now=4.0"),
]


@pytest.mark.parametrize(("step", "error", "match"), [s[1:] for s in ILLEGAL_STEPS], ids=[s[0] for s in ILLEGAL_STEPS])
def test_illegal_step_raises_and_changes_nothing(
    step: Callable[[Policy], object], error: type[PolicyError], match: str
) -> None:
    policy = _busy_policy()
    assert_illegal(policy, lambda: step(policy), error, match)
    assert issubclass(error, ValueError)


def test_finished_session_cannot_finish_again_and_nothing_changes() -> None:
    policy = _busy_policy()
    assert admits(policy.finish("live", 6.0)) == ["queued"]
    assert_illegal(policy, lambda: policy.finish("live", 7.0), UnknownSessionError, "'live'")
    assert policy.snapshot().now_s == 6.0


def test_legal_steps_after_an_illegal_one_behave_as_if_it_never_happened() -> None:
    twin, other = _busy_policy(), _busy_policy()
    with pytest.raises(PolicyError):
        twin.arrive("x", 6.0, -1, 0)
    assert twin.arrive("x", 6.0, 10, 0) == other.arrive("x", 6.0, 10, 0)
    assert twin.priority_of("x") == other.priority_of("x")
    assert pickle.dumps(twin) == pickle.dumps(other)


# --- configuration, reference budget, snapshot --------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"budget_tokens": 0}, "budget_tokens must be > 0"),
        ({"budget_tokens": -5}, "budget_tokens must be >= 0, got -5"),
        ({"budget_tokens": 10.5}, "budget_tokens must be a whole number"),
        ({"tokens_per_s": 0.0}, "tokens_per_s must be > 0, got 0.0"),
        ({"tokens_per_s": math.inf}, "tokens_per_s must be finite"),
        ({"mode": "fifo"}, "mode must be one of"),
        ({"always_engaged": 1}, "always_engaged must be a bool"),
        ({"budget_step_fraction": 0.0}, "budget_step_fraction must be in"),
        ({"budget_min_fraction": 1.2}, "budget_min_fraction must be in"),
        ({"budget_max_fraction": 0.9}, "budget_max_fraction must be >= 1"),
        ({"budget_move_interval_s": -1.0}, "budget_move_interval_s must be >= 0"),
        ({"hit_rate_plateau": 1.5}, "hit_rate_plateau must be in"),
        ({"hit_rate_tolerance": -0.1}, "hit_rate_tolerance must be in"),
        ({"peak_completion_rate_per_s": 0.0}, "peak_completion_rate_per_s must be > 0"),
        ({"shed_wait_s": math.nan}, "shed_wait_s must be finite"),
        ({"arrival_window_s": 0.0}, "arrival_window_s must be > 0"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        PolicyConfig(**{"budget_tokens": 1000, **overrides})


def test_config_defaults_and_whole_float_budget() -> None:
    config = PolicyConfig(budget_tokens=_unchecked(1e6))
    assert config.budget_tokens == 1_000_000 and isinstance(config.budget_tokens, int)
    assert (config.tokens_per_s, config.always_engaged, config.mode) == (30.0, False, "basin")
    assert (config.peak_completion_rate_per_s, config.shed_wait_s, config.arrival_window_s) == (
        None,
        900.0,
        3600.0,
    )


def test_reference_budget_is_the_smaller_of_knee_share_and_capacity() -> None:
    assert reference_budget_tokens(1_000_000, 2_000_000) == 900_000
    assert reference_budget_tokens(1_000_000, 500_000) == 500_000
    assert reference_budget_tokens(1_000_000, 2_000_000, knee_factor=0.8) == 800_000
    assert reference_budget_tokens(1001, 5000) == 900  # floor of 900.9
    for args, match in [((0, 10), "must be > 0"), ((10, -1), "must be > 0"), ((10, 10, 0.0), "knee_factor")]:
        with pytest.raises(PolicyError, match=match):
            reference_budget_tokens(*args)


def test_snapshot_to_dict_is_json_and_complete() -> None:
    policy = _busy_policy()
    data = policy.snapshot().to_dict()
    assert json.loads(json.dumps(data)) == {
        "now_s": 5.0,
        "live": ["live"],
        "queued": ["queued"],
        "reserved_tokens": 900,
        "working_set_tokens": 100,
        "budget_tokens": 1000,
        "reference_budget_tokens": 1000,
        "is_engaged": True,
    }


def test_has_capacity_changes_nothing_and_predicts_arrive() -> None:
    policy = _busy_policy()
    before = pickle.dumps(policy)
    answers = {peak: policy.has_capacity(peak) for peak in (0, 100, 101, 10_000)}
    assert answers == {0: True, 100: True, 101: False, 10_000: False}
    assert pickle.dumps(policy) == before
    for peak, answer in answers.items():
        twin = pickle.loads(before)
        assert arrives(twin, "probe", 5.0, peak, 0) is answer


_LOOSEN = "loosen: sessions queued and hit rate on the plateau"
_TIGHTEN = "tighten: hit rate fell below the plateau"


def _operator(tokens: int) -> str:
    return f"operator set the reference budget to {tokens} tokens"


# --- lending ledger -------------------------------------------------------------------------------


def test_lending_is_capped_and_evicts_the_oldest_first() -> None:
    ledger = LendingLedger()
    ledger.add_instance("d0", 1001)  # cap = floor(1001 * 0.5) = 500
    ledger.add_instance("d1", 400)
    assert ledger.to_dict() == {
        "d0": {"capacity_tokens": 1001, "cap_tokens": 500, "lent_tokens": 0, "entries": {}},
        "d1": {"capacity_tokens": 400, "cap_tokens": 200, "lent_tokens": 0, "entries": {}},
    }
    assert ledger.lend("a", "d0", 200) == []
    assert ledger.lend("b", "d0", 200) == []
    assert ledger.lend("c", "d0", 100) == []  # exactly at the cap
    assert ledger.lent_tokens("d0") == 500
    assert ledger.lend("d", "d0", 250) == [LentEntry("a", "d0", 200), LentEntry("b", "d0", 200)]
    assert ledger.entries("d0") == (LentEntry("c", "d0", 100), LentEntry("d", "d0", 250))
    assert ledger.to_dict()["d0"] == {
        "capacity_tokens": 1001,
        "cap_tokens": 500,
        "lent_tokens": 350,
        "entries": {"c": 100, "d": 250},
    }
    assert ledger.to_dict()["d1"]["lent_tokens"] == 0  # another instance's cap is its own


def test_lending_again_replaces_the_older_copy_even_on_another_instance() -> None:
    ledger = LendingLedger()
    ledger.add_instance("d0", 1000)
    ledger.add_instance("d1", 1000)
    ledger.lend("a", "d0", 100)
    ledger.lend("b", "d0", 100)
    assert ledger.lend("a", "d1", 300) == [LentEntry("a", "d0", 100)]
    assert ledger.holder_of("a") == LentEntry("a", "d1", 300)
    assert ledger.to_dict()["d0"]["entries"] == {"b": 100}
    assert ledger.lend("b", "d0", 150) == [LentEntry("b", "d0", 100)]  # same instance: newest now
    assert ledger.to_dict()["d0"] == {
        "capacity_tokens": 1000,
        "cap_tokens": 500,
        "lent_tokens": 150,
        "entries": {"b": 150},
    }
    assert ledger.lend("a", "d1", 0) == [LentEntry("a", "d1", 300)]  # a zero-token copy is not kept
    assert ledger.holder_of("a") is None
    assert ledger.lent_tokens("d1") == 0


def test_a_copy_bigger_than_the_cap_is_not_kept_and_evicts_nothing() -> None:
    ledger = LendingLedger(lend_cap_fraction=0.25)
    ledger.add_instance("d0", 1000)  # cap 250
    ledger.lend("a", "d0", 200)
    assert ledger.lend("b", "d0", 251) == [LentEntry("b", "d0", 251)]
    assert ledger.entries("d0") == (LentEntry("a", "d0", 200),)
    assert ledger.holder_of("b") is None


def test_reclaim_frees_lent_memory_oldest_first() -> None:
    ledger = LendingLedger()
    ledger.add_instance("d0", 1000)
    for session_id, tokens in [("a", 100), ("b", 150), ("c", 200)]:
        ledger.lend(session_id, "d0", tokens)
    assert ledger.reclaim("d0", 0) == Reclaimed("d0", 0, 0, ())
    assert ledger.reclaim("d0", 120) == Reclaimed(
        "d0", 120, 250, (LentEntry("a", "d0", 100), LentEntry("b", "d0", 150))
    )
    assert ledger.reclaim("d0", 10_000) == Reclaimed("d0", 10_000, 200, (LentEntry("c", "d0", 200),))
    assert ledger.to_dict()["d0"] == {
        "capacity_tokens": 1000,
        "cap_tokens": 500,
        "lent_tokens": 0,
        "entries": {},
    }
    assert ledger.reclaim("d0", 50) == Reclaimed("d0", 50, 0, ())  # never negative


def test_write_back_plan_moves_only_the_longer_prefix() -> None:
    ledger = LendingLedger()
    ledger.add_instance("d0", 1000)
    assert ledger.write_back_plan("a", 0) is None  # nothing lent
    ledger.lend("a", "d0", 300)
    assert ledger.write_back_plan("a", 120) == WriteBackPlan("a", "d0", 300, 120, 180)
    assert ledger.write_back_plan("a", 300) is None  # prefill already has it all
    assert ledger.write_back_plan("a", 400) is None
    assert ledger.forget("a") == LentEntry("a", "d0", 300)
    assert ledger.forget("a") is None
    assert ledger.write_back_plan("a", 0) is None
    assert ledger.lent_tokens("d0") == 0


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (lambda lg: lg.lend("a", "nope", 1), "unknown decode instance 'nope'"),
        (lambda lg: lg.lend("a", "d0", -1), "lent tokens of session 'a' must be >= 0, got -1"),
        (lambda lg: lg.lend("", "d0", 1), "session_id must be a non-empty string"),
        (lambda lg: lg.lend("a", "d0", 1.5), "whole number of tokens"),
        (lambda lg: lg.reclaim("nope", 1), "unknown decode instance"),
        (lambda lg: lg.reclaim("d0", -1), "tokens_needed_by_decode on 'd0' must be >= 0"),
        (lambda lg: lg.write_back_plan("old", -1), "prefill_cached_tokens of session 'old'"),
        (lambda lg: lg.add_instance("d0", 10), "'d0' is already registered"),
        (lambda lg: lg.add_instance("d1", 0), "capacity_tokens of instance 'd1' must be > 0"),
        (lambda lg: lg.lent_tokens("nope"), "unknown decode instance"),
    ],
)
def test_ledger_illegal_step_raises_and_changes_nothing(step: Callable[[LendingLedger], object], match: str) -> None:
    ledger = LendingLedger()
    ledger.add_instance("d0", 100)
    ledger.lend("old", "d0", 30)
    before = pickle.dumps(ledger)
    with pytest.raises(PolicyError, match=match):
        step(ledger)
    assert pickle.dumps(ledger) == before


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, math.nan])
def test_ledger_rejects_a_bad_cap_fraction(fraction: float) -> None:
    with pytest.raises(PolicyError, match="lend_cap_fraction"):
        LendingLedger(lend_cap_fraction=fraction)


def test_operator_change_before_any_event_leaves_the_clock_unset() -> None:
    policy, t = make(1000)
    assert policy.set_reference_budget(2000) == [BudgetMoved(0.0, 1000, 1700, 2000, None, _operator(2000))]
    t.check(budget_tokens=1700, reference_budget_tokens=2000)
    assert arrives(policy, "a", 50.0, 10, 10) is True
    t.check(now_s=50.0, live=["a"], reserved_tokens=10, working_set_tokens=10)


# --- adoption (a session already running elsewhere, e.g. across a gateway restart) ---------------


def test_adopt_makes_a_session_live_over_budget_and_does_not_count_as_an_arrival() -> None:
    policy = new_policy(PolicyConfig(budget_tokens=100_000, always_engaged=True))
    assert arrives(policy, "a", 0.0, 90_000, 1_000) is True
    assert policy.adopt("old", 1.0, 50_000, 40_000) == [Admitted("old", 1.0, 1.0 + 50_000 / 30, 0.0, 50_000)]
    snap = policy.snapshot()
    assert snap.live == ("a", "old") and snap.queued == ()
    assert snap.reserved_tokens == 140_000 and snap.working_set_tokens == 41_000
    assert policy.priority_of("old") == pytest.approx(1.0 + 50_000 / 30)
    assert arrives(policy, "b", 2.0, 10_000, 1_000) is False  # new work still waits for room
    assert admits(policy.finish("old", 3.0)) == ["b"]  # 90K + 10K reserved fits the 100K budget exactly
    assert policy.snapshot().live == ("a", "b")


def test_adopt_refuses_a_duplicate_and_changes_nothing() -> None:
    policy = new_policy(PolicyConfig(budget_tokens=100_000))
    policy.adopt("old", 0.0, 5_000, 4_000)
    before = policy.snapshot()
    with pytest.raises(PolicyError, match="'old' arrived again"):
        policy.adopt("old", 1.0, 5_000, 4_000)
    assert policy.snapshot() == before

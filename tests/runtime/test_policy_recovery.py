"""Recovery at tool boundaries (`basin_runtime/policy/recovery.py`), driven step by step on scripted time."""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from basin_runtime.policy import Held, Policy, PolicyConfig, PolicyError, Resumed, Shed
from basin_runtime.policy.recovery import CONFIRM_TICKS

OFF, ON = 0.5, 0.95  # hit rates under and over the plateau's floor (0.9 - 0.05)


def policy(**overrides: object) -> Policy:
    """Four sessions of 200 tokens admitted (a..d, a first in priority), then grown to 350 each: 1400 > 1000."""
    config = {"budget_tokens": 1000, "hit_rate_plateau": 0.9, "hit_rate_tolerance": 0.05,
              "budget_min_fraction": 1.0, "budget_max_fraction": 1.0, **overrides}
    core = Policy(PolicyConfig(**config))  # type: ignore[arg-type]
    for i, sid in enumerate("abcd"):
        assert core.arrive(sid, float(i), 400.0, 200)[0].session_id == sid  # admitted: 800 fits
    for sid in "abcd":
        core.observe(sid, 4.0, 350)
    return core


def held(events: list[object]) -> list[str]:
    return [e.session_id for e in events if isinstance(e, Held)]


def resumed(events: list[object]) -> list[str]:
    return [e.session_id for e in events if isinstance(e, Resumed)]


def test_a_collapse_holds_the_lowest_priority_sessions_until_the_working_set_fits() -> None:
    core = policy()
    assert held(core.tick(10.0, OFF)) == []  # one tick off is not a knee
    events = core.tick(20.0, OFF)
    assert held(events) == ["d", "c"]  # 1400 -> 1050 -> 700 <= 1000: two, lowest priority first
    assert core.held_ids() == ("d", "c")
    assert all(core.is_live(s) for s in "abcd")  # still live, reservations kept
    assert core.reserved_tokens == 4 * 400
    assert held(core.tick(30.0, OFF)) == []  # the working set not held fits: nobody more


def test_detection_needs_both_signals() -> None:
    healthy_but_over = policy()
    for t in (10.0, 20.0, 30.0):
        assert healthy_but_over.tick(t, ON) == []  # over the budget, the hit rate on its plateau
    low_but_fits = Policy(PolicyConfig(budget_tokens=1000, budget_min_fraction=1.0, budget_max_fraction=1.0))
    for i, sid in enumerate("abcd"):
        low_but_fits.arrive(sid, float(i), 400.0, 200)
    for t in (10.0, 20.0, 30.0):
        assert held(low_but_fits.tick(t, OFF)) == []  # the hit rate off, the working set (800) within the budget
    assert low_but_fits.held_ids() == ()


def test_held_sessions_resume_by_priority_as_the_hit_rate_recovers_and_room_allows() -> None:
    core = policy()
    core.tick(10.0, OFF)
    core.tick(20.0, OFF)
    assert resumed(core.tick(30.0, ON)) == []  # back on the plateau on one tick only
    assert resumed(core.tick(40.0, ON)) == []  # c's 350 does not fit beside a and b (1050 > 1000)
    core.finish("a", 45.0)
    events = core.tick(50.0, ON)
    assert resumed(events) == ["c"]  # the highest priority first; then d no longer fits
    assert [e.held_s for e in events if isinstance(e, Resumed)] == [30.0]
    core.finish("b", 55.0)
    assert resumed(core.tick(60.0, ON)) == ["d"]
    assert core.held_ids() == ()


def test_a_hold_is_bounded_and_ends_in_a_resume_without_shedding() -> None:
    core = policy(recovery_max_hold_s=100.0)
    core.tick(10.0, OFF)
    core.tick(20.0, OFF)
    assert resumed(core.tick(119.0, OFF)) == []
    events = core.tick(120.0, OFF)  # still off the plateau, the working set over: the bound ends the hold
    assert resumed(events) == ["d", "c"]
    assert held(events) == ["b", "a"]  # never held again: the collapse goes on, the others take their turn
    assert held(core.tick(130.0, OFF)) == []
    assert resumed(core.tick(220.0, OFF)) == ["b", "a"]
    assert core.held_ids() == () and held(core.tick(230.0, OFF)) == []  # all four spent: nobody is held twice


def test_a_hold_that_runs_out_while_capacity_is_short_is_shed_never_lost() -> None:
    core = policy(recovery_max_hold_s=100.0, peak_completion_rate_per_s=1e-6)
    core.tick(10.0, OFF)
    core.tick(20.0, OFF)
    events = core.tick(120.0, OFF)
    sheds = [e for e in events if isinstance(e, Shed)]
    assert [e.session_id for e in sheds] == ["d", "c"] and all(e.waited_s == 100.0 for e in sheds)
    assert "held 100 s at its tool boundary" in sheds[0].reason
    assert core.live_ids() == ("a", "b") and core.snapshot().working_set_tokens == 700 and core.reserved_tokens == 800
    for sid in "cd":
        with pytest.raises(PolicyError):
            core.state_of(sid)


def test_a_held_session_that_ends_leaves_its_hold() -> None:
    core = policy()
    core.tick(10.0, OFF)
    core.tick(20.0, OFF)
    core.finish("d", 25.0)
    assert core.held_ids() == ("c",)
    core.observe("c", 26.0, 360)  # its held call reaches the door
    assert core.is_held("c") and core.snapshot().working_set_tokens == 350 * 3 + 10


def test_the_plateau_is_the_median_the_core_saw_while_the_cache_fit() -> None:
    core = Policy(PolicyConfig(budget_tokens=1000, budget_min_fraction=1.0, budget_max_fraction=1.0))
    for i, sid in enumerate("abcd"):
        core.arrive(sid, float(i), 400.0, 200)
    for t in (10.0, 20.0, 30.0):
        core.tick(t, 0.8)  # the cache fits (800): the plateau is 0.8 here, not the configured 0.9
    assert core.plateau_hit_rate() == pytest.approx(0.8)
    for sid in "abcd":
        core.observe(sid, 35.0, 350)
    assert held(core.tick(40.0, 0.8)) == [] and held(core.tick(50.0, 0.8)) == []  # on this plateau
    core.tick(60.0, 0.7)
    assert held(core.tick(70.0, 0.7)) == ["d", "c"]  # 0.7 < 0.8 - 0.05


def test_the_lone_session_is_never_held() -> None:
    core = Policy(PolicyConfig(budget_tokens=100, budget_min_fraction=1.0, budget_max_fraction=1.0))
    core.arrive("a", 0.0, 50.0, 50)
    core.observe("a", 1.0, 500)
    assert held(core.tick(10.0, OFF)) == [] and held(core.tick(20.0, OFF)) == []


def test_recovery_off_never_holds() -> None:
    core = policy(recovery=False)
    for t in (10.0, 20.0, 30.0):
        assert held(core.tick(t, OFF)) == []


def test_the_state_round_trips_with_sessions_held() -> None:
    core = policy(recovery_max_hold_s=100.0)
    core.tick(10.0, OFF)
    core.tick(20.0, OFF)
    state = json.loads(json.dumps(core.to_state()))
    restored = Policy.from_state(state)
    assert restored.to_state() == state and restored.held_ids() == ("d", "c")
    assert resumed(restored.tick(120.0, OFF)) == resumed(core.tick(120.0, OFF)) == ["d", "c"]
    bad = {**state, "recovery": {**state["recovery"], "held": [["zz", 1.0]]}}
    with pytest.raises(PolicyError, match="held session"):
        Policy.from_state(bad)


def test_confirm_is_the_knees() -> None:
    assert CONFIRM_TICKS == 2


# --- a state machine: the recovery's rules hold after every step, whatever the sequence -------------------------


class RecoveryMachine(RuleBasedStateMachine):
    """Arrivals, growing calls, ends and ticks with any hit rate against a small budget, recovery on (shedding on
    or off); after every step: the held are live, the holds follow the rules, nobody is lost, the state round-trips.
    """

    def __init__(self) -> None:
        super().__init__()
        self.core: Policy | None = None
        self.now = 0.0
        self.arrived: list[str] = []
        self.ended: set[str] = set()  # finished by the machine
        self.shed: set[str] = set()
        self.held_since: dict[str, float] = {}
        self.spent: set[str] = set()  # resumed by the bound: never held again

    @initialize(is_shedding=st.booleans(), ratio=st.sampled_from([1.0, 1.5]))
    def setup(self, is_shedding: bool, ratio: float) -> None:
        self.core = Policy(PolicyConfig(budget_tokens=400, reservation_ratio=ratio, recovery_max_hold_s=30.0,
                                        peak_completion_rate_per_s=1e-3 if is_shedding else None, shed_wait_s=20.0,
                                        arrival_window_s=100.0, budget_move_interval_s=5.0))

    @rule(dt=st.integers(0, 5), peak=st.integers(300, 800), context=st.integers(10, 100))
    def arrive(self, dt: int, peak: int, context: int) -> None:
        assert self.core is not None
        self.now += dt
        sid = f"s{len(self.arrived)}"
        self.arrived.append(sid)
        self.check(self.core.arrive(sid, self.now, float(peak), context), {})

    def draw_held(self, data: st.DataObject) -> str | None:
        """One session the core holds (live or queued), drawn; None if it holds none."""
        assert self.core is not None
        held = [s for s in self.arrived if self.core.is_live(s) or self.core.is_queued(s)]
        return data.draw(st.sampled_from(held)) if held else None

    @rule(data=st.data(), dt=st.integers(0, 5), growth=st.integers(0, 200))
    def call(self, data: st.DataObject, dt: int, growth: int) -> None:
        assert self.core is not None
        if (sid := self.draw_held(data)) is None:
            return
        self.now += dt
        self.check(self.core.observe(sid, self.now, self.core.record_of(sid).context_tokens + growth), {})

    @rule(dt=st.integers(0, 5), growth=st.integers(50, 300))
    def every_live_session_calls(self, dt: int, growth: int) -> None:
        """A wave of calls: every live session's context grows (the working set passes the budget)."""
        assert self.core is not None
        self.now += dt
        for sid in self.core.live_ids():
            if self.core.is_live(sid):
                self.check(self.core.observe(sid, self.now, self.core.record_of(sid).context_tokens + growth), {})

    @rule(dt=st.integers(1, 20), hit_rate=st.sampled_from([0.2, 0.5]), arrivals=st.integers(0, 4),
          growth=st.integers(50, 300))
    def collapse(self, dt: int, hit_rate: float, arrivals: int, growth: int) -> None:
        """Sessions arrive, every live one grows, and the hit rate is off on two ticks in a row."""
        for _ in range(arrivals):
            self.arrive(0, 500, 50)
        self.every_live_session_calls(0, growth)
        self.tick(dt, hit_rate)
        self.tick(dt, hit_rate)

    @rule(data=st.data(), dt=st.integers(0, 5))
    def finish(self, data: st.DataObject, dt: int) -> None:
        assert self.core is not None
        if (sid := self.draw_held(data)) is None:
            return
        self.now += dt
        self.held_since.pop(sid, None)
        self.ended.add(sid)
        self.check(self.core.finish(sid, self.now), {})

    @rule(dt=st.integers(1, 20), hit_rate=st.sampled_from([None, 0.2, 0.5, 0.5, 0.84, 0.86, 0.95, 1.0]))
    def tick(self, dt: int, hit_rate: float | None) -> None:
        assert self.core is not None
        self.now += dt
        before = {r.session_id: r for r in self.core.records() if self.core.is_live(r.session_id)}
        self.check(self.core.tick(self.now, hit_rate), before)

    def check(self, events: list[object], live_before: dict[str, object]) -> None:
        """The events against the rules, then the state."""
        core = self.core
        assert core is not None
        holds = [e for e in events if isinstance(e, Held)]
        for event in events:
            if isinstance(event, Held):
                assert event.session_id in live_before and event.session_id not in self.held_since
                self.held_since[event.session_id] = event.now_s
            elif isinstance(event, Resumed):
                assert event.held_s == event.now_s - self.held_since.pop(event.session_id)
                assert event.is_bounded == (event.held_s >= 30.0)
                if event.is_bounded:
                    self.spent.add(event.session_id)
            elif isinstance(event, Shed):
                self.shed.add(event.session_id)
                if event.session_id in self.held_since:  # a held session shed: only when its hold ran out
                    assert event.now_s - self.held_since.pop(event.session_id) >= 30.0
        for sid in list(self.held_since):  # a requeue (an outgrown call) ends a hold in silence
            if core.is_queued(sid):
                del self.held_since[sid]
        if holds:  # the held are the lowest priority: none running is behind one held now
            keys = {s: (r.priority, r.seq) for s, r in live_before.items()}  # type: ignore[attr-defined]
            running = [s for s in core.live_ids() if not core.is_held(s)]
            assert running, "the last live session is never held"
            newly = [e.session_id for e in holds]
            assert not self.spent.intersection(newly)
            ahead = [keys[s] for s in running if s in keys and s not in self.spent]
            assert not ahead or max(ahead) < min(keys[s] for s in newly)
        assert dict.fromkeys(core.held_ids()) == dict.fromkeys(self.held_since)
        assert all(core.is_live(s) for s in core.held_ids())
        assert all(self.now - t <= 30.0 + 20.0 for t in self.held_since.values())  # bounded (+ one tick gap)

    @invariant()
    def nobody_is_lost(self) -> None:
        if self.core is None:
            return
        for sid in self.arrived:
            places = [self.core.is_live(sid) or self.core.is_queued(sid), sid in self.ended, sid in self.shed]
            assert sum(places) == 1, (sid, places)

    @invariant()
    def state_round_trips(self) -> None:
        if self.core is None:
            return
        state = json.loads(json.dumps(self.core.to_state()))
        restored = Policy.from_state(state)
        assert restored.to_state() == state and restored.held_ids() == self.core.held_ids()


TestRecoveryMachine = RecoveryMachine.TestCase
TestRecoveryMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None)

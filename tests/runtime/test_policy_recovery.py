"""Recovery at tool boundaries (`basin_runtime/policy/recovery.py`), driven step by step on scripted time."""

from __future__ import annotations

import json

import pytest

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

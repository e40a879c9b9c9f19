"""The session lifecycle's one transition table (`basin_runtime/policy/lifecycle.py`) and its drivers."""

from __future__ import annotations

import typing

import pytest

from basin_runtime.policy import Policy, PolicyConfig
from basin_runtime.policy.lifecycle import (
    FINAL_STATES,
    TRANSITIONS,
    HeldState,
    LifecycleError,
    LifecycleEvent,
    SessionState,
    held_transition,
    transition,
)
from basin_sim.lifecycle import Status

STATES: tuple[SessionState, ...] = typing.get_args(SessionState)
EVENTS: tuple[LifecycleEvent, ...] = typing.get_args(LifecycleEvent)


@pytest.mark.parametrize(("state", "event"), sorted(TRANSITIONS))
def test_every_legal_transition_is_accepted(state: SessionState, event: LifecycleEvent) -> None:
    assert transition(state, event) == TRANSITIONS[(state, event)] in STATES


def test_every_step_the_table_does_not_list_raises_naming_the_state_and_the_step() -> None:
    illegal = [(s, e) for s in STATES for e in EVENTS if (s, e) not in TRANSITIONS]
    assert len(illegal) == len(STATES) * len(EVENTS) - len(TRANSITIONS)
    for state, event in illegal:
        with pytest.raises(LifecycleError, match=f"state '{state}' cannot '{event}'"):
            transition(state, event)


def test_an_illegal_step_names_both_states_and_what_the_state_allows() -> None:
    with pytest.raises(LifecycleError) as raised:
        transition("queued", "finish")
    assert str(raised.value) == ("a session in state 'queued' cannot 'finish' "
                                 "(from 'queued': abandon, admit, end, kill, shed)")
    with pytest.raises(LifecycleError, match="from 'finished': nothing, it is over"):
        transition("finished", "kill")


def test_final_states_have_no_way_out_and_every_state_is_reachable_from_arriving() -> None:
    assert {s for s, _ in TRANSITIONS} == {"arriving", "queued", "live"}
    assert set(STATES) - {"arriving", "queued", "live"} == FINAL_STATES
    reached, frontier = {"arriving"}, ["arriving"]
    while frontier:
        state = frontier.pop()
        for (s, _), after in TRANSITIONS.items():
            if s == state and after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(STATES)


def test_held_transition_moves_between_queued_and_live_only_by_the_table() -> None:
    assert held_transition("queued", "admit") == "live" and held_transition("live", "requeue") == "queued"
    held: tuple[HeldState, ...] = typing.get_args(HeldState)
    assert held == ("queued", "live")
    with pytest.raises(LifecycleError, match="state 'live' cannot 'admit'"):
        held_transition("live", "admit")
    with pytest.raises(LifecycleError, match="state 'queued' cannot 'requeue'"):
        held_transition("queued", "requeue")


def test_the_simulator_s_statuses_are_the_table_s_states_and_move_by_it() -> None:
    assert {s.value for s in Status} == set(STATES) - {"ended"}
    for status in Status:
        for event in EVENTS:
            if TRANSITIONS.get((status.value, event)) == "ended":  # the engine always says why a session ends
                with pytest.raises(ValueError, match="'ended' is not a valid Status"):
                    status.after(event)
            elif (status.value, event) in TRANSITIONS:
                assert status.after(event) is Status(TRANSITIONS[(status.value, event)])
            else:
                with pytest.raises(LifecycleError):
                    status.after(event)


def test_the_core_names_its_states_in_the_table_s_words() -> None:
    policy = Policy(PolicyConfig(budget_tokens=100, always_engaged=True))
    policy.arrive("a", 0.0, 80, 10)  # queued, then admitted as the lone head: arriving -> queued -> live
    policy.arrive("b", 1.0, 80, 10)  # it does not fit beside a: it stays queued
    assert (policy.state_of("a"), policy.state_of("b")) == ("live", "queued")
    policy.finish("a", 2.0)  # live -> ended; b is admitted: queued -> live
    assert policy.state_of("b") == "live" and not policy.is_live("a")

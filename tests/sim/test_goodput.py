"""Goodput as the paper defines it, on a small case computed by hand."""

from __future__ import annotations

import pytest

from basin_sim.goodput import Goodput, SessionOutcome, goodput, is_good


def outcome(sid: str, arrival: float, ended: float | None, unloaded: float | None = 100.0, status: str = "finished",
            steps: float = 1_000.0, good_steps: float = 1_000.0, is_burst: bool = False) -> SessionOutcome:
    return SessionOutcome(sid, arrival, ended, status, unloaded, steps, good_steps, is_burst)


CASE = [
    outcome("on-time", 0.0, 400.0),  # 400 <= 4 x 100: good
    outcome("just-in-time", 100.0, 500.0),  # exactly 4x: good
    outcome("late", 100.0, 500.1),  # a hair over 4x
    outcome("slow-steps", 200.0, 300.0, good_steps=949.0),  # 94.9% < 95% of steps under 50 ms
    outcome("enough-fast-steps", 200.0, 300.0, good_steps=950.0),  # exactly 95%: good
    outcome("no-steps", 300.0, 310.0, steps=0.0, good_steps=0.0),  # no decode step: the step rule holds
    outcome("killed", 300.0, 310.0, status="killed"),
    outcome("shed", 300.0, 300.0, status="shed"),
    outcome("unfinished", 400.0, None, status="live"),
    outcome("burst", 400.0, 410.0, is_burst=True),  # never counted
    outcome("before-window", -1.0, 10.0),
    outcome("after-window", 1800.0, 1810.0),
]


def test_goodput_counts_good_sessions_arriving_in_the_window_per_hour() -> None:
    # Window [0, 1800): 9 non-burst sessions arrived; 4 good; 6 finished; half an hour -> 8 per hour.
    assert goodput(CASE, 0.0, 1800.0) == Goodput(arrived=9, good=4, finished=6, per_hour=8.0)
    assert [o.session_id for o in CASE if is_good(o)] == \
        ["on-time", "just-in-time", "enough-fast-steps", "no-steps", "burst", "before-window", "after-window"]


def test_an_empty_or_inverted_window_is_an_error() -> None:
    with pytest.raises(ValueError, match="end > start"):
        goodput(CASE, 10.0, 10.0)


def test_a_session_without_an_unloaded_time_is_never_good() -> None:
    assert not is_good(outcome("x", 0.0, 1.0, unloaded=None))

"""The run summary's time-resolved parts: stuck, backlog drained, first-call wait by arrival minute."""

from __future__ import annotations

from typing import Any

import pytest

from basin_sim import run_summary
from basin_sim.goodput import SessionOutcome
from basin_sim.run_spec import RunSpec
from basin_sim.timeline import Timeline
from basin_sim.workload.scenarios import RateStep, Scenario
from tests.sim.builders import deployment

SURGE = Scenario("s", duration_s=600, warmup_s=0, goodput_from_s=0, goodput_to_s=600,
                 rate=(RateStep(0, per_min=1.0), RateStep(120, per_min=2.0), RateStep(240, per_min=1.0)))
SPEC = RunSpec(SURGE, deployment(), "sglang", 1, 0.0)


def _entries(backlog: list[int]) -> list[dict[str, Any]]:
    return [{"t_s": 60.0 * k, "held_sessions": b // 2, "queued": b - b // 2} for k, b in enumerate(backlog)]


def test_the_backlog_drains_at_the_first_minute_it_stays_within_its_pre_surge_peak() -> None:
    # pre = minutes 0-1 (peak 3); the surge ends at minute 4 (240 s); a relapse at minute 8 restarts the count
    assert run_summary._backlog_drained_after_s(_entries([2, 3, 9, 20, 15, 4, 3, 1, 5, 2]), SPEC) == 300.0
    assert run_summary._backlog_drained_after_s(_entries([2, 3, 9, 20, 15, 9, 3, 1, 2, 2]), SPEC) == 120.0
    assert run_summary._backlog_drained_after_s(_entries([2, 3, 9, 20, 1, 2, 2, 1, 2, 3]), SPEC) == 0.0
    assert run_summary._backlog_drained_after_s(_entries([2, 3, 9, 20, 15, 9, 8, 7, 6, 5]), SPEC) is None


def _timeline(hit_rates: list[float]) -> Timeline:
    timeline = Timeline(bin_s=60.0)
    for k, rate in enumerate(hit_rates):
        timeline.record_prefill(60.0 * k + 1.0, 1000, round(1000 * rate), 0)
    return timeline


@pytest.mark.parametrize(("post", "stuck"), [
    (0.27, True),   # the paper's collapse: 0.95 -> 0.27
    (0.55, True),   # under 0.6 and 0.4 below
    (0.62, False),  # 0.33 below, but not under 0.6
    (0.5, False),   # under 0.6, but only 0.2 below a pre-surge 0.7 (pre set below)
])
def test_stuck_means_under_0_6_and_0_3_below_the_pre_surge_hit_rate_over_the_last_20_minutes(
        post: float, stuck: bool) -> None:
    pre = 0.7 if post == 0.5 else 0.95
    timeline = _timeline([pre] * 10 + [post] * 25)
    window = (600.0, 35 * 60.0)
    assert run_summary._is_stuck(timeline, window, pre) is stuck
    # a run back at its pre-surge rate for the whole of the last 20 minutes is not stuck
    recovered = _timeline([pre] * 10 + [post] * 5 + [pre] * 20)
    assert run_summary._is_stuck(recovered, window, pre) is False


def _outcome(arrival_s: float, first_token_s: float | None, is_burst: bool = False) -> SessionOutcome:
    return SessionOutcome(session_id=f"s{arrival_s}", arrival_s=arrival_s,
                          ended_s=None if first_token_s is None else first_token_s + 5,
                          status="finished" if first_token_s is not None else "live", unloaded_s=10.0, steps=1.0,
                          good_steps=1.0, is_burst=is_burst, first_token_s=first_token_s)


def test_first_call_waits_are_grouped_by_arrival_minute_regular_sessions_only() -> None:
    outcomes = [_outcome(10, 11), _outcome(20, 50), _outcome(30, 31.5),  # minute 0: waits 1, 30, 1.5
                _outcome(70, None),  # minute 1: still waiting at the end (t = 400): 330 s
                _outcome(80, 500, is_burst=True)]  # a burst session is not counted
    waits = run_summary._waits_by_minute(outcomes, 400.0, 60.0)
    assert waits == {0: 1.5, 1: 330.0}

"""`basin` with the budget where completions peak against the ablation `basin:knee-budget` (today's budget): the
same calibration, the same queue and hit rates; only how far the adaptive budget may rise differs."""

from __future__ import annotations

from basin_runtime.policy.calibrated import Calibration
from basin_sim.experiments.ablations import ablation
from basin_sim.policies import BasinPolicy, PolicyContext, make_policy
from tests.sim.builders import deployment, session

# B = 0.9 x 8000 = 7200; the knee bound 1.1 x B = 7920; the ceiling C = the completion peak 12000 (r = 1)
CALIBRATION = Calibration(8_000.0, 10_000.0, hit_rate_plateau=0.95, completion_peak_tokens=12_000.0)
SESSIONS = [session("big", [8_000, 9_000]), session("next", [8_000, 9_000])]  # past B: admission engaged
PEAKS = {"big": 20_000.0, "next": 20_000.0}


def budgets(label: str, minutes: int, hit_rate: float) -> list[int]:
    """The budget a minute apart under `label`, with one session live and one waiting."""
    policy = make_policy("basin", PolicyContext(deployment(cache_tokens=10_000), PEAKS, calibration=CALIBRATION,
                                                policy_overrides=ablation(label).overrides))
    assert isinstance(policy, BasinPolicy)
    policy.on_arrival("big", 0.0, SESSIONS[0])
    policy.on_arrival("next", 0.0, SESSIONS[1])
    assert policy.core.snapshot().queued == ("next",)
    out = []
    for k in range(minutes):
        policy.on_tick(60.0 * (k + 1), hit_rate)
        out.append(policy.core.snapshot().budget_tokens)
    return out


def test_basin_rises_to_the_completion_peak_and_the_knee_budget_stops_at_ten_percent() -> None:
    assert budgets("basin", 60, 0.93)[-1] == 12_000
    assert budgets("basin:knee-budget", 60, 0.93)[-1] == 7_920
    assert budgets("basin:fixed-budget", 60, 0.93)[-1] == 7_200  # the fixed budget stays fixed, ceiling or not


def test_both_come_down_alike_when_the_hit_rate_falls_from_the_start() -> None:
    assert budgets("basin", 5, 0.5) == budgets("basin:knee-budget", 5, 0.5)

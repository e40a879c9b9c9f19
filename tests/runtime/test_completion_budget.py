"""The budget where completions peak (basin_runtime/policy/completion_budget.py), driven through the policy core
on scripted time: it rises to the ceiling only while the hit rate holds and sessions wait, and comes down when the
hit rate falls; the calibration it comes from, and the gateway reading calibration files with and without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_runtime.calibration import load_calibration
from basin_runtime.gateway.cli import ceiling_summary, startup_summary
from basin_runtime.gateway.config import GatewayConfig, build_parser, gateway_policy_config, load_config
from basin_runtime.policy import BudgetMoved, Policy, PolicyConfig, PolicyError
from basin_runtime.policy.calibrated import Calibration, policy_config
from basin_runtime.policy.completion_budget import completion_ceiling_tokens, tightened_tokens, upper_tokens

PLATEAU = 0.95  # with the default tolerance 0.05, the plateau holds at >= 0.90


def queued_policy(**settings: object) -> Policy:
    """B = 1000 (step 20, knee-based bounds 850..1100), one live session holding it all, one waiting."""
    config = PolicyConfig(budget_tokens=1000, always_engaged=True, hit_rate_plateau=PLATEAU,
                          budget_move_interval_s=60.0, **settings)  # type: ignore[arg-type]
    policy = Policy(config)
    policy.arrive("a", 0.0, 5000, 0)  # alone: admitted over the budget
    policy.arrive("b", 0.0, 5000, 0)  # waits
    assert policy.snapshot().queued == ("b",)
    return policy


def climb(policy: Policy, minutes: int, hit_rate: float, start_s: float = 0.0) -> list[int]:
    """The budget after each of `minutes` ticks a minute apart at `hit_rate`."""
    budgets = []
    for k in range(minutes):
        policy.tick(start_s + 60.0 * k, hit_rate)
        budgets.append(policy.budget_tokens)
    return budgets


def test_the_budget_rises_past_the_knee_bound_up_to_the_ceiling_while_the_hit_rate_holds_and_sessions_wait() -> None:
    policy = queued_policy(budget_ceiling_tokens=1300)
    budgets = climb(policy, 20, 0.93)
    assert budgets[:6] == [1020, 1040, 1060, 1080, 1100, 1120]  # the same 2% steps, on past 1100
    assert budgets[-1] == 1300 and max(budgets) == 1300  # stops at the ceiling
    assert policy.snapshot().queued == ("b",)  # b (5000) never fits: sessions kept waiting throughout


def test_without_the_switch_or_a_ceiling_the_budget_stops_at_the_knee_bound_as_before() -> None:
    for settings in ({"budget_ceiling_tokens": 1300, "completion_budget": False}, {}):
        policy = queued_policy(**settings)
        assert climb(policy, 20, 0.93)[-1] == 1100


def test_a_ceiling_below_the_knee_bound_changes_nothing() -> None:
    policy = queued_policy(budget_ceiling_tokens=900)
    assert climb(policy, 20, 0.93)[-1] == 1100


def test_it_rises_only_while_sessions_wait() -> None:
    config = PolicyConfig(budget_tokens=1000, always_engaged=True, hit_rate_plateau=PLATEAU,
                          budget_ceiling_tokens=1300)
    policy = Policy(config)
    policy.arrive("a", 0.0, 500, 0)
    assert climb(policy, 10, 0.99) == [1000] * 10  # nobody queued: no reason to loosen


def test_it_rises_only_while_the_hit_rate_holds_its_plateau() -> None:
    policy = queued_policy(budget_ceiling_tokens=1300)
    assert climb(policy, 3, 0.8999) == [980, 960, 940]  # off the plateau: down, as before


def test_when_the_hit_rate_falls_from_above_the_knee_bound_it_drops_there_at_once_then_steps_down() -> None:
    policy = queued_policy(budget_ceiling_tokens=1300)
    climb(policy, 12, 0.93)
    assert policy.budget_tokens == 1240
    events = policy.tick(720.0, 0.5)
    assert events == [BudgetMoved(720.0, 1240, 1100, 1000, 0.5, "tighten: hit rate fell below the plateau")]
    assert climb(policy, 3, 0.5, start_s=780.0) == [1080, 1060, 1040]  # then today's 2% steps
    assert policy.snapshot().live == ("a",)  # nobody evicted


def test_when_the_hit_rate_holds_again_it_climbs_again() -> None:
    policy = queued_policy(budget_ceiling_tokens=1300)
    climb(policy, 12, 0.93)
    policy.tick(720.0, 0.5)
    assert climb(policy, 2, 0.95, start_s=780.0) == [1120, 1140]


def test_the_rule_functions_alone() -> None:
    on = PolicyConfig(budget_tokens=1000, budget_ceiling_tokens=2000)
    off = PolicyConfig(budget_tokens=1000, budget_ceiling_tokens=2000, completion_budget=False)
    assert (upper_tokens(1000, on), upper_tokens(1000, off)) == (2000, 1100)
    assert tightened_tokens(1500, 20, 850, 1000, on) == 1100  # above the knee bound: straight to it
    assert tightened_tokens(1110, 20, 850, 1000, on) == 1090  # one step lands below it: the step
    assert tightened_tokens(860, 20, 850, 1000, on) == 850  # the floor holds
    assert completion_ceiling_tokens(1_000_000.4, 3.0) == 3_000_001
    with pytest.raises(PolicyError, match="reservation_ratio must be >= 1"):
        completion_ceiling_tokens(1000.0, 0.5)
    with pytest.raises(PolicyError, match="completion_peak_tokens must be > 0"):
        completion_ceiling_tokens(0.0)


@pytest.mark.parametrize(("settings", "fragment"), [
    ({"budget_ceiling_tokens": 0}, "budget_ceiling_tokens must be > 0, got 0"),
    ({"budget_ceiling_tokens": 1.5}, "budget_ceiling_tokens must be a whole number of tokens"),
    ({"completion_budget": 1}, "completion_budget must be a bool"),
])
def test_bad_settings_are_refused_naming_the_field(settings: dict[str, object], fragment: str) -> None:
    with pytest.raises(PolicyError, match=fragment):
        PolicyConfig(budget_tokens=1000, **settings)  # type: ignore[arg-type]


def test_policy_config_takes_the_ceiling_from_the_calibration_in_reservation_units() -> None:
    calibration = Calibration(knee_tokens=1000.0, cache_capacity_tokens=2000.0, reservation_ratio=2.0,
                              completion_peak_tokens=1500.0)
    basin = policy_config(calibration)
    assert (basin.budget_tokens, basin.budget_ceiling_tokens, basin.completion_budget) == (1800, 3000, True)
    proto = policy_config(calibration, {"mode": "prototype"})
    assert (proto.budget_tokens, proto.budget_ceiling_tokens) == (900, 1500)
    off = policy_config(calibration, {"completion_budget": False})
    assert (off.budget_ceiling_tokens, off.completion_budget) == (3000, False)
    assert policy_config(calibration, budget_tokens=500).budget_ceiling_tokens is None  # the operator's budget
    old = Calibration(knee_tokens=1000.0, cache_capacity_tokens=2000.0, reservation_ratio=2.0)
    assert policy_config(old).budget_ceiling_tokens is None


def gateway_config(*argv: str) -> GatewayConfig:
    return load_config(vars(build_parser().parse_args(["--upstream", "http://r:1", "--model", "m.onnx", *argv])))


def test_the_gateway_reads_old_and_new_calibration_files_and_says_which(tmp_path: Path) -> None:
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"knee_tokens": 100_000, "cache_capacity_tokens": 10**6, "reservation_ratio": 1.5,
                               "completion_peak_tokens": 250_000}))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"knee_tokens": 100_000, "cache_capacity_tokens": 10**6, "reservation_ratio": 1.5}))
    config = gateway_config("--calibration", str(new))
    measured = load_calibration(new)
    served = gateway_policy_config(config, measured)
    assert (served.budget_tokens, served.budget_ceiling_tokens) == (135_000, 375_000)
    assert "budget may rise to 375,000 tokens while the hit rate holds, completion peak 250,000" in \
        startup_summary(config, measured, served)
    before = load_calibration(old)
    unbounded = gateway_policy_config(gateway_config("--calibration", str(old)), before)
    assert unbounded.budget_ceiling_tokens is None
    line = startup_summary(config, before, unbounded)  # the start-up line cli.main logs
    assert "budget moves up to 1.1 x the reference budget: the calibration has no completion_peak_tokens" in line
    assert ceiling_summary(None, PolicyConfig(budget_tokens=10)) == "budget moves up to 1.1 x the reference budget"
    switched = PolicyConfig(budget_tokens=10, budget_ceiling_tokens=20, completion_budget=False)
    assert ceiling_summary(measured, switched).endswith("(completion_budget off)")

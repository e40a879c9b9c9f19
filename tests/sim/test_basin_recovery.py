"""Basin's recovery at tool boundaries in the engine: a collapse holds the lowest-priority session's next call,
closes its engine session (its KV evictable), and the session is resumed once the hit rate is back."""

from __future__ import annotations

import dataclasses

import pytest

from basin_runtime.policy.calibrated import Calibration
from basin_sim.engine import Engine
from basin_sim.experiments.ablations import ablation
from basin_sim.lifecycle import Status
from basin_sim.policies import make_policy
from basin_sim.policies.base import PolicyContext, RecoveryReport
from basin_sim.policies.basin import BasinPolicy
from tests.sim.builders import deployment, session, spec

OFF_FROM_S, OFF_TO_S = 10.0, 30.0  # the hit rate the policy is told is off its plateau in [10, 30) s


def run(name: str, **overrides: object) -> tuple[Engine, BasinPolicy, dict[float, tuple[bool, bool]]]:
    """Four sessions of three calls (2,000, 2,500, 3,000 tokens, 5 s of tool time) against a budget of 9,000:
    their second calls take the working set to 10,000. The policy is told a hit rate of 0.95, and 0.5 in
    [10, 30) s; the cache itself never evicts (100k tokens), so only the hit rate told is forced."""
    d = dataclasses.replace(deployment(cache_tokens=100_000), session_radix_cache=True)
    sessions = {f"s{k}": session(f"s{k}", [2_000, 2_500, 3_000], gap_s=5.0) for k in range(4)}
    policy = make_policy("basin", PolicyContext(d, dict.fromkeys(sessions, 3_000.0),
                                                calibration=Calibration(10_000.0, 100_000.0, hit_rate_plateau=0.9),
                                                policy_overrides={**ablation(name).overrides, **overrides}))
    assert isinstance(policy, BasinPolicy) and policy.core.budget_tokens == 9_000
    tick = policy.on_tick
    seen: dict[float, tuple[bool, bool]] = {}  # tick -> (s3 referenced on prefill, s0 referenced) before it

    def told(now: float, hit_rate: float | None, ttft_s: float | None = None) -> object:
        cache = engine.prefill[0].cache
        seen[now] = (cache.is_referenced("s3"), cache.is_referenced("s0"))
        return tick(now, 0.5 if OFF_FROM_S <= now < OFF_TO_S else 0.95, ttft_s)

    policy.on_tick = told  # type: ignore[method-assign]
    engine = Engine(d, policy, tick_s=1.0)
    for k, s in enumerate(sessions.values()):
        engine.add(spec(s, 0.1 * k, shared_tokens=50))
    return engine, policy, seen


def test_a_collapse_holds_the_lowest_priority_session_at_its_tool_boundary_and_resumes_it() -> None:
    engine, policy, seen = run("basin")
    engine.run_until(OFF_FROM_S + 1.0)  # off on two ticks (10, 11 s) with the working set at 10,000 > 9,000
    assert policy.core.held_ids() == ("s3",)  # the largest p (the latest arrival, the same peak)
    assert "s3" in engine.sessions.suspended and engine.runs["s3"].status == Status.LIVE
    engine.run_until(OFF_TO_S - 1.0)
    assert engine.runs["s3"].parked and engine.runs["s3"].next_call == 2  # its third call waits at the door
    assert [engine.runs[f"s{k}"].status for k in range(3)] == [Status.FINISHED] * 3
    assert seen[12.0] == (True, True) and seen[OFF_TO_S - 1.0][0] is False  # closed once its call parked
    assert engine.prefill[0].cache.has_chain("s3")  # its KV stays, unreferenced: evictable first
    engine.run_until(200.0)
    assert engine.runs["s3"].status == Status.FINISHED and policy.core.held_ids() == ()
    # s2 was held too, at 15 s (the budget had tightened to 8,820 and the third calls of s0-s2 make 9,000); its
    # call in flight was its last, so its hold ended with the session
    s2_held_s = engine.runs["s2"].ended_s - 15.0  # type: ignore[operator]
    assert policy.report().recovery == RecoveryReport(
        recovery_holds=2, recovery_sessions_held=2, recovery_resumes=1, recovery_resumes_bounded=0, recovery_sheds=0,
        recovery_hold_time_total_s=pytest.approx(20.0 + s2_held_s), recovery_hold_time_mean_s=pytest.approx(
            (20.0 + s2_held_s) / 2))
    assert engine.suspensions == 2
    engine.check()


def test_the_ablation_holds_nobody() -> None:
    engine, policy, _ = run("basin:no-recovery")
    engine.run_until(200.0)
    assert engine.suspensions == 0 and policy.report().recovery is None
    assert all(run.status == Status.FINISHED for run in engine.runs.values())


def test_a_held_session_whose_hold_runs_out_while_capacity_is_short_is_shed_in_the_engine() -> None:
    engine, policy, _ = run("basin", recovery_max_hold_s=5.0, peak_completion_rate_per_s=1e-6)
    engine.run_until(OFF_FROM_S + 5.0)
    assert engine.runs["s3"].parked  # held at 11 s, its third call parked at ~15 s
    engine.run_until(OFF_FROM_S + 6.0)  # the hold ran out at 16 s; arrivals outrun the peak completion rate
    run3 = engine.runs["s3"]
    assert run3.status == Status.SHED and run3.ended_s == 16.0 and run3.next_call == 2  # its parked call never sent
    assert not engine.prefill[0].cache.is_referenced("s3") and engine.num_parked == 0
    engine.check()
    engine.run_until(200.0)
    report = policy.report().recovery
    assert report is not None and report.recovery_sheds == 1 and report.recovery_resumes == 0
    engine.check()

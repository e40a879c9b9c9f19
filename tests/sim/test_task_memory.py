"""Basin's memory of finished tasks in the simulator (basin_sim/policies/task_memory.py, basin.py's seam)."""

from __future__ import annotations

import dataclasses
import math

from basin_runtime.policy import Policy
from basin_runtime.policy.calibrated import Calibration
from basin_runtime.session_table import Session
from basin_runtime.task_memory import Shrinkage, shrunk_peak
from basin_sim.experiments.ablations import ablation
from basin_sim.experiments.run_setup import Reserving, run_spec
from basin_sim.policies import BasinPolicy, PolicyContext, make_policy
from basin_sim.policies.base import TaskMemoryReport
from basin_sim.policies.basin import config_for
from basin_sim.workload.scenarios import RateStep, Scenario
from tests.sim.builders import deployment, session

K = 1.0
ON = Shrinkage(K)
PREDICTED = {"p1": 2_000.0, "p2": 3_000.0, "p3": 5_000.0, "other": 4_000.0}


def _pool() -> dict[str, Session]:
    """p1, p2 and p3 run one task (their texts differ in case and whitespace only); `other` another."""
    texts = {"p1": "Fix the bug", "p2": "fix  the\nBUG ", "p3": "Fix the bug", "other": "Write a parser"}
    prompts = {"p1": [1_000, 8_000], "p2": [1_000, 4_000, 16_000], "p3": [1_000, 2_000], "other": [1_000, 3_000]}
    return {sid: dataclasses.replace(session(sid, prompts[sid]), task_text=texts[sid]) for sid in texts}


def _context(task_memory: Shrinkage | None = ON) -> PolicyContext:
    return PolicyContext(deployment(cache_tokens=1_000_000), PREDICTED, 1.0,
                         calibration=Calibration(800_000.0, 1_000_000.0), task_memory=task_memory)


def _policy(task_memory: Shrinkage | None = ON) -> BasinPolicy:
    policy = make_policy("basin", _context(task_memory))
    assert isinstance(policy, BasinPolicy)
    return policy


def _run_through(policy: BasinPolicy, run_id: str, pool_session: Session, start: float, end: float) -> None:
    """A session arrives at `start`, every call is seen, and it ends at `end`."""
    policy.on_arrival(run_id, start, pool_session)
    for k, call in enumerate(pool_session.calls):
        policy.on_call(run_id, start + k + 0.5, call.prompt_tokens)
    policy.on_session_end(run_id, end)


def _told(policy: BasinPolicy, run_id: str, arrival_s: float) -> float:
    """The peak the core was told, read back from the session's priority (arrival + peak / tokens_per_s)."""
    return (policy.core.priority_of(run_id) - arrival_s) * policy.core.config.tokens_per_s


def test_basin_is_told_the_shrunk_peak_of_its_tasks_finished_sessions() -> None:
    pool, policy = _pool(), _policy()
    bare = Policy(config_for(_context(), "basin"))
    _run_through(policy, "r1", pool["p1"], 0.0, 10.0)
    _run_through(bare_free := _policy(None), "r1", pool["p1"], 0.0, 10.0)  # memory off: nothing is remembered
    bare.arrive("r1", 0.0, PREDICTED["p1"], 1_000)
    bare.observe("r1", 0.5, 1_000)
    bare.observe("r1", 1.5, 8_000)
    bare.finish("r1", 10.0)
    policy.on_arrival("r2", 20.0, pool["p2"])
    want = shrunk_peak(PREDICTED["p2"], [8_000.0], K)  # w = 1/2: sqrt(3000 x 8000)
    assert math.isclose(want, math.sqrt(3_000 * 8_000))
    bare.arrive("r2", 20.0, want, 1_000)
    assert policy.core.snapshot() == bare.snapshot()
    assert math.isclose(_told(policy, "r2", 20.0), want)
    bare_free.on_arrival("r2", 20.0, pool["p2"])
    assert math.isclose(_told(bare_free, "r2", 20.0), PREDICTED["p2"])  # the switch off: the prediction alone
    policy.on_arrival("r3", 21.0, pool["other"])
    assert math.isclose(_told(policy, "r3", 21.0), PREDICTED["other"])  # another task: no memory
    assert policy.report().task_memory == TaskMemoryReport(task_memory_sessions=3, task_memory_hits=1)
    assert bare_free.report().task_memory is None


def test_only_sessions_ended_before_the_arrival_count() -> None:
    pool, policy = _pool(), _policy()
    policy.on_arrival("r1", 0.0, pool["p1"])
    for k, call in enumerate(pool["p1"].calls):
        policy.on_call("r1", k + 0.5, call.prompt_tokens)
    policy.on_arrival("r2", 5.0, pool["p2"])  # r1 is still live
    assert math.isclose(_told(policy, "r2", 5.0), PREDICTED["p2"])
    policy.on_session_end("r1", 10.0)
    policy.on_arrival("r3", 10.0, pool["p3"])  # r1 ends at the same instant: not before
    assert math.isclose(_told(policy, "r3", 10.0), PREDICTED["p3"])
    policy.on_arrival("r4", 10.5, pool["p3"])
    assert math.isclose(_told(policy, "r4", 10.5), shrunk_peak(PREDICTED["p3"], [8_000.0], K))


def test_a_replayed_trajectory_never_finds_its_own_peak() -> None:
    pool, policy = _pool(), _policy()
    _run_through(policy, "r1", pool["p1"], 0.0, 10.0)
    _run_through(policy, "r2", pool["p1"], 11.0, 20.0)  # p1 drawn again (with replacement)
    policy.on_arrival("r3", 30.0, pool["p1"])  # and again: both earlier runs are its own trajectory
    assert math.isclose(_told(policy, "r3", 30.0), PREDICTED["p1"])
    _run_through(policy, "r4", pool["p2"], 31.0, 40.0)
    policy.on_arrival("r5", 50.0, pool["p1"])  # p2's peak only
    assert math.isclose(_told(policy, "r5", 50.0), shrunk_peak(PREDICTED["p1"], [16_000.0], K))
    policy.on_arrival("r6", 50.0, pool["p3"])  # p1's two runs and p2's
    assert math.isclose(_told(policy, "r6", 50.0), shrunk_peak(PREDICTED["p3"], [8_000.0, 8_000.0, 16_000.0], K))


def test_a_session_ended_before_its_last_call_is_not_remembered_and_a_retry_counts_once() -> None:
    pool, policy = _pool(), _policy()
    policy.on_arrival("r1", 0.0, pool["p2"])
    policy.on_call("r1", 0.5, 1_000)
    policy.on_call("r1", 1.5, 4_000)
    policy.on_call("r1", 2.0, 4_000)  # a retry of call 2, not call 3
    policy.on_session_end("r1", 3.0)  # killed before its last call
    policy.on_arrival("r2", 5.0, pool["p1"])
    assert math.isclose(_told(policy, "r2", 5.0), PREDICTED["p1"])


def test_run_spec_hands_the_memory_to_basin_only_and_the_ablation_turns_it_off() -> None:
    told = Reserving(peaks=dict(PREDICTED), task_memory=Shrinkage(K))
    scenario = Scenario("s", duration_s=60.0, warmup_s=0.0, goodput_from_s=0.0, goodput_to_s=60.0,
                        rate=(RateStep(0.0, per_min=1.0),))
    assert run_spec(scenario, deployment(), "basin", 1, 1.0, None, told).task_memory == Shrinkage(K)
    assert run_spec(scenario, deployment(), "sglang", 1, 1.0, None, told).task_memory is None
    assert ablation("basin:no-task-memory").task_memory is False
    assert ablation("basin").task_memory is True

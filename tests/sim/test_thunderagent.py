"""ThunderAgent (Dynamo's thunderagent_router) as published: who is paused (idle programs, smallest first; running
ones marked and paused at their answer), who resumes (groups, smallest first, under the 0.85 ceiling), the paused
program's next call held until then (or forced after the timeout), soft demotes that only reorder, and a run."""

from __future__ import annotations

import math

from basin_sim.engine import Engine
from basin_sim.lifecycle import Status
from basin_sim.policies import Decisions, PolicyContext, ThunderAgentPolicy, make_policy
from basin_sim.policies.thunderagent import RESUME_TIMEOUT_S
from tests.sim.builders import deployment, session, spec

CAP = 10_000  # pause above 9,500 used, down to 8,000; resume under 8,500; soft demote from 8,000


def _running(policy: ThunderAgentPolicy, prompts: dict[str, int]) -> None:
    """Admit these programs (arrival order) and send their first calls: all REASONING."""
    for t, (sid, prompt) in enumerate(prompts.items()):
        assert policy.on_arrival(sid, float(t), session(sid, [prompt, prompt])) == Decisions(admit=(sid,))
        assert policy.on_call(sid, float(t), prompt) == Decisions()


def test_the_budget_is_the_prefill_kv_and_its_host_tier() -> None:
    d = deployment(cache_tokens=4_000, host_tokens=3_000, num_prefill=2)
    policy = make_policy("thunderagent", PolicyContext(d))
    assert isinstance(policy, ThunderAgentPolicy) and policy.capacity_tokens == 14_000


def test_only_acting_programs_are_paused_at_once_smallest_first_down_to_the_target() -> None:
    policy = ThunderAgentPolicy(CAP)
    _running(policy, {"a": 2_000, "b": 3_000, "c": 2_000, "d": 1_000})
    assert policy.on_answer("a", 5.0, 2_000, 100) == Decisions()  # ACTING, 2,100
    assert policy.on_answer("c", 6.0, 2_000, 1_200) == Decisions()  # ACTING, 3,200
    assert policy.used_tokens() == 2_100 + 3_000 + 3_200 + 1_000 + 400  # 9,700 > 9,500
    assert policy.on_schedule(10.0) == Decisions(suspend=("a",))  # 7,600 <= 8,000: c (bigger) stays
    report = policy.report().pauses
    assert report is not None and (report.pauses, report.pause_marks) == (1, 0)


def test_reasoning_programs_are_marked_and_paused_at_their_answer_never_at_once() -> None:
    policy = ThunderAgentPolicy(CAP)
    _running(policy, {"a": 1_000, "b": 4_300, "c": 4_200})
    assert policy.on_answer("a", 5.0, 900, 100) == Decisions()  # ACTING 1,000; used 9,800
    assert policy.on_schedule(10.0) == Decisions(suspend=("a",))  # 8,700 > 8,000: b and c marked
    assert [sid for sid, p in policy.programs.items() if p.marked] == ["b", "c"]
    assert policy.used_tokens() == 4_300 + 4_200 + 200  # marking frees nothing
    assert policy.on_schedule(15.0) == Decisions()  # nothing left to pause; a cannot come back
    assert policy.on_answer("c", 16.0, 4_200, 100) == Decisions(suspend=("c",))  # at its tool boundary
    assert policy.on_answer("b", 17.0, 4_300, 100) == Decisions(suspend=("b",))
    report = policy.report().pauses
    assert report is not None and (report.pauses, report.pause_marks) == (3, 2)


def test_resume_takes_groups_smallest_first_and_stays_under_the_ceiling() -> None:
    policy = ThunderAgentPolicy(CAP)
    _running(policy, {"big": 3_000, "p": 1_000, "q": 2_000, "r": 3_000})
    for sid, prompt in (("p", 1_000), ("q", 2_000), ("r", 3_000)):
        policy.on_answer(sid, 5.0, prompt, 0)  # idle, ACTING
    policy.on_call("big", 6.0, 3_500)  # used 9,900
    assert policy.on_schedule(10.0) == Decisions(suspend=("p", "q"))  # smallest first: 6,700 <= 8,000
    assert policy.on_call("q", 11.0, 2_500) == Decisions()  # q's next call: held (its wait starts)
    assert policy.on_arrival("n", 12.0, session("n", [500])) == Decisions()  # new: queued behind paused ones
    assert policy.on_session_end("r", 13.0) == Decisions()  # resumes wait for the tick
    # used 3,600: headroom 8,500 - 3,600 = 4,900; order q (group 0, 2,600), n (group 1, 600), p (group 2, 1,100)
    assert policy.on_schedule(15.0) == Decisions(admit=("n",), resume=("q", "p"))
    assert policy.used_tokens() <= 0.85 * CAP
    policy2 = ThunderAgentPolicy(CAP)
    _running(policy2, {"big": 5_000, "p": 1_000, "q": 1_500, "s": 900})
    for sid, prompt in (("p", 1_000), ("q", 1_500), ("s", 900)):
        policy2.on_answer(sid, 5.0, prompt, 0)
    policy2.on_call("big", 6.0, 7_000)  # used 10,800
    assert policy2.on_schedule(10.0) == Decisions(suspend=("s", "p", "q"))
    policy2.on_call("big", 11.0, 5_500)  # used 5,600: headroom 2,900
    assert policy2.on_schedule(15.0) == Decisions(resume=("p", "s"))  # 1,000 + 1,100; q's 1,600 would not fit
    assert policy2.used_tokens() == 5_600 + 1_100 + 1_000 <= 0.85 * CAP


def test_a_paused_program_waiting_that_long_is_forced_back_whatever_the_capacity() -> None:
    policy = ThunderAgentPolicy(CAP)
    _running(policy, {"big": 5_000, "p": 1_000})
    policy.on_answer("p", 1.0, 1_000, 0)
    policy.on_call("big", 2.0, 9_000)
    assert policy.on_schedule(5.0) == Decisions(suspend=("p",))
    assert policy.on_call("p", 20.0, 1_200) == Decisions()  # waits
    assert policy.on_schedule(20.0 + RESUME_TIMEOUT_S - 5.0) == Decisions()  # no room, not yet timed out
    assert policy.on_schedule(20.0 + RESUME_TIMEOUT_S) == Decisions(resume=("p",))
    report = policy.report().pauses
    assert report is not None and (report.pause_forced_resumes, report.pause_resumes) == (1, 0)
    assert report.pause_time_total_s == report.pause_time_mean_s == 20.0 + RESUME_TIMEOUT_S - 5.0
    assert policy.priority("p", 2_000.0) == 2_000.0 - 1.0  # the released call: ahead by 1 s


def test_soft_demote_only_in_the_band_and_only_moves_the_request_later() -> None:
    policy = ThunderAgentPolicy(CAP)
    _running(policy, {"a": 4_000, "b": 3_800})  # 8,000: in [0.80, 0.95)
    assert policy.on_schedule(10.0) == Decisions()  # nothing held or paused
    assert policy.priority("a", 12.0) == 14.0 and policy.priority("b", 17.4) == 19.4  # window: 7.5 s
    assert policy.priority("a", 17.5) == 17.5
    policy.on_answer("b", 18.0, 3_000, 0)  # 7,200: below the band
    assert policy.on_schedule(20.0) == Decisions()
    assert policy.priority("a", 21.0) == 21.0
    report = policy.report().pauses
    assert report is not None and report.pause_soft_demote_windows == 2 and report.pauses == 0


def test_the_engine_holds_a_paused_programs_next_call_until_it_is_resumed() -> None:
    """Three programs on a 10,000-token budget, over 95 % at the 5 s tick: a and b are calling again
    (REASONING), c is idle in its tool (ACTING), so c alone is paused; its next call waits at the door (no
    request) until the tick after a and b finish resumes it."""
    d = deployment(cache_tokens=CAP, decode_tokens=100_000)
    policy = make_policy("thunderagent", PolicyContext(d))
    engine = Engine(d, policy, tick_s=None)  # its own 5 s scheduler runs all the same
    engine.add(spec(session("a", [3_000, 3_100], completion=100, gap_s=4.0), 0.0))
    engine.add(spec(session("b", [3_300, 3_400], completion=100, gap_s=4.0), 0.1))
    engine.add(spec(session("c", [2_900, 3_000], completion=100, gap_s=6.0), 0.2))
    parked_at = sent_at = None
    for step in range(1, 1_000):
        engine.run_until(step * 0.05)
        engine.check()
        c = engine.runs["c"]
        if c.parked and parked_at is None:
            parked_at = engine.now
        if parked_at is not None and sent_at is None and not c.parked:
            sent_at = engine.now
            assert c.request is not None
    engine.run_until(200.0)
    engine.check()
    assert all(run.status == Status.FINISHED for run in engine.runs.values())
    assert parked_at is not None and sent_at is not None and sent_at > parked_at and sent_at % 5.0 < 0.05
    report = policy.report().pauses
    assert report is not None and report.pauses == 1 and report.pause_resumes == 1
    assert report.pause_time_total_s > 0


def test_a_new_program_waits_at_the_door_for_room_and_a_tick() -> None:
    d = deployment(cache_tokens=5_000, decode_tokens=100_000)
    engine = Engine(d, make_policy("thunderagent", PolicyContext(d)), tick_s=None)
    engine.add(spec(session("a", [3_000, 3_500], completion=100, gap_s=5.0), 0.0))
    engine.add(spec(session("b", [3_000, 3_500], completion=100, gap_s=5.0), 0.5))
    engine.run_until(1.0)
    assert engine.runs["b"].status == Status.QUEUED
    engine.run_until(200.0)
    engine.check()
    b = engine.runs["b"]
    assert b.status == Status.FINISHED and b.admitted_s is not None and b.admitted_s >= engine.runs["a"].ended_s


def test_the_schedulers_turns_stop_with_the_workload_and_start_again_on_their_grid() -> None:
    """`run_until(math.inf)` ends once nothing is left; a session added later brings the 5 s turns back,
    at multiples of the interval."""
    d = deployment(cache_tokens=CAP, decode_tokens=100_000)
    turns: list[float] = []

    class Counted(ThunderAgentPolicy):
        def on_schedule(self, now: float) -> Decisions:
            turns.append(now)
            return super().on_schedule(now)

    engine = Engine(d, Counted(CAP), tick_s=None)
    engine.add(spec(session("a", [3_000, 3_100], completion=100, gap_s=12.0), 0.0))
    engine.run_until(math.inf)
    a_ended = engine.runs["a"].ended_s
    assert engine.runs["a"].status == Status.FINISHED and a_ended is not None
    assert turns and a_ended <= max(turns) <= a_ended + 5.0 and engine.now == max(turns)  # the last event
    stopped = len(turns)
    engine.add(spec(session("b", [3_000], completion=100), engine.now + 7.3))
    engine.run_until(math.inf)
    assert engine.runs["b"].status == Status.FINISHED
    assert len(turns) > stopped and turns[stopped] == turns[stopped - 1] + 5.0  # the next point of the grid
    assert all(t % 5.0 == 0.0 for t in turns) and max(turns) >= engine.runs["b"].spec.arrival_s

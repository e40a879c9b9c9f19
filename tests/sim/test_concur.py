"""Concur (arXiv 2601.22705) as the simulator models it: an AIMD window over the sessions admitted at once,
moved by the prefix hit rate and the admitted working set; whole sessions admitted first come first served,
never deferred once admitted; the window's series in the report; a run in the engine."""

from __future__ import annotations

import pytest

from basin_sim.engine import Engine
from basin_sim.lifecycle import Status
from basin_sim.policies import ConcurPolicy, Decisions, PolicyContext, make_policy
from basin_sim.policies.concur import ALPHA, INITIAL_WINDOW
from tests.sim.builders import deployment, session, spec

CAP = 10_000  # U = admitted working set / 10,000: increase under 2,000, decrease over 5,000 with H < 0.2


def _arrive(policy: ConcurPolicy, prompts: dict[str, int], at: float = 0.0) -> list[Decisions]:
    """These sessions arrive in order, 0.1 s apart from `at`; their decisions."""
    return [policy.on_arrival(sid, at + 0.1 * k, session(sid, [prompt, prompt]))
            for k, (sid, prompt) in enumerate(prompts.items())]


def _full(policy: ConcurPolicy, prompt: int) -> None:
    """Fill the initial window with sessions of this first prompt."""
    decisions = _arrive(policy, {f"s{k}": prompt for k in range(INITIAL_WINDOW)})
    assert decisions == [Decisions(admit=(f"s{k}",)) for k in range(INITIAL_WINDOW)]


def test_the_usage_is_the_admitted_working_set_over_the_prefill_kv_without_its_host_tier() -> None:
    d = deployment(cache_tokens=4_000, host_tokens=3_000, num_prefill=2)
    policy = make_policy("concur", PolicyContext(d))
    assert isinstance(policy, ConcurPolicy) and policy.capacity_tokens == 8_000
    assert policy.window == INITIAL_WINDOW == 10
    _arrive(policy, {"a": 1_000, "b": 1_000})
    policy.on_call("a", 5.0, 3_000)  # its context grew
    assert policy.usage() == (3_000 + 1_000) / 8_000


def test_the_window_halves_when_the_hit_rate_falls_with_the_working_set_over_half() -> None:
    policy = ConcurPolicy(CAP)
    _full(policy, 600)  # U = 0.6
    assert policy.on_tick(10.0, hit_rate=0.5) == Decisions() and policy.window == 10  # hit rate holds: hold
    assert policy.on_tick(20.0, hit_rate=None) == Decisions() and policy.window == 10  # no evidence: hold
    assert policy.on_tick(30.0, hit_rate=0.1) == Decisions() and policy.window == 5  # thrashing: x0.5
    assert policy.on_tick(40.0, hit_rate=0.1) == Decisions() and policy.window == 2  # floor(2.5)
    policy.on_tick(50.0, hit_rate=0.1)
    policy.on_tick(60.0, hit_rate=0.1)
    assert policy.window == 1  # never under one session
    report = policy.report().admission
    assert report is not None and (report.admission_decreases, report.admission_increases) == (3, 0)


def test_a_low_hit_rate_alone_does_not_shrink_a_window_whose_working_set_fits() -> None:
    policy = ConcurPolicy(CAP)
    _full(policy, 500)  # U = 0.5, not over U_HIGH
    assert policy.on_tick(10.0, hit_rate=0.0) == Decisions() and policy.window == 10


def test_the_window_grows_back_by_two_while_it_is_used_and_the_working_set_is_small() -> None:
    policy = ConcurPolicy(CAP)
    _full(policy, 600)
    policy.on_tick(10.0, hit_rate=0.1)  # W 5, ten still admitted
    assert _arrive(policy, {"late1": 100, "late2": 100, "late3": 100}, at=11.0) == [Decisions()] * 3
    entered = {5: ("late1",), 6: ("late2",), 7: ("late3",)}  # each once fewer than five are admitted
    for k in range(INITIAL_WINDOW):
        assert policy.on_session_end(f"s{k}", 12.0 + k) == Decisions(admit=entered.get(k, ()))
    assert policy.usage() == 0.03 and policy.window == 5
    assert policy.on_tick(30.0, hit_rate=0.9) == Decisions() and policy.window == 5  # not used: no growth
    _arrive(policy, {"n1": 100, "n2": 100, "n3": 100, "n4": 100}, at=31.0)  # n1, n2 fill it; n3, n4 wait
    assert policy.on_tick(40.0, hit_rate=0.9) == Decisions(admit=("n3", "n4")) and policy.window == 5 + ALPHA


def test_sessions_beyond_the_window_wait_and_enter_first_come_first_served() -> None:
    policy = ConcurPolicy(CAP)
    _full(policy, 100)
    assert _arrive(policy, {"x": 100, "y": 100, "z": 100}, at=5.0) == [Decisions()] * 3
    assert policy.on_session_end("y", 6.0) == Decisions()  # withdrawn at the door: leaves the queue
    assert policy.on_session_end("s3", 7.0) == Decisions(admit=("x",))
    assert _arrive(policy, {"w": 100}, at=7.5) == [Decisions()]  # z still waits: w queues behind it
    assert policy.on_session_end("s0", 8.0) == Decisions(admit=("z",))
    assert policy.on_session_end("s1", 9.0) == Decisions(admit=("w",))
    report = policy.report().admission
    assert report is not None and report.admission_deferred == 4
    assert report.admission_wait_total_s == pytest.approx((7.0 - 5.0) + (8.0 - 5.2) + (9.0 - 7.5))
    assert report.admission_wait_mean_s == pytest.approx(report.admission_wait_total_s / 4)


def test_the_report_gives_the_window_at_each_minutes_end_and_its_min_mean_max() -> None:
    policy = ConcurPolicy(CAP)
    _full(policy, 600)
    policy.on_tick(30.0, hit_rate=0.1)  # 5 from 30 s
    policy.on_tick(70.0, hit_rate=0.1)  # 2 from 70 s
    for k in range(INITIAL_WINDOW):
        policy.on_session_end(f"s{k}", 100.0)
    _arrive(policy, {"a": 100, "b": 100, "c": 100}, at=100.0)
    policy.on_tick(130.0, hit_rate=0.9)  # used (c waits), U = 0.02: 4 from 130 s
    policy.on_tick(200.0, hit_rate=0.9)  # not used (3 admitted < 4): holds
    report = policy.report().admission
    assert report is not None
    assert report.admission_window_per_minute == (5, 2, 4, 4)  # minutes ending 60, 120, 180, 240 s
    assert (report.admission_window_min, report.admission_window_mean, report.admission_window_max) == (2, 3.75, 5)
    assert (report.admission_increases, report.admission_decreases) == (1, 2)


def test_in_the_engine_an_admitted_session_is_never_held_and_the_door_wait_counts_in_its_first_call() -> None:
    """Twelve sessions on a 10,000-token prefill KV: ten enter, two wait; at the 10 s tick the working set
    (ten 600-token prompts) is over half the KV and the measured hit rate is near 0 (one shared token, only
    first calls answered), so the window halves; no admitted session is held, and the two waiting enter only
    once fewer than five are live, their first-call wait running from their arrival."""
    d = deployment(cache_tokens=CAP)
    policy = make_policy("concur", PolicyContext(d))
    engine = Engine(d, policy, tick_s=10.0)
    for k in range(12):
        engine.add(spec(session(f"s{k}", [600, 650, 700], completion=50, gap_s=15.0), 0.1 * k, shared_tokens=1))
    engine.run_until(200.0)
    engine.check()
    assert all(run.status == Status.FINISHED for run in engine.runs.values())
    assert engine.suspensions == 0
    runs = [engine.runs[f"s{k}"] for k in range(12)]
    assert all(run.admitted_s == pytest.approx(0.1 * k) for k, run in enumerate(runs[:10]))
    assert all(run.admitted_s is not None and run.admitted_s > 10.0 for run in runs[10:])
    for k, run in enumerate(runs[10:], start=10):
        assert run.first_token_s is not None and run.admitted_s is not None
        assert run.first_token_s - 0.1 * k > run.admitted_s - 0.1 * k > 10.0
    report = policy.report().admission
    assert report is not None and report.admission_decreases == 1 and report.admission_deferred == 2
    assert report.admission_window_min == 5
    ended = sorted(run.ended_s for run in runs[:10] if run.ended_s is not None)
    assert runs[10].admitted_s == ended[5] and runs[11].admitted_s == ended[6]  # FCFS as the window opens

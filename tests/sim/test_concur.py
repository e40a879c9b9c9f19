"""Concur (arXiv 2601.22705) as the simulator models it: an AIMD window over the sessions admitted at once,
moved by the prefix hit rate and the decode KV usage (SGLang's token usage); whole sessions admitted first
come first served, never deferred once admitted; the window's series in the report; a run in the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from basin_runtime.session_table import Call, Session
from basin_sim.engine import Engine
from basin_sim.lifecycle import Status
from basin_sim.policies import CacheController, ConcurPolicy, Decisions, PolicyContext, make_policy
from basin_sim.policies.concur import ALPHA, INITIAL_WINDOW
from tests.sim.builders import deployment, session, spec


def _arrive(policy: ConcurPolicy, names: list[str], at: float = 0.0) -> list[Decisions]:
    """These sessions arrive in order, 0.1 s apart from `at`; their decisions."""
    return [policy.on_arrival(sid, at + 0.1 * k, session(sid, [1_000])) for k, sid in enumerate(names)]


def _full() -> ConcurPolicy:
    """A policy whose initial window is filled by s0..s9."""
    policy = ConcurPolicy()
    names = [f"s{k}" for k in range(INITIAL_WINDOW)]
    assert _arrive(policy, names) == [Decisions(admit=(sid,)) for sid in names]
    return policy


def test_concur_is_registered_as_a_cache_controller_starting_at_ten_sessions() -> None:
    policy = make_policy("concur", PolicyContext(deployment()))
    assert isinstance(policy, ConcurPolicy) and isinstance(policy, CacheController)
    assert policy.window == INITIAL_WINDOW == 10
    assert policy.on_tick(10.0, 0.0) == Decisions() and policy.window == 10  # the control step is on_control


def test_the_window_halves_when_the_hit_rate_falls_with_the_kv_usage_over_half() -> None:
    policy = _full()
    assert policy.on_control(10.0, hit_rate=0.5, kv_usage=0.6) == Decisions() and policy.window == 10  # hold
    assert policy.on_control(20.0, hit_rate=None, kv_usage=0.6) == Decisions() and policy.window == 10  # no evidence
    assert policy.on_control(30.0, hit_rate=0.1, kv_usage=0.6) == Decisions() and policy.window == 5  # x0.5
    assert policy.on_control(40.0, hit_rate=0.1, kv_usage=0.6) == Decisions() and policy.window == 2  # floor(2.5)
    policy.on_control(50.0, hit_rate=0.1, kv_usage=0.6)
    policy.on_control(60.0, hit_rate=0.1, kv_usage=0.6)
    assert policy.window == 1  # never under one session
    for k in range(INITIAL_WINDOW):  # ten admitted over a window of one: their calls still go, none is held
        assert policy.on_call(f"s{k}", 70.0, 2_000) == Decisions()
    assert len(policy.admitted) == INITIAL_WINDOW
    report = policy.report().admission
    assert report is not None and (report.admission_decreases, report.admission_increases) == (3, 0)


def test_a_low_hit_rate_alone_does_not_shrink_the_window_while_the_kv_usage_is_at_most_half() -> None:
    policy = _full()
    assert policy.on_control(10.0, hit_rate=0.0, kv_usage=0.5) == Decisions() and policy.window == 10


def test_the_window_grows_by_two_under_a_fifth_of_the_kv_only_while_it_is_used() -> None:
    policy = _full()
    policy.on_control(10.0, hit_rate=0.1, kv_usage=0.6)  # W 5, ten still admitted
    assert _arrive(policy, ["late1", "late2", "late3"], at=11.0) == [Decisions()] * 3
    entered = {5: ("late1",), 6: ("late2",), 7: ("late3",)}  # each once fewer than five are admitted
    for k in range(INITIAL_WINDOW):
        assert policy.on_session_end(f"s{k}", 12.0 + k) == Decisions(admit=entered.get(k, ()))
    assert len(policy.admitted) == 3 and policy.window == 5
    assert policy.on_control(30.0, hit_rate=0.9, kv_usage=0.1) == Decisions() and policy.window == 5  # not used
    _arrive(policy, ["n1", "n2", "n3", "n4"], at=31.0)  # n1, n2 fill it; n3, n4 wait
    assert policy.on_control(40.0, hit_rate=0.9, kv_usage=0.3) == Decisions() and policy.window == 5  # hold
    assert policy.on_control(50.0, hit_rate=0.9, kv_usage=0.1) == Decisions(admit=("n3", "n4"))
    assert policy.window == 5 + ALPHA


def test_sessions_beyond_the_window_wait_and_enter_first_come_first_served() -> None:
    policy = _full()
    assert _arrive(policy, ["x", "y", "z"], at=5.0) == [Decisions()] * 3
    assert policy.on_session_end("y", 6.0) == Decisions()  # withdrawn at the door: leaves the queue
    assert policy.on_session_end("s3", 7.0) == Decisions(admit=("x",))
    assert _arrive(policy, ["w"], at=7.5) == [Decisions()]  # z still waits: w queues behind it
    assert policy.on_session_end("s0", 8.0) == Decisions(admit=("z",))
    assert policy.on_session_end("s1", 9.0) == Decisions(admit=("w",))
    report = policy.report().admission
    assert report is not None and report.admission_deferred == 4
    assert report.admission_wait_total_s == pytest.approx((7.0 - 5.0) + (8.0 - 5.2) + (9.0 - 7.5))
    assert report.admission_wait_mean_s == pytest.approx(report.admission_wait_total_s / 4)


def test_the_report_gives_the_window_at_each_minutes_end_and_its_min_mean_max() -> None:
    policy = _full()
    policy.on_control(30.0, hit_rate=0.1, kv_usage=0.9)  # 5 from 30 s
    policy.on_control(70.0, hit_rate=0.1, kv_usage=0.9)  # 2 from 70 s
    for k in range(INITIAL_WINDOW):
        policy.on_session_end(f"s{k}", 100.0)
    _arrive(policy, ["a", "b", "c"], at=100.0)  # a, b enter; c waits
    policy.on_control(130.0, hit_rate=0.9, kv_usage=0.1)  # used: 4 from 130 s (c enters)
    policy.on_control(200.0, hit_rate=0.9, kv_usage=0.1)  # 3 admitted < 4: holds
    report = policy.report().admission
    assert report is not None
    assert report.admission_window_per_minute == (5, 2, 4, 4)  # minutes ending 60, 120, 180, 240 s
    assert (report.admission_window_min, report.admission_window_mean, report.admission_window_max) == (2, 3.75, 5)
    assert (report.admission_increases, report.admission_decreases) == (1, 2)


def _two_calls(sid: str) -> Session:
    """A 2,000-token first call answered at once (50 tokens), then a 2,100-token call decoding 500 tokens."""
    return replace(session(sid, [2_000, 2_100]), calls=(Call(2_000, 50, gap_s=1.0), Call(2_100, 500)))


def test_in_the_engine_an_admitted_session_is_never_held_and_the_door_wait_counts_in_its_first_call() -> None:
    """Twelve sessions: ten enter, two wait. At the 10 s tick the first calls were answered with almost no
    hit (one shared token) and the second calls are decoding, their KV over half the decode memory, so the
    window halves; no admitted session is held, and the two waiting enter only once fewer than five are
    live, their first-call wait running from their arrival."""
    d = deployment(cache_tokens=10_000, decode_tokens=35_000)
    policy = make_policy("concur", PolicyContext(d))
    engine = Engine(d, policy, tick_s=10.0)
    usage_at_tick: list[float] = []
    original = policy.on_control

    def on_control(now: float, hit_rate: float | None, kv_usage: float) -> Decisions:
        usage_at_tick.append(kv_usage)
        return original(now, hit_rate, kv_usage)

    policy.on_control = on_control  # type: ignore[method-assign]
    for k in range(12):
        engine.add(spec(_two_calls(f"s{k}"), 0.1 * k, shared_tokens=1))
    engine.run_until(300.0)
    engine.check()
    assert usage_at_tick[0] > 0.5
    assert all(run.status == Status.FINISHED for run in engine.runs.values())
    assert engine.suspensions == 0
    runs = [engine.runs[f"s{k}"] for k in range(12)]
    assert all(run.admitted_s == pytest.approx(0.1 * k) for k, run in enumerate(runs[:10]))
    ended = sorted(run.ended_s for run in runs[:10] if run.ended_s is not None)
    assert runs[10].admitted_s == ended[5] and runs[11].admitted_s == ended[6]  # FCFS as the window opens
    for k, run in enumerate(runs[10:], start=10):
        assert run.first_token_s is not None and run.admitted_s is not None
        assert run.first_token_s - 0.1 * k > run.admitted_s - 0.1 * k > 10.0
    report = policy.report().admission
    assert report is not None and report.admission_decreases == 1 and report.admission_deferred == 2
    assert report.admission_window_min == 5

"""The engine's request path, timed by hand with the tiny profile (see builders.py for its costs)."""

from __future__ import annotations

import math

import pytest

from basin_sim.engine import Engine, EngineError
from basin_sim.lifecycle import Stage, Status
from basin_sim.policies import NO_DECISIONS, Decisions, FcfsPolicy
from basin_sim.unloaded import UnloadedTimes
from tests.sim.builders import deployment, session, spec


def test_one_call_takes_prefill_then_transfer_then_its_decode_steps() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000], completion=100)))
    engine.run_until(math.inf)
    prefill = 0.01 + 2_000 * 1e-4  # nothing cached: 2000 tokens computed
    transfer = 0.005 + 2_000 * 1_000 / 1e9
    run = engine.runs["a"]
    assert run.status == Status.FINISHED
    assert run.ended_s == pytest.approx(prefill + transfer + 100 * 0.02)
    assert engine.timeline.ttft_s == [pytest.approx(prefill + transfer)]
    assert (run.steps, run.good_steps) == (pytest.approx(100), pytest.approx(100))


def test_the_second_call_hits_the_first_prompt_after_the_tool_gap() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000, 2_600], completion=100, gap_s=1.0)))
    engine.run_until(math.inf)
    first = 0.01 + 0.2 + 0.007 + 2.0
    second = 1.0 + (0.01 + 600 * 1e-4) + (0.005 + 2_600e-6) + 2.0  # 600 new tokens computed
    assert engine.runs["a"].ended_s == pytest.approx(first + second)
    assert engine.timeline.prompt_tokens == [4_600]
    assert engine.timeline.device_hit_tokens == [2_000]
    assert UnloadedTimes(deployment()).of(spec(session("a", [2_000, 2_600], gap_s=1.0))) == \
        pytest.approx(first + second)


def test_a_request_waits_while_decode_is_full_and_goes_when_memory_is_freed() -> None:
    # a alone needs 2000 + its 1000-token estimate; then b needs 2000 + 100 of headroom, plus 100 for a,
    # and a's estimate (SGLang's single-request term: 3000 - a's KV) caps what is left: b waits.
    engine = Engine(deployment(decode_tokens=3_500), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000])))
    engine.add(spec(session("b", [2_000])))
    engine.run_until(1.0)
    decode = engine.decode[0]
    assert decode.used_tokens(1.0) == pytest.approx(2_000 + (1.0 - 0.217) / 0.02) and decode.num_queued == 1
    assert engine.runs["b"].request is not None and engine.runs["b"].request.stage == Stage.PREALLOC
    engine.run_until(math.inf)
    a_end = 0.21 + 0.007 + 2.0
    b_prefill = 0.01 + 1_500 * 1e-4  # the shared 500 tokens hit
    assert engine.runs["b"].ended_s == pytest.approx(a_end + b_prefill + 0.007 + 2.0)
    assert decode.used_tokens() == 0 and engine.prefill[0].cache.pinned_tokens == 0


def test_a_request_larger_than_an_instance_aborts_its_session() -> None:
    engine = Engine(deployment(decode_tokens=2_500), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000])))  # reserves 3000 > 2500
    engine.run_until(math.inf)
    assert engine.runs["a"].status == Status.ABORTED and engine.num_live == 0


def test_killed_sessions_give_back_everything_they_hold() -> None:
    engine = Engine(deployment(decode_tokens=6_500), FcfsPolicy("sglang"), tick_s=None)
    # a and b get memory at once; c once they decode (their KV is retractable, so it needs only 2000 +
    # headroom); d, later, waits for decode memory.
    for name in ("a", "b", "c"):
        engine.add(spec(session(name, [2_000], completion=1_000)))
    engine.add(spec(session("d", [2_000], completion=10), arrival_s=0.5))
    engine.run_until(1.0)
    stages = {n: r.request.stage for n, r in engine.runs.items() if r.request is not None}
    assert stages == {"a": Stage.DECODING, "b": Stage.DECODING, "c": Stage.DECODING, "d": Stage.PREALLOC}
    engine.kill_at(1.0, ["a", "b", "c"])
    engine.run_until(math.inf)
    assert [engine.runs[n].status for n in "abcd"] == [Status.KILLED] * 3 + [Status.FINISHED]
    assert engine.runs["d"].ended_s == pytest.approx(1.0 + 0.01 + 0.15 + 0.007 + 10 * 0.02)
    assert engine.decode[0].used_tokens() == 0 and engine.decode[0].queued_tokens == 0
    assert engine.prefill[0].cache.pinned_tokens == 0 and engine.num_live == 0 and engine.working_set_tokens == 0


class HoldFirst(FcfsPolicy):
    """Holds every session; admits the held ones one at a time when a session ends."""

    def __init__(self) -> None:
        super().__init__("hold")
        self.held: list[str] = []

    def on_arrival(self, session_id: str, now: float, session: object) -> Decisions:  # type: ignore[override]
        self.held.append(session_id)
        return NO_DECISIONS

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        if self.held and now >= 5.0:
            return Decisions(admit=(self.held.pop(0),))
        return NO_DECISIONS


def test_a_held_session_waits_at_the_door_and_its_wait_counts() -> None:
    engine = Engine(deployment(), HoldFirst(), tick_s=5.0)
    engine.add(spec(session("a", [2_000])))
    engine.run_until(4.0)
    assert engine.runs["a"].status == Status.QUEUED and engine.num_queued == 1
    engine.run_until(20.0)
    run = engine.runs["a"]
    assert run.admitted_s == 5.0
    assert run.ended_s == pytest.approx(5.0 + 0.21 + 0.007 + 2.0)


def test_a_policy_admitting_a_session_that_is_not_held_is_an_error() -> None:
    class Rogue(FcfsPolicy):
        def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
            return Decisions(admit=("a",))

    engine = Engine(deployment(), Rogue("rogue"), tick_s=1.0)
    engine.add(spec(session("a", [2_000])))
    with pytest.raises(EngineError, match=r"rogue.*admit session 'a', which is live"):
        engine.run_until(2.0)


@pytest.mark.parametrize(("host_tokens", "second_ttft_s"), [
    # 600 computed while 1500 are loaded back (1 us each) layer by layer: the batch takes the longer
    (10_000, max(0.01 + 600 * 1e-4, 1_500 * 1e-6) + 0.005 + 2_600e-6),
    (0, 0.01 + 2_100 * 1e-4 + 0.005 + 2_600e-6),  # no host tier: 2100 recomputed
])
def test_a_host_tier_hit_costs_a_load_back_instead_of_recompute(host_tokens: int, second_ttft_s: float) -> None:
    engine = Engine(deployment(cache_tokens=3_000, host_tokens=host_tokens), FcfsPolicy("hicache"), tick_s=None)
    engine.add(spec(session("a", [2_000, 2_600], gap_s=10.0)))
    engine.add(spec(session("b", [2_500]), arrival_s=3.0))  # needs 2000 of the 3000: evicts a's own 1500
    engine.run_until(math.inf)
    assert engine.timeline.ttft_s[:2] == [pytest.approx(0.217), pytest.approx(0.21 + 0.005 + 2_500e-6)]
    assert engine.timeline.ttft_s[2] == pytest.approx(second_ttft_s)
    assert engine.timeline.host_hit_tokens == [1_500 if host_tokens else 0]


def test_the_state_at_each_bin_end_comes_before_the_events_at_that_time() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000], completion=100)))  # ends at 2.217
    engine.add(spec(session("c", [2_000], completion=5_000), arrival_s=30.0, is_burst=True))  # decodes 100 s
    engine.add(spec(session("b", [2_000], completion=100), arrival_s=60.0))  # arrives exactly at the end of bin 0
    engine.add(spec(session("d", [3_000], completion=2_000), arrival_s=90.0))  # decodes 40 s
    engine.run_until(120.0)
    first, second = engine.timeline.bin_states
    state = ("end_s", "live_sessions", "live_burst_sessions", "working_set_tokens")
    assert [getattr(first, name) for name in state] == [60.0, 1, 1, 2_000]
    assert [getattr(second, name) for name in state] == [120.0, 2, 1, 5_000]
    assert (second.held_sessions, second.prefill_queued, second.prealloc_queued) == (0, 0, 0)
    assert engine.timeline.count_series("arrivals") == [2, 2]
    assert engine.timeline.count_series("completions") == [1, 1]
    engine.run_until(200.0)
    assert engine.timeline.bin_state_series("live_sessions") == [1.0, 2.0, 0.0]


def test_the_session_over_hook_hears_of_every_end_once() -> None:
    class ShedS(FcfsPolicy):
        def on_arrival(self, session_id: str, now: float, session: object) -> Decisions:  # type: ignore[override]
            return Decisions(shed=("s",)) if session_id == "s" else Decisions(admit=(session_id,))

    over: list[tuple[str, Status, float | None]] = []
    engine = Engine(deployment(), ShedS("shed-s"), tick_s=None,
                    on_session_over=lambda run: over.append((run.spec.session_id, run.status, run.ended_s)))
    engine.add(spec(session("s", [1_000]), arrival_s=0.8))
    engine.add(spec(session("k", [2_000], completion=1_000)))
    engine.add(spec(session("f", [1_500], completion=10)))
    engine.kill_at(1.0, ["k"])
    engine.run_until(math.inf)
    assert [(sid, status) for sid, status, _ in over] == \
        [("f", Status.FINISHED), ("s", Status.SHED), ("k", Status.KILLED)]
    assert [ended for _, _, ended in over][1:] == [0.8, 1.0]


def test_a_kill_during_the_kv_transfer_gives_back_the_pin_and_the_reservation_at_once() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000])))  # prefilled at 0.21, its KV moves until 0.217
    engine.run_until(0.212)
    request = engine.runs["a"].request
    assert request is not None and request.stage == Stage.TRANSFER
    engine.kill_at(0.212, ["a"])
    engine.run_until(0.212)
    assert request.is_aborted and engine.decode[0].used_tokens() == 0 and engine.prefill[0].cache.pinned_tokens == 0
    engine.check()
    engine.run_until(math.inf)  # the transfer's end finds nothing to do
    assert engine.runs["a"].status == Status.KILLED and engine.timeline.ttft_s == []
    engine.check()


def test_decode_retracts_when_its_memory_runs_out_and_every_session_still_finishes() -> None:
    # Two long answers admitted while small grow past decode memory: one is retracted, resumed once the
    # other finished, and both sessions finish with their whole completions; nothing is left held.
    engine = Engine(deployment(decode_tokens=8_000, clip_tokens=0), FcfsPolicy("sglang"),
                    tick_s=None)
    for name in ("a", "b"):
        engine.add(spec(session(name, [1_000], completion=5_000)))
    engine.run_until(70.0)  # 2 x 1000 prompt + 2 tokens per 20 ms step reach 8000 after ~60 s
    decode = engine.decode[0]
    engine.check()
    assert decode.num_retractions == 1 and decode.batch_size == 1 and decode.num_retracted == 1
    engine.run_until(math.inf)
    assert [engine.runs[n].status for n in "ab"] == [Status.FINISHED] * 2
    assert sorted(engine.runs[n].steps for n in "ab") == [pytest.approx(5_000), pytest.approx(5_001)]
    assert decode.used_tokens() == 0 and decode.num_queued == 0
    engine.check()


def test_an_urgent_call_does_not_preempt_a_running_prefill_but_goes_first_in_the_next_batch() -> None:
    # SGLang PD prefill has no running batch to preempt: the urgent job waits for the batch in flight,
    # and the chunked request in progress continues first (SGLang adds it before the waiting queue);
    # then the urgent job goes ahead of the relaxed one queued before it.
    class Urgency(FcfsPolicy):
        def priority(self, session_id: str, now: float) -> float:
            return {"long": 5.0, "relaxed": 3.0, "urgent": 0.0}[session_id]

    engine = Engine(deployment(), Urgency("sglang"), tick_s=None)
    engine.add(spec(session("long", [8_193], completion=1)))  # two 4096-token chunks and 1 token
    engine.add(spec(session("relaxed", [4_000], completion=1), arrival_s=0.05))
    engine.add(spec(session("urgent", [4_000], completion=1), arrival_s=0.1))
    engine.run_until(0.2)
    prefill = engine.prefill[0]
    assert prefill.batch is not None and [job.session_key for job, _ in prefill.batch.parts] == ["long"]
    engine.run_until(0.5)  # the second batch: still only the long prompt's chunk
    assert prefill.batch is not None and [job.session_key for job, _ in prefill.batch.parts] == ["long"]
    engine.run_until(math.inf)
    first_token = {n: engine.runs[n].first_token_s for n in ("long", "relaxed", "urgent")}
    assert first_token["long"] is not None and first_token["urgent"] is not None and first_token["relaxed"] is not None
    assert first_token["urgent"] < first_token["relaxed"]  # urgent overtook the relaxed call queued before it


class ResumeOnEnd(FcfsPolicy):
    """Parks `b`'s second call at the door; resumes it when `a` ends (as the outgrowth rule does when an end
    frees room). Every end it hears is recorded, so a session ended twice shows."""

    def __init__(self) -> None:
        super().__init__("resume-on-end")
        self.ended: list[str] = []
        self.calls: dict[str, int] = {}

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        self.calls[session_id] = self.calls.get(session_id, 0) + 1
        return Decisions(suspend=("b",)) if session_id == "b" and self.calls["b"] == 2 else NO_DECISIONS

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        self.ended.append(session_id)
        return Decisions(resume=("b",)) if session_id == "a" and "b" not in self.ended else NO_DECISIONS


def test_a_kill_that_resumes_one_of_its_own_sessions_withdraws_its_call_and_ends_it_once() -> None:
    # Found by compare --preset paper (paper-timed-kill-burst, basin): ending the first killed session
    # resumed a parked one of the same kill, whose call went out and finished after its session had ended.
    policy = ResumeOnEnd()
    engine = Engine(deployment(), policy, tick_s=None)
    engine.add(spec(session("a", [2_000, 2_100, 2_200], gap_s=5.0)))
    engine.add(spec(session("b", [1_000, 1_100], gap_s=0.5)))
    engine.kill_at(3.0, ["a", "b"])  # b's second call is parked at the door by then
    engine.run_until(2.9)
    assert engine.runs["b"].parked
    engine.run_until(math.inf)
    assert [engine.runs[s].status for s in ("a", "b")] == [Status.KILLED, Status.KILLED]
    assert sorted(policy.ended) == ["a", "b"]  # each end heard once, none after the kill
    assert engine.runs["b"].request is None and engine.num_live == 0
    engine.sessions.check()

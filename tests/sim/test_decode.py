"""Decode as SGLang PD runs it: pre-allocation by its admission rule, KV that grows per token,
retraction when it runs out (and resumption), aggregated steps."""

from __future__ import annotations

import pytest

from basin_sim.decode import DecodeInstance, DecodeSlot
from tests.sim.builders import TINY, with_profile


def slot(rid: int, prompt: int = 2_000, completion: int = 100, priority: float = 0.0,
         max_new: int | None = None) -> DecodeSlot:
    return DecodeSlot(priority, prompt, completion, max_new, request_id=rid)


def instance(capacity: int, profile=TINY, **kwargs: object) -> DecodeInstance:  # type: ignore[no-untyped-def]
    # TINY decodes a step in 20 ms whatever the batch; SGLang's defaults: 512 reserved, clip 4096.
    return DecodeInstance(0, profile, capacity, 0.05, **kwargs)  # type: ignore[arg-type]


def running(decode: DecodeInstance, *slots: DecodeSlot, at: float = 0.0) -> None:
    for s in slots:
        decode.enqueue(s)
    assert decode.pop_reserved(at) == list(slots)
    for s in slots:
        decode.join(s, at)


def test_a_lone_request_needs_its_prompt_plus_the_clipped_completion_estimate() -> None:
    # Nothing runs: required = prompt + min(max_new, 4096) (SGLang's _required_admission_tokens).
    decode = instance(6_095)
    decode.enqueue(slot(1))
    assert decode.pop_reserved(0.0) == [] and decode.head_shortfall_tokens(0.0) == 1
    decode = instance(6_096)
    decode.enqueue(a := slot(1))
    assert decode.pop_reserved(0.0) == [a]
    assert decode.used_tokens() == 2_000  # only the prompt is allocated; nothing is reserved beyond it
    decode = instance(2_600)
    decode.enqueue(b := slot(2, max_new=300))  # asks for at most 300 new tokens: 2000 + max(512, 300)
    assert decode.pop_reserved(0.0) == [b]


def test_in_a_busy_batch_a_request_needs_its_prompt_plus_headroom_for_every_active_request() -> None:
    decode = instance(20_000)
    a, b = slot(1, prompt=5_000, completion=10_000), slot(2, prompt=5_000, completion=10_000)
    running(decode, a)
    decode.enqueue(b)
    # retractable = 5000 (a's KV): required = max(5000 + 512, 5000 + 4096 - 5000) = 5512;
    # allocatable = free 15000 - max(512 x 1, 5000 + 4096 - 5000) = 10904: b fits.
    assert decode.pop_reserved(0.0) == [b]
    c = slot(3, prompt=9_000)
    decode.enqueue(c)
    # active a, b: allocatable = free 10000 - max(512 x 2, 5000 + 4096 - 5000) = 5904 < 9512
    assert decode.head_shortfall_tokens(0.0) == 9_512 - 5_904
    assert decode.pop_reserved(0.0) == []


def test_the_queue_runs_in_priority_order_and_its_head_blocks_smaller_requests_behind_it() -> None:
    decode = instance(7_000)
    urgent, big, small = slot(1, priority=1.0), slot(2, prompt=6_000, priority=2.0), slot(3, prompt=10, priority=3.0)
    for s in (small, big, urgent):  # arrival order is not the order served
        decode.enqueue(s)
    assert decode.pop_reserved(0.0) == [urgent]  # big does not fit; small (which would) waits behind it
    decode.cancel_queued(big)
    assert decode.pop_reserved(0.0) == [small]
    assert decode.queued_tokens == 0
    decode.check()


def test_equal_priorities_are_served_in_arrival_order() -> None:
    decode = instance(100_000)
    slots = [slot(k, prompt=100, priority=5.0) for k in range(4)]
    for s in slots:
        decode.enqueue(s)
    assert decode.pop_reserved(0.0) == slots


def test_a_lone_request_decodes_its_completion_at_the_profile_step_time() -> None:
    decode = instance(10_000)
    s = slot(1, completion=100)
    running(decode, s, at=1.0)
    assert decode.next_event_s() == pytest.approx(1.0 + 100 * 0.02)
    finished: list[DecodeSlot] = []
    decode.pop_finished(3.0, finished.append)
    assert finished == [s] and decode.batch_size == 0 and decode.used_tokens() == 0
    assert (s.steps, s.good_steps) == (pytest.approx(100), pytest.approx(100))


def test_memory_grows_by_one_token_per_running_request_and_step() -> None:
    decode = instance(100_000)
    a, b = slot(1, completion=1_000), slot(2, completion=1_000)
    running(decode, a, b)
    assert decode.used_tokens(1.0) == pytest.approx(4_000 + 2 * 50)
    assert decode.emitted_tokens(a, 1.0) == pytest.approx(50)


def test_steps_are_aggregated_between_joins_and_leaves() -> None:
    # Step time 20 ms + 1 us per context token read: depends on the batch's KV, recomputed at each change.
    profile = with_profile(kv_read_bytes_per_token=1e6)
    decode = instance(100_000, profile)
    a, b = slot(1, prompt=10_000, completion=100), slot(2, prompt=10_000, completion=50)
    for s in (a, b):
        decode.enqueue(s)
    assert decode.pop_reserved(0.0) == [a, b]
    decode.join(a, 0.0)  # step 0.030 s
    decode.join(b, 1.0)  # a did 33.33 steps; KV 20,033.3 -> step 0.0400333 s
    step_two = 0.02 + (20_000 + 1 / 0.03) * 1e-6
    b_end = 1.0 + 50 * step_two
    assert decode.next_event_s() == pytest.approx(b_end)
    done: list[DecodeSlot] = []
    decode.pop_finished(b_end, done.append)
    assert done == [b]
    a_left = 100 - 1 / 0.03 - 50
    a_end = b_end + a_left * (0.02 + (10_000 + 100 - a_left) * 1e-6)
    assert decode.next_event_s() == pytest.approx(a_end)
    decode.pop_finished(a_end, done.append)
    assert done == [b, a]
    assert (a.steps, b.steps) == (pytest.approx(100), pytest.approx(50))


def test_slow_steps_are_counted_against_the_step_slo() -> None:
    decode = instance(10_000, with_profile(decode_step_fixed_s=0.06))
    s = slot(1, completion=10)
    running(decode, s)
    decode.pop_finished(1.0, lambda _: None)
    assert (s.steps, s.good_steps) == (pytest.approx(10), 0.0)


def test_a_killed_request_leaves_the_batch_and_frees_its_memory() -> None:
    decode = instance(10_000)
    a, b = slot(1, completion=1_000), slot(2, completion=1_000)
    running(decode, a, b)
    decode.leave(a, 1.0)
    assert decode.batch_size == 1 and decode.used_tokens() == pytest.approx(2_050)
    assert a.steps == pytest.approx(50)
    assert decode.next_event_s() == pytest.approx(20.0)


def test_when_memory_runs_out_the_request_with_the_fewest_tokens_out_is_retracted_and_later_resumed() -> None:
    # Three requests admitted while small; they grow 1 token per 20 ms step each.
    decode = instance(8_000, reserved_decode_tokens=0, clip_max_new_tokens=0)
    a, b, c = slot(1, prompt=1_000, completion=5_000), slot(2, prompt=1_000, completion=5_000), \
        slot(3, prompt=2_000, completion=100)
    running(decode, a, b)
    decode.enqueue(c)
    assert decode.pop_reserved(2.0) == [c]  # a, b have 100 tokens out each
    decode.join(c, 2.0)
    assert decode.next_event_s() == pytest.approx(2.0 + 100 * 0.02)  # c finishes before memory runs out
    done: list[DecodeSlot] = []
    decode.pop_finished(4.0, done.append)
    assert done == [c]
    # Now a and b alone: used 2 x 1200 = 2400, 2 tokens per step: full after (8000 - 2400 - 2) / 2 steps.
    full_s = 4.0 + (8_000 - 2_400 - 2) / 2 * 0.02
    assert decode.next_event_s() == pytest.approx(full_s)
    decode.pop_finished(full_s + 1e-6, done.append)
    # Equal tokens out and prompts: one of them is retracted, its KV freed; the other keeps decoding.
    assert decode.num_retractions == 1 and decode.batch_size == 1 and decode.num_retracted == 1
    kept, gone = (a, b) if a.is_running else (b, a)
    assert gone.is_retracted and gone.emitted == pytest.approx(200 + 2_799, abs=0.01)
    assert decode.used_tokens() == pytest.approx(1_000 + 2_999, abs=0.01)
    # New requests wait while a retracted one does.
    decode.enqueue(d := slot(4, prompt=10))
    assert decode.pop_reserved(full_s + 1.0) == [] and decode.num_queued == 2
    decode.pop_finished(1e9, done.append)  # kept finishes; nothing else runs
    assert done[1] is kept and decode.batch_size == 0
    # The next pass resumes the retracted request where it stopped, then pre-allocates d.
    assert decode.pop_reserved(decode.epoch_s) == [d]
    assert gone.is_running and gone.retractions == 1
    decode.pop_finished(1e9, done.append)
    assert done[2] is gone and gone.steps == pytest.approx(5_000 + 1)  # its whole completion, one late token
    assert gone.good_steps == pytest.approx(5_000)
    decode.check()


def test_with_the_priority_policy_the_least_urgent_request_is_retracted_first() -> None:
    decode = instance(6_000, reserved_decode_tokens=0, clip_max_new_tokens=0, retraction_policy="priority")
    urgent, relaxed = slot(1, prompt=1_000, completion=5_000, priority=1.0), \
        slot(2, prompt=1_000, completion=5_000, priority=9.0)
    running(decode, relaxed)
    running(decode, urgent, at=1.0)  # urgent has fewer tokens out: the length policy would retract it
    decode.pop_finished(decode.next_event_s() or 0.0, lambda _: None)
    assert relaxed.is_retracted and urgent.is_running


def test_a_lone_request_is_never_retracted() -> None:
    decode = instance(3_000, reserved_decode_tokens=0, clip_max_new_tokens=0)
    s = slot(1, prompt=2_000, completion=2_000)
    running(decode, s)
    assert decode.next_event_s() == pytest.approx(2_000 * 0.02)  # no memory event: it finishes (overrunning)
    decode.pop_finished(1e9, lambda _: None)
    assert decode.num_retractions == 0 and s.steps == pytest.approx(2_000)


def test_lent_memory_is_reclaimed_before_a_request_is_retracted() -> None:
    decode = instance(6_000, reserved_decode_tokens=0, clip_max_new_tokens=0)
    asked: list[int] = []

    def reclaim(tokens: int) -> None:
        asked.append(tokens)
        decode.lent_tokens = 0

    decode.reclaim = reclaim
    decode.lent_tokens = 2_000
    a, b = slot(1, prompt=1_000, completion=5_000), slot(2, prompt=1_000, completion=5_000)
    running(decode, a, b)
    full_s = decode.next_event_s()
    assert full_s == pytest.approx((4_000 - 2_000 - 2) / 2 * 0.02)
    decode.pop_finished(full_s, lambda _: None)
    assert asked and decode.num_retractions == 0 and decode.batch_size == 2


def test_a_request_that_cannot_fit_an_empty_instance_is_recognised() -> None:
    decode = instance(6_000)
    assert decode.can_ever_fit(slot(1, prompt=1_904)) and not decode.can_ever_fit(slot(2, prompt=1_905))


def test_grant_reclaims_lent_memory_for_the_head_and_tells_each_grant_at_once() -> None:
    decode = instance(6_096)
    decode.lent_tokens = 1_000
    reclaimed: list[int] = []

    def reclaim(tokens: int) -> None:
        reclaimed.append(tokens)
        decode.lent_tokens -= tokens

    decode.reclaim = reclaim
    decode.enqueue(a := slot(1))
    granted: list[DecodeSlot] = []
    decode.grant(0.0, granted.append)
    assert reclaimed == [1_000] and granted == [a] and decode.lent_tokens == 0
    decode.reclaim = None  # nothing to reclaim from: the head waits
    decode.lent_tokens = 500
    decode.enqueue(slot(2, prompt=3_000))
    decode.grant(0.0, granted.append)
    assert granted == [a] and decode.head_shortfall_tokens(0.0) > 0


@pytest.mark.parametrize("where", ["queued", "allocated", "running", "retracted"])
def test_withdraw_gives_back_what_the_request_holds_wherever_it_is(where: str) -> None:
    decode = instance(20_000, reserved_decode_tokens=0)
    other, gone = slot(1, prompt=5_000, completion=10_000), slot(2, prompt=5_000, completion=10_000)
    running(decode, other)
    decode.enqueue(gone)
    if where != "queued":
        assert decode.pop_reserved(0.0) == [gone]
    if where in ("running", "retracted"):
        decode.join(gone, 0.0)
    if where == "retracted":  # memory runs out: the request with fewer tokens emitted goes
        decode.pop_finished(decode.next_event_s() or 0.0, lambda _: None)
        assert gone.is_retracted
    now = 1.0 if where == "retracted" else 0.0
    decode.withdraw(gone, now)
    decode.check()
    assert not (gone.is_running or gone.is_allocated or gone.is_retracted)
    assert decode.queued_tokens == 0 and decode.allocated_waiting_tokens == 0 and decode.num_retracted == 0
    assert other.is_running and decode.batch_size == 1

"""Decode: memory reserved before prefill (and waited for), freed at completion; aggregated steps."""

from __future__ import annotations

import pytest

from basin_sim.decode import DecodeInstance, DecodeSlot
from tests.sim.builders import TINY, with_profile


def slot(rid: int, prompt: int = 2_000, completion: int = 100, reservation: int = 3_000,
         priority: float = 0.0) -> DecodeSlot:
    return DecodeSlot(priority, prompt, completion, reservation, request_id=rid)


def reserved(decode: DecodeInstance, *slots: DecodeSlot) -> None:
    for s in slots:
        decode.enqueue(s)
    assert decode.pop_reserved() == list(slots)


def test_a_request_waits_for_memory_and_gets_it_when_memory_is_freed() -> None:
    decode = DecodeInstance(0, TINY, capacity_tokens=6_200, step_slo_s=0.05)
    first, second, third = slot(1, priority=1.0), slot(2, priority=2.0), slot(3, reservation=500, priority=3.0)
    for s in (first, second, third):
        decode.enqueue(s)
    assert decode.pop_reserved() == [first, second]
    assert (decode.reserved_tokens, decode.queued_tokens, decode.num_queued) == (6_000, 500, 1)
    assert decode.pop_reserved() == []  # third needs 500, only 200 left: it waits
    decode.free(first)
    assert decode.pop_reserved() == [third]
    assert (decode.reserved_tokens, decode.queued_tokens) == (3_500, 0)


def test_the_queue_head_blocks_smaller_requests_behind_it() -> None:
    decode = DecodeInstance(0, TINY, capacity_tokens=5_000, step_slo_s=0.05)
    running = slot(1, reservation=3_000)
    big, small = slot(2, reservation=4_000, priority=1.0), slot(3, reservation=1_000, priority=2.0)
    for s in (running, big, small):
        decode.enqueue(s)
    assert decode.pop_reserved() == [running]  # big does not fit, so small (which would) waits behind it
    decode.cancel_queued(big)
    assert decode.pop_reserved() == [small]
    assert decode.queued_tokens == 0


def test_a_lone_request_decodes_its_completion_at_the_profile_step_time() -> None:
    decode = DecodeInstance(0, TINY, capacity_tokens=10_000, step_slo_s=0.05)
    s = slot(1, completion=100)
    reserved(decode, s)
    decode.join(s, now=1.0)
    assert decode.next_completion_s() == pytest.approx(1.0 + 100 * 0.02)
    finished: list[DecodeSlot] = []
    decode.pop_finished(3.0, finished.append)
    assert finished == [s] and decode.batch_size == 0 and decode.reserved_tokens == 0
    assert (s.steps, s.good_steps) == (pytest.approx(100), pytest.approx(100))


def test_steps_are_aggregated_between_joins_and_leaves() -> None:
    # Step time 20 ms + 1 us per context token read: depends on the batch's KV, recomputed at each change.
    profile = with_profile(kv_read_bytes_per_token=1e6)
    decode = DecodeInstance(0, profile, capacity_tokens=100_000, step_slo_s=0.05)
    a, b = slot(1, prompt=10_000, completion=100), slot(2, prompt=10_000, completion=50)
    reserved(decode, a, b)
    decode.join(a, 0.0)  # step 0.030 s
    decode.join(b, 1.0)  # a did 33.33 steps; KV 20,033.3 -> step 0.0400333 s
    step_two = 0.02 + (20_000 + 1 / 0.03) * 1e-6
    b_end = 1.0 + 50 * step_two
    assert decode.next_completion_s() == pytest.approx(b_end)
    done: list[DecodeSlot] = []
    decode.pop_finished(b_end, done.append)
    assert done == [b]
    a_left = 100 - 1 / 0.03 - 50
    a_end = b_end + a_left * (0.02 + (10_000 + 100 - a_left) * 1e-6)
    assert decode.next_completion_s() == pytest.approx(a_end)
    decode.pop_finished(a_end, done.append)
    assert done == [b, a]
    assert (a.steps, b.steps) == (pytest.approx(100), pytest.approx(50))


def test_slow_steps_are_counted_against_the_step_slo() -> None:
    decode = DecodeInstance(0, with_profile(decode_step_fixed_s=0.06), capacity_tokens=10_000, step_slo_s=0.05)
    s = slot(1, completion=10)
    reserved(decode, s)
    decode.join(s, 0.0)
    decode.pop_finished(1.0, lambda _: None)
    assert (s.steps, s.good_steps) == (pytest.approx(10), 0.0)


def test_a_killed_request_leaves_the_batch_and_frees_its_memory() -> None:
    decode = DecodeInstance(0, TINY, capacity_tokens=10_000, step_slo_s=0.05)
    a, b = slot(1, completion=1_000), slot(2, completion=1_000)
    reserved(decode, a, b)
    decode.join(a, 0.0)
    decode.join(b, 0.0)
    decode.leave(a, 1.0)
    assert decode.batch_size == 1 and decode.reserved_tokens == 3_000
    assert a.steps == pytest.approx(50)
    assert decode.next_completion_s() == pytest.approx(20.0)

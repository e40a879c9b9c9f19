"""The real-time engines on the TINY profile (tests/sim/builders.py): order, memory, time scale, withdrawal."""

from __future__ import annotations

import asyncio

import pytest

from basin_emulate.clock import TIMER_ADVANCE_S, LagWindow, ModelClock
from basin_emulate.decode_engine import DecodeEngine, DecodeStage
from basin_emulate.errors import RequestTooLargeError
from basin_emulate.ordering import QueueOrder
from basin_emulate.prefill_engine import PrefillEngine
from basin_runtime.clock import Clock, ManualClock
from tests.sim.builders import TINY

pytestmark = pytest.mark.asyncio
BUDGET = TINY.chunked_prefill_tokens  # one job of this size fills a batch


def started_clock(time_scale: float, wall: Clock | None = None) -> ModelClock:
    clock = ModelClock(time_scale, LagWindow(), wall)
    clock.start()
    return clock


async def completion_order(order: QueueOrder) -> list[str]:
    """A blocker fills the first batch; low, high, mid (one batch each) queue behind it; the order they finish."""
    clock = started_clock(20.0)
    engine = PrefillEngine(TINY, clock, 100_000)
    done: list[str] = []

    async def run(name: str, priority: int | None) -> None:
        await engine.prefill(name, "g", 10, BUDGET, order.key(priority), clock.catch_up())
        done.append(name)

    tasks = [asyncio.create_task(run(name, p)) for name, p in (("blocker", 0), ("low", 1), ("high", 9), ("mid", 5))]
    await asyncio.gather(*tasks)
    assert engine.cache.pinned_tokens == 0 and engine.is_idle
    return done[1:]


async def test_the_prefill_queue_is_fcfs_unless_priority_scheduling_is_on() -> None:
    assert await completion_order(QueueOrder()) == ["low", "high", "mid"]
    assert await completion_order(QueueOrder(is_priority_scheduling=True)) == ["high", "mid", "low"]
    assert await completion_order(QueueOrder(True, is_low_values_first=True)) == ["low", "mid", "high"]


async def test_time_scale_divides_every_modeled_duration() -> None:
    # TINY: a 3000-token prompt takes 10 ms + 300 ms of prefill and 5 ms + 3 ms of transfer: 318 ms.
    expected_s = TINY.prefill_batch_s(3000, 0.0, 0) + TINY.transfer_s(3000)
    for scale in (4.0, 16.0):
        wall = ManualClock()
        clock = started_clock(scale, wall)
        engine = PrefillEngine(TINY, clock, 100_000)
        started = wall.now()
        prefill = asyncio.ensure_future(engine.prefill("s", "g", 10, 3000, 0.0, clock.catch_up()))
        await wall.drive(prefill)
        outcome = await prefill
        assert outcome.transfer_done_s - outcome.arrival_s == pytest.approx(expected_s)
        # Its last timer (the transfer's end) is set TIMER_ADVANCE_S before its deadline, expected_s / scale.
        assert wall.now() - started == pytest.approx(expected_s / scale - TIMER_ADVANCE_S)
        assert clock.lag_summary().max_s == 0.0  # every timer ran at its own time


async def test_a_second_request_on_a_busy_chain_waits_for_the_first_and_hits_it() -> None:
    clock = started_clock(50.0)
    engine = PrefillEngine(TINY, clock, 100_000)
    first = asyncio.create_task(engine.prefill("chain", "g", 10, 2000, 0.0, clock.catch_up()))
    second = asyncio.create_task(engine.prefill("chain", "g", 10, 2500, 0.0, clock.catch_up()))
    outcomes = await asyncio.gather(first, second)
    assert engine.totals.chain_waits == 1
    assert outcomes[0].cached_tokens == 0 and outcomes[1].cached_tokens == 2000
    assert outcomes[1].prefill_done_s > outcomes[0].transfer_done_s  # it only started once the first had left


async def test_a_withdrawn_prefill_gives_back_its_pin_and_lets_its_chain_go_on() -> None:
    wall = ManualClock()
    clock = started_clock(10.0, wall)
    engine = PrefillEngine(TINY, clock, 100_000)
    running = asyncio.create_task(engine.prefill("chain", "g", 10, 3000, 0.0, clock.catch_up()))
    parked = asyncio.create_task(engine.prefill("chain", "g", 10, 3500, 0.0, clock.catch_up()))
    await wall.settle()  # time stands: the first is in its batch, the second parked behind it
    assert engine.cache.pinned_tokens == 3000
    running.cancel()
    await wall.drive(parked)
    outcome = await parked
    assert running.cancelled()
    # Released when its batch ended; what the batch computed stays cached (basin_sim's engine does the same).
    assert outcome.cached_tokens == 3000
    assert outcome.prefill_done_s >= TINY.prefill_batch_s(3000, 0.0, 0)
    assert engine.cache.pinned_tokens == 0 and engine.is_idle


async def test_a_prompt_larger_than_the_pool_is_refused_at_once() -> None:
    clock = started_clock(10.0)
    engine = PrefillEngine(TINY, clock, 1_000)
    with pytest.raises(RequestTooLargeError, match="max_total_num_tokens=1000"):
        await engine.prefill("s", "g", 10, 1_001, 0.0, clock.catch_up())
    decode = DecodeEngine(TINY, clock, 5_000)
    with pytest.raises(RequestTooLargeError, match="5000"):
        decode.submit(4_500, None, 10, 0.0, False, clock.catch_up())  # 4500 + the 1000-token estimate


async def test_decode_preallocation_waits_while_memory_is_full() -> None:
    clock = started_clock(20.0)
    decode = DecodeEngine(TINY, clock, 10_000)
    # Nothing runs yet, so each needs prompt + max(512, min(max_new_tokens, 4096)); only the prompt is taken.
    first = decode.submit(6_000, 5, 5, 0.0, False, clock.catch_up())  # needs 6512
    second = decode.submit(3_500, None, 3, 0.0, False, clock.catch_up())  # needs 7596 of the 4000 left
    assert decode.instance.used_tokens() == 6_000
    assert first.granted.done() and not second.granted.done()
    assert second.stage == DecodeStage.PREALLOC and decode.count(DecodeStage.PREALLOC) == 1

    decode.join(first, clock.catch_up())
    finished_s = await decode.wait_finished(first)
    assert finished_s - first.join_s == pytest.approx(4 * TINY.decode_step_s(1, 6_000))  # 5 tokens: 1 + 4 steps
    assert await decode.wait_granted(second) >= finished_s  # granted once the first freed its memory
    assert decode.instance.used_tokens() == 3_500
    decode.withdraw(second)
    assert decode.instance.used_tokens() == 0 and decode.is_idle


async def test_decode_emits_tokens_step_by_step_and_a_withdrawal_frees_the_seat() -> None:
    clock = started_clock(4.0)
    decode = DecodeEngine(TINY, clock, 100_000, flush_wall_s=0.001)
    ticket = decode.submit(1_000, 50, 50, 0.0, True, clock.catch_up())
    decode.join(ticket, clock.catch_up())
    seen = []
    for _ in range(3):
        ticket.progress.clear()
        await ticket.progress.wait()
        seen.append(ticket.emitted)
    assert seen == sorted(seen) and seen[0] > 1  # steps of 20 ms (5 ms wall) each add a token
    assert decode.tokens_out(ticket, clock.now_s + 10 * TINY.decode_step_s(1, 1000)) >= seen[-1] + 9
    decode.withdraw(ticket)
    assert decode.instance.batch_size == 0 and decode.instance.used_tokens() == 0
    assert not ticket.finished.done()


async def test_ended_sessions_leave_no_chain_records_once_their_kv_is_evicted() -> None:
    clock = started_clock(1_000.0)
    engine = PrefillEngine(TINY, clock, 20_000, host_capacity_tokens=10_000)

    async def session(index: int) -> None:  # two calls, then the session ends (the engine is never told)
        for call in range(2):
            await engine.prefill(f"chain-{index}", "g", 500, 3_000 + 1_000 * call, 0.0, clock.catch_up())

    for start in range(0, 300, 20):  # 300 sessions, 20 at a time
        await asyncio.gather(*(session(index) for index in range(start, start + 20)))
    cache = engine.cache
    cached = [i for i in range(300) if cache.lookup(f"chain-{i}", "g").tokens > cache.lookup("nobody", "g").tokens]
    assert engine.is_idle and cache.pinned_tokens == 0
    assert 0 < len(cached) <= 10 and cache.num_chains == len(cached)  # the last sessions' KV stays, nothing else
    cache.check()

"""The one clock (basin_runtime/clock.py): the scaled clock maps model time to its base and back, the manual
clock wakes sleepers and runs timers in deadline order at their own times, `drive` and `Deadline` on it."""

from __future__ import annotations

import asyncio

import pytest

from basin_runtime.clock import Deadline, ManualClock, MonotonicClock, ScaledClock

pytestmark = pytest.mark.asyncio


async def test_a_scaled_clock_runs_time_scale_model_seconds_per_base_second_from_its_start() -> None:
    base = ManualClock(start_s=100.0)
    scaled = ScaledClock(base, 20.0)
    with pytest.raises(RuntimeError, match="not started"):
        scaled.now()
    base.advance(5.0)  # before the start: not model time
    scaled.start()
    assert scaled.is_started and scaled.now() == 0.0
    base.advance(0.5)
    assert scaled.now() == pytest.approx(10.0)
    assert scaled.base_time(10.0) == pytest.approx(105.5) and scaled.base_time(30.0) == pytest.approx(106.5)
    assert scaled.base_duration(10.0) == pytest.approx(0.5)
    assert scaled.wall() == base.wall()  # unix time is not scaled


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan")])
async def test_a_scale_that_is_not_finite_and_positive_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="time scale must be finite and > 0"):
        ScaledClock(MonotonicClock(), scale)


async def test_a_scaled_sleep_and_timer_wait_their_model_time_on_the_base() -> None:
    base = ManualClock(start_s=0.0)
    scaled = ScaledClock(base, 10.0)
    scaled.start()
    fired: list[float] = []
    scaled.call_at(4.0, lambda: fired.append(scaled.now()))  # model 4 s = base 0.4 s
    sleeper = asyncio.create_task(scaled.sleep(2.0))  # model 2 s = base 0.2 s
    await base.settle()
    base.advance(0.19)
    await base.settle()
    assert not sleeper.done() and not fired
    base.advance(0.01)
    await base.settle()
    assert sleeper.done() and not fired
    base.advance(0.2)
    assert fired == [pytest.approx(4.0)]


async def test_the_manual_clock_wakes_sleepers_in_deadline_order_and_only_when_due() -> None:
    clock = ManualClock(start_s=0.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    tasks = [asyncio.create_task(sleeper(name, s)) for name, s in (("c", 3.0), ("a", 1.0), ("b", 2.0), ("a2", 1.0))]
    await clock.settle()
    assert clock.next_deadline() == 1.0
    clock.advance(0.5)
    await clock.settle()
    assert woke == []
    clock.advance(2.0)  # a, a2 (same deadline: in the order they slept) and b are due; c is not
    await clock.settle()
    assert woke == [("a", 2.5), ("a2", 2.5), ("b", 2.5)]  # a woken sleeper sees the time advanced to
    assert clock.next_deadline() == 3.0
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1.0)
    assert clock.now() == 2.5 and clock.next_deadline() == 3.0  # the refused step changed nothing
    clock.advance(10.0)
    await asyncio.gather(*tasks)
    assert [name for name, _ in woke] == ["a", "a2", "b", "c"] and clock.next_deadline() is None


async def test_manual_timers_run_at_their_own_times_in_order_once_and_not_when_cancelled() -> None:
    clock = ManualClock(start_s=0.0)
    ran: list[tuple[str, float]] = []

    def record(name: str) -> None:
        ran.append((name, clock.now()))

    def chain() -> None:  # a timer that sets the next one, inside the same advance
        record("chain")
        clock.call_at(clock.now() + 0.5, lambda: record("chained"))

    clock.call_at(2.0, lambda: record("two"))
    clock.call_at(1.0, chain)
    cancelled = clock.call_at(1.2, lambda: record("cancelled"))
    cancelled.cancel()
    clock.advance(5.0)
    assert ran == [("chain", 1.0), ("chained", 1.5), ("two", 2.0)]
    assert clock.now() == 5.0 and clock.next_deadline() is None

    clock.call_at(3.0, lambda: record("past"))  # already due: not run by call_at itself, but by the next advance
    assert ran[-1][0] == "two" and clock.next_deadline() == 3.0
    clock.advance(0.0)
    assert ran[-1] == ("past", 5.0)
    clock.advance(1.0)
    assert [name for name, _ in ran].count("past") == 1


async def test_drive_jumps_from_deadline_to_deadline_until_the_task_is_done() -> None:
    clock = ManualClock(start_s=0.0)
    seen: list[float] = []

    async def work() -> str:
        for seconds in (0.25, 4.0, 1.0):
            await clock.sleep(seconds)
            seen.append(clock.now())
        return "done"

    task = asyncio.ensure_future(work())
    await clock.drive(task)
    assert await task == "done" and seen == [0.25, 4.25, 5.25] and clock.now() == 5.25


async def test_drive_stops_at_until_and_waits_while_not_settled() -> None:
    clock = ManualClock(start_s=0.0)
    looks: list[float] = []

    def is_settled() -> bool:  # a request is in flight outside the loop for the first three looks
        looks.append(clock.now())
        return len(looks) > 3

    task = asyncio.ensure_future(clock.sleep(1.0))
    await clock.drive(task, until_s=0.6, is_settled=is_settled)
    assert looks == [0.0] * 4  # time stood until it was settled, then jumped (to `until_s`, not the deadline)
    assert clock.now() == 0.6 and not task.done()
    await clock.drive(task)
    assert task.done() and clock.now() == 1.0


async def test_a_deadline_on_the_clock_cancels_the_block_when_the_clock_passes_it() -> None:
    clock = ManualClock(start_s=0.0)
    forever = asyncio.Event()

    async def wait_with(seconds: float, moved_by_s: float | None = None) -> str:
        async with Deadline(clock, seconds) as deadline:
            if moved_by_s is not None:
                await clock.sleep(0.5)
                deadline.reschedule(moved_by_s)
            await forever.wait()
        return "never"

    expired = asyncio.ensure_future(wait_with(1.0))
    await clock.drive(expired)
    with pytest.raises(TimeoutError):
        await expired
    assert clock.now() == 1.0

    moved = asyncio.ensure_future(wait_with(1.0, moved_by_s=2.0))  # from 1.5: expires at 3.5, not 2.0
    await clock.drive(moved)
    with pytest.raises(TimeoutError):
        await moved
    assert clock.now() == 3.5


async def test_a_block_that_ends_in_time_leaves_no_timer_behind() -> None:
    clock = ManualClock(start_s=0.0)
    async with Deadline(clock, 1.0):
        await asyncio.sleep(0)
    assert clock.next_deadline() is None
    clock.advance(2.0)  # nothing to cancel any more
    await clock.settle()


async def test_the_monotonic_clock_runs_timers_and_deadlines_on_the_event_loop() -> None:
    clock = MonotonicClock()
    ran = asyncio.Event()
    clock.call_at(clock.now(), ran.set)
    await asyncio.wait_for(ran.wait(), 10.0)
    cancelled = clock.call_at(clock.now(), ran.clear)
    cancelled.cancel()
    await asyncio.sleep(0)
    assert ran.is_set()
    with pytest.raises(TimeoutError):
        async with Deadline(clock, 0.0):
            await asyncio.Event().wait()

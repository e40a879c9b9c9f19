"""The event loop alone: (time, seq) order across the heap and the timer queues, void timers, the watch."""

from __future__ import annotations

import math

import pytest

from basin_sim.events import EventLoop


def recording_loop() -> tuple[EventLoop, list[tuple[float, str]], dict[str, int]]:
    """A loop whose handlers record (now, payload); kinds by name: 'heap', and two timer queues."""
    loop, seen = EventLoop(), []

    def record(payload: object) -> None:
        seen.append((loop.now, str(payload)))

    kinds = {"heap": loop.kind(record)}
    return loop, seen, kinds


def test_events_at_one_time_run_in_the_order_they_were_scheduled_heap_and_queues_alike() -> None:
    loop, seen, kinds = recording_loop()
    first = loop.timer_queue(lambda p: seen.append((loop.now, f"q1:{p}")))
    second = loop.timer_queue(lambda p: seen.append((loop.now, f"q2:{p}")))
    loop.at(5.0, kinds["heap"], "a")
    second.set(5.0, "b")
    loop.at(1.0, kinds["heap"], "c")
    first.set(5.0, "d")
    loop.at(5.0, kinds["heap"], "e")
    first.set(7.0, "f")
    loop.run_until(math.inf)
    assert seen == [(1.0, "c"), (5.0, "a"), (5.0, "q2:b"), (5.0, "q1:d"), (5.0, "e"), (7.0, "q1:f")]


def test_a_void_event_is_dropped_without_moving_the_clock() -> None:
    loop, seen, kinds = recording_loop()
    void = loop.kind(lambda p: seen.append((loop.now, f"ran:{p}")), is_void=lambda p: p == "stale")
    loop.at(1.0, kinds["heap"], "x")
    loop.at(4.0, void, "stale")
    loop.run_until(5.0 - 1e-9)
    assert seen == [(1.0, "x")] and loop.now == 5.0 - 1e-9  # run_until's own end, not the void event's time
    loop.at(6.0, void, "fresh")
    loop.run_until(math.inf)
    assert seen == [(1.0, "x"), (6.0, "ran:fresh")]


def test_the_watch_sees_the_clock_before_the_first_event_at_or_after_its_time() -> None:
    loop, seen, kinds = recording_loop()
    watched: list[tuple[float, float]] = []

    def watch(time_s: float) -> None:
        watched.append((time_s, loop.now))
        while loop.watch_s <= time_s:
            loop.watch_s += 10.0

    loop.watch_s, loop.on_watch = 10.0, watch
    loop.at(3.0, kinds["heap"], "a")
    loop.at(10.0, kinds["heap"], "b")
    loop.at(25.0, kinds["heap"], "c")
    loop.run_until(27.0)
    assert watched == [(10.0, 3.0), (25.0, 10.0), (27.0, 25.0)]  # the clock still at the previous event
    assert seen == [(3.0, "a"), (10.0, "b"), (25.0, "c")] and loop.watch_s == 30.0 and loop.now == 27.0


def test_run_until_leaves_later_events_and_never_moves_the_clock_back() -> None:
    loop, seen, kinds = recording_loop()
    loop.at(8.0, kinds["heap"], "late")
    loop.run_until(5.0)
    assert seen == [] and loop.now == 5.0
    loop.run_until(2.0)
    assert loop.now == 5.0
    loop.run_until(math.inf)
    assert seen == [(8.0, "late")] and loop.now == 8.0


def test_a_fixed_delay_timer_set_out_of_time_order_is_refused() -> None:
    loop = EventLoop()
    queue = loop.timer_queue(lambda _: None)
    queue.set(5.0, "a")
    with pytest.raises(AssertionError, match="out of time order"):
        queue.set(4.0, "b")

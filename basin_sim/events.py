"""The engine's event loop: the clock, a heap of events, FIFO queues of fixed-delay timers, dispatch.

Rules:
- An event is (time, seq, kind, payload); events run in (time, seq) order. `seq` is one counter for
  the heap and every timer queue, so of two events at the same time the one scheduled first runs
  first: the same inputs give the same order. There is no fixed tick for the work itself.
- A handler is registered once per kind (`kind`), with an optional void test: a void event (a
  client's timer overtaken by events) is dropped when due, without moving the clock.
- A timer queue holds timers of one fixed delay (a client's call timeout, its session time limit):
  set in time order, they fall due in that order, so each waits in a FIFO instead of the heap (at
  scale most are void by then and would be most of the heap). The earliest of the heap's head and
  every queue's head runs next: the same order a single heap would give, O(1) per timer.
- The watch: before an event at or after `watch_s` runs (the clock still at the previous event), the
  loop calls `on_watch(time)` (the timeline records its bin ends there; it moves `watch_s` on).
- `run_until(t)` runs every event with time <= t; a finite t then calls the watch for t and leaves
  the clock at t (or later, if it already was).
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable
from typing import Any

Entry = tuple[float, int, int, Any]
Handler = Callable[[Any], None]
VoidTest = Callable[[Any], bool]


class TimerQueue:
    """Timers of one kind and one fixed delay, due in the order they are set."""

    def __init__(self, loop: EventLoop, kind: int) -> None:
        self._loop = loop
        self._kind = kind
        self.entries: collections.deque[Entry] = collections.deque()

    def set(self, time_s: float, payload: object) -> None:
        """A timer at `time_s` (never earlier than the last one set)."""
        entries = self.entries
        assert not entries or entries[-1][0] <= time_s, "a fixed-delay timer set out of time order"
        entries.append((time_s, self._loop.next_seq(), self._kind, payload))


class EventLoop:
    """The clock, the event heap and the timer queues; `run_until` dispatches to the registered handlers."""

    def __init__(self) -> None:
        self.now = 0.0
        self.watch_s = math.inf
        self.on_watch: Callable[[float], None] = _ignore
        self._heap: list[Entry] = []
        self._queues: list[collections.deque[Entry]] = []
        self._handlers: list[Handler] = []
        self._voids: list[VoidTest | None] = []
        self._seq = 0

    def kind(self, handler: Handler, is_void: VoidTest | None = None) -> int:
        """Register a handler (and its void test); the kind to schedule its events under."""
        self._handlers.append(handler)
        self._voids.append(is_void)
        return len(self._handlers) - 1

    def timer_queue(self, handler: Handler, is_void: VoidTest | None = None) -> TimerQueue:
        """Register a handler whose events are timers of one fixed delay; the queue to set them in."""
        queue = TimerQueue(self, self.kind(handler, is_void))
        self._queues.append(queue.entries)
        return queue

    def next_seq(self) -> int:
        """The next sequence number (ties between events at one time go to the lower)."""
        self._seq += 1
        return self._seq

    def has_pending(self) -> bool:
        """Whether any event is still scheduled (in the heap or a timer queue)."""
        return bool(self._heap) or any(self._queues)

    def at(self, time_s: float, kind: int, payload: object) -> None:
        """Schedule an event of `kind` at `time_s`."""
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, kind, payload))

    def run_until(self, until_s: float) -> None:
        """Run every event up to `until_s` (math.inf: until nothing is left to do)."""
        heap, queues, handlers, voids = self._heap, self._queues, self._handlers, self._voids
        while True:  # the earliest (time, seq) of the heap and the timer queues
            entry = heap[0] if heap else None
            source = None
            for queue in queues:
                if queue and (entry is None or queue[0] < entry):
                    entry, source = queue[0], queue
            if entry is None or entry[0] > until_s:
                break
            if source is None:
                heapq.heappop(heap)
            else:
                source.popleft()
            time_s, _, kind, payload = entry
            is_void = voids[kind]
            if is_void is not None and is_void(payload):
                continue
            if time_s >= self.watch_s:
                self.on_watch(time_s)
            self.now = time_s
            handlers[kind](payload)
        if math.isfinite(until_s):
            self.on_watch(until_s)
            self.now = max(self.now, until_s)


def _ignore(_: float) -> None:
    """No watch."""

"""The one injectable clock: real (`MonotonicClock`), scripted (`ManualClock`), or time-scaled (`ScaledClock`).

Rules:
- `now()` is monotonic seconds and is what a policy or a model sees as `now`: it never runs backwards.
- `wall()` is unix seconds, for records a person, a log or another process reads.
- `sleep()` waits on the clock and `call_at()` runs a callback once the clock reaches a time (never from
  inside `call_at` itself, even for a time already past); both are the only ways real-time code waits.
- `ScaledClock` runs `time_scale` model seconds per second of the clock under it, from `start()`:
  model_s = (base.now() - origin) * time_scale; a model duration d takes d / time_scale base seconds.
- `ManualClock` moves only on `advance`: due timers run inside it, one by one in deadline order, each
  with `now()` at its own deadline; due sleepers are woken in that order and run after it returns (so
  they see the time advanced to). `drive` jumps from deadline to deadline while a task runs, for tests.
- `Deadline` is `asyncio.timeout` measured on a clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

SETTLE_YIELDS = 20  # loop turns `drive` lets woken tasks run before it moves time again


class Timer(Protocol):
    """A callback scheduled on a clock."""

    def cancel(self) -> None:
        """Do not run it (no-op once it ran)."""
        ...


class Clock(Protocol):
    """Where real-time code reads time and waits for it."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Unix seconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` once `now()` reaches `when_s`."""
        ...


class MonotonicClock:
    """The real clock."""

    def now(self) -> float:
        """Monotonic seconds (`time.monotonic`, which asyncio's own loop also reads)."""
        return time.monotonic()

    def wall(self) -> float:
        """Unix seconds (`time.time`)."""
        return time.time()

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep`."""
        await asyncio.sleep(seconds)

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        """A timer on the running event loop."""
        return asyncio.get_running_loop().call_later(when_s - self.now(), callback)


class ScaledClock:
    """Model seconds since `start()`, running `time_scale` times faster than `base`."""

    def __init__(self, base: Clock, time_scale: float) -> None:
        if not (math.isfinite(time_scale) and time_scale > 0):
            raise ValueError(f"time scale must be finite and > 0, got {time_scale!r}")
        self.base = base
        self.time_scale = time_scale
        self._origin: float | None = None

    def start(self) -> None:
        """Model time 0 is now."""
        self._origin = self.base.now()

    @property
    def is_started(self) -> bool:
        """True once `start` was called."""
        return self._origin is not None

    def now(self) -> float:
        """Model seconds since `start`."""
        return (self.base.now() - self._started_origin()) * self.time_scale

    def wall(self) -> float:
        """Unix seconds (the base clock's: they are not scaled)."""
        return self.base.wall()

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of model time."""
        await self.base.sleep(self.base_duration(seconds))

    def call_at(self, when_s: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` at model time `when_s`."""
        return self.base.call_at(self.base_time(when_s), callback)

    def base_time(self, model_s: float) -> float:
        """The base clock's time at model time `model_s`."""
        return self._started_origin() + self.base_duration(model_s)

    def base_duration(self, model_s: float) -> float:
        """Base seconds a model duration takes."""
        return model_s / self.time_scale

    def _started_origin(self) -> float:
        if self._origin is None:
            raise RuntimeError("the scaled clock is not started")
        return self._origin


@dataclass(eq=False)
class ManualTimer:
    """A callback waiting on a `ManualClock`."""

    callback: Callable[[], None]
    is_cancelled: bool = False

    def cancel(self) -> None:
        """Do not run it."""
        self.is_cancelled = True


_Waiter = asyncio.Future[None] | ManualTimer


def _is_pending(waiter: _Waiter) -> bool:
    return not waiter.is_cancelled if isinstance(waiter, ManualTimer) else not waiter.done()


class ManualClock:
    """A clock that moves only on `advance`; timers run and sleepers wake when their deadline is reached."""

    def __init__(self, start_s: float = 1000.0, wall_offset_s: float = 1.7e9) -> None:
        self._now_s = start_s
        self._wall_offset_s = wall_offset_s
        self._waiters: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        """The scripted time."""
        return self._now_s

    def wall(self) -> float:
        """The scripted time shifted to a plausible unix time."""
        return self._now_s + self._wall_offset_s

    async def sleep(self, seconds: float) -> None:
        """Wait until `advance` has moved the clock `seconds` past now."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._push(self._now_s + max(0.0, seconds), future)
        await future

    def call_at(self, when_s: float, callback: Callable[[], None]) -> ManualTimer:
        """Run `callback` inside the `advance` that reaches `when_s` (the next one, if it is already past)."""
        timer = ManualTimer(callback)
        self._push(when_s, timer)
        return timer

    def next_deadline(self) -> float | None:
        """The earliest time a pending timer or sleeper waits for (None: nothing waits)."""
        while self._waiters and not _is_pending(self._waiters[0][2]):
            heapq.heappop(self._waiters)
        return self._waiters[0][0] if self._waiters else None

    def advance(self, seconds: float) -> None:
        """Move the clock forward, running each due timer and waking each due sleeper in deadline order."""
        if seconds < 0:
            raise ValueError(f"a clock cannot run backwards (advance by {seconds})")
        self._advance_to(self._now_s + seconds)

    def _advance_to(self, target: float) -> None:
        while self._waiters and self._waiters[0][0] <= target:
            when, _, waiter = heapq.heappop(self._waiters)
            self._now_s = max(self._now_s, when)
            if isinstance(waiter, ManualTimer):
                if not waiter.is_cancelled:
                    waiter.cancel()  # it runs once
                    waiter.callback()
            elif not waiter.done():
                waiter.set_result(None)
        self._now_s = target

    async def drive(self, task: asyncio.Future[Any], *, until_s: float = math.inf,
                    is_settled: Callable[[], bool] = lambda: True, poll_s: float = 0.001) -> None:
        """While `task` runs, jump to each next deadline up to `until_s` once the loop has settled.

        Settled: woken tasks have had their loop turns (`settle`) to reach their next wait, and
        `is_settled()` (say, no request is in flight outside the loop); until then it polls every
        `poll_s` real seconds. Returns when `task` is done or the clock stands at `until_s`."""
        while not task.done() and self._now_s < until_s:
            await self.settle()
            due = self.next_deadline()
            if task.done():
                return
            if due is None or not is_settled():
                await asyncio.wait([task], timeout=poll_s)
                continue
            self._advance_to(max(self._now_s, min(due, until_s)))

    @staticmethod
    async def settle() -> None:
        """Let woken tasks run on to their next wait (`SETTLE_YIELDS` turns of the event loop; time stands)."""
        for _ in range(SETTLE_YIELDS):
            await asyncio.sleep(0)

    def _push(self, when_s: float, waiter: _Waiter) -> None:
        heapq.heappush(self._waiters, (when_s, next(self._seq), waiter))


class Deadline:
    """`asyncio.timeout` on a clock: the block is cancelled and raises TimeoutError once the clock passes it."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock = clock
        self._when_s = clock.now() + seconds
        self._scope = asyncio.timeout(None)
        self._timer: Timer | None = None

    async def __aenter__(self) -> Deadline:
        await self._scope.__aenter__()
        self._arm()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        await self._scope.__aexit__(exc_type, exc, traceback)  # raises TimeoutError if it expired

    def reschedule(self, seconds: float) -> None:
        """The deadline is now `seconds` from the clock's now."""
        self._when_s = self._clock.now() + seconds
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._clock.call_at(self._when_s, self._expire)

    def _expire(self) -> None:
        self._scope.reschedule(asyncio.get_running_loop().time())  # a time already past: cancel the block now

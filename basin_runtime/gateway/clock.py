"""The injectable clock: real (`MonotonicClock`) or scripted (`ManualClock`).

Rules:
- `now()` is monotonic seconds and is what the policy sees as `now`: it never runs backwards.
- `wall()` is unix seconds, for records a person or the session log reads.
- `sleep()` paces the background timers; a `ManualClock` moves only when told, so tests script time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """Where the gateway reads time and waits for it."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Unix seconds."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock."""
        ...


class MonotonicClock:
    """The real clock."""

    def now(self) -> float:
        """Monotonic seconds (`time.monotonic`)."""
        return time.monotonic()

    def wall(self) -> float:
        """Unix seconds (`time.time`)."""
        return time.time()

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep`."""
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only on `advance`; sleepers wake when their deadline is reached."""

    def __init__(self, start_s: float = 1000.0, wall_offset_s: float = 1.7e9) -> None:
        self._now_s = start_s
        self._wall_offset_s = wall_offset_s
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
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
        heapq.heappush(self._sleepers, (self._now_s + max(0.0, seconds), next(self._seq), future))
        await future

    def advance(self, seconds: float) -> None:
        """Move the clock forward and wake every sleeper whose deadline has come."""
        if seconds < 0:
            raise ValueError(f"a clock cannot run backwards (advance by {seconds})")
        self._now_s += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now_s:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

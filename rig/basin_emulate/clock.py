"""The emulator's real-time clock: model time against the wall clock, timed events, and how late they fire.

Rules:
- Model time runs `time_scale` times faster than the wall clock (an injected `basin_runtime.clock.Clock`,
  monotonic by default), from the moment `start` is called: a `ScaledClock`, model_s = (now - origin)
  x time_scale. A modeled duration d takes d / time_scale wall seconds.
- The engines read one model time, `now_s`, that never goes back. A timed event advances it to the
  event's own model time (so a late timer does not stretch the model: the late part is lag, not
  work); an outside event (an HTTP request arriving) advances it to the wall's model time now.
- An event stamped by another process (`at_unix`, in the clock's unix seconds: the prefill's KV
  transfer finishing, seen by the decode over HTTP) is placed at its own model time when that is
  between `now_s` and the wall's model time, so the HTTP hop between the two emulators does not count
  as model time.
- Lag: every timed event records wall lateness = max(0, when it ran - its wall deadline). The
  window keeps the last `window_s` seconds (and at most `max_samples`) for p50/p99/max.
- asyncio's epoll wait rounds its timeout up to the next millisecond, so a timer set at its deadline
  runs up to 1 ms late even on an idle loop. Timers are set TIMER_ADVANCE_S early instead: an event
  then runs within a millisecond before its deadline (harmless: it carries its own model time), and
  any lateness measured is the loop's, not the selector's rounding.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from basin_runtime.clock import Clock, MonotonicClock, ScaledClock, Timer

LAG_WINDOW_S = 60.0
LAG_MAX_SAMPLES = 100_000
TIMER_ADVANCE_S = 0.001


@dataclass(frozen=True)
class LagSummary:
    """Scheduler lateness over the window, in wall seconds (0 when nothing was timed)."""

    count: int
    p50_s: float
    p99_s: float
    max_s: float
    window_s: float

    def as_dict(self) -> dict[str, float | int]:
        """The summary as JSON-ready values."""
        return {"count": self.count, "p50_s": self.p50_s, "p99_s": self.p99_s, "max_s": self.max_s,
                "window_s": self.window_s}


class LagWindow:
    """How late timed events fired, over a sliding wall-clock window."""

    def __init__(self, window_s: float = LAG_WINDOW_S, max_samples: int = LAG_MAX_SAMPLES,
                 observe: Callable[[float], None] | None = None) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.observe = observe  # also told every lag (a histogram's `observe`)

    def record(self, wall_s: float, lag_s: float) -> None:
        """One timed event ran `lag_s` after its deadline, at wall time `wall_s`."""
        self._samples.append((wall_s, lag_s))
        if self.observe is not None:
            self.observe(lag_s)

    def summary(self, wall_s: float) -> LagSummary:
        """p50, p99 and max lag of the events in the last `window_s` before `wall_s`."""
        samples = self._samples
        while samples and samples[0][0] < wall_s - self.window_s:
            samples.popleft()
        lags = sorted(lag for _, lag in samples)
        if not lags:
            return LagSummary(0, 0.0, 0.0, 0.0, self.window_s)
        return LagSummary(len(lags), _quantile(lags, 0.5), _quantile(lags, 0.99), lags[-1], self.window_s)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class ModelClock:
    """Model time for the engines, timers at model times, and the lag of those timers."""

    def __init__(self, time_scale: float, lag: LagWindow, clock: Clock | None = None) -> None:
        self.base: Clock = clock or MonotonicClock()  # the wall clock under model time
        self._scaled = ScaledClock(self.base, time_scale)
        self.time_scale = time_scale
        self.lag = lag
        self.now_s = 0.0

    def start(self) -> None:
        """Start model time at 0 now."""
        self._scaled.start()
        self.now_s = 0.0

    def wall_model_s(self) -> float:
        """The model time the wall clock stands at now."""
        return self._scaled.now()

    def catch_up(self) -> float:
        """Advance `now_s` to the wall clock (an outside event happens now); return it."""
        self.now_s = max(self.now_s, self.wall_model_s())
        return self.now_s

    def at_unix(self, unix_s: float) -> float:
        """Advance `now_s` to the model time of a unix (`Clock.wall`) stamp, bounded by now; return it."""
        wall_model = self.wall_model_s()
        stamped = wall_model - max(0.0, self.base.wall() - unix_s) * self.time_scale
        self.now_s = max(self.now_s, min(wall_model, stamped))
        return self.now_s

    def unix_of(self, model_s: float) -> float:
        """The unix time (`Clock.wall`) at which model time `model_s` is (was) due on the wall."""
        return self.base.wall() - (self.wall_model_s() - model_s) / self.time_scale

    def lag_summary(self) -> LagSummary:
        """The lag window's summary now."""
        return self.lag.summary(self.base.now())

    def wall_s(self, model_duration_s: float) -> float:
        """Wall seconds a modeled duration takes."""
        return self._scaled.base_duration(model_duration_s)

    def call_at(self, model_s: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` when the wall reaches model time `model_s` (with `now_s` advanced to it)."""
        deadline = self._scaled.base_time(model_s)
        return self.base.call_at(deadline - TIMER_ADVANCE_S, partial(self._fire, deadline, model_s, callback))

    def _fire(self, deadline: float, model_s: float, callback: Callable[[], None]) -> None:
        wall = self.base.now()
        self.lag.record(wall, max(0.0, wall - deadline))
        self.now_s = max(self.now_s, model_s)
        callback()

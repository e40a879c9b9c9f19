"""`LatencyWindow`: the median time to first token of the calls in the last `window_s` seconds.

The engines' first-token latency over a sliding window of calls: the pressure signal that gates
admission (`PolicyConfig.latency_gate_s`), read the same way by the gateway (each forwarded call's
first answer event) and the simulator (each call's first token).

Rules:
- The windowed latency is the median over the calls whose first token came in the last `window_s`
  seconds of the driver's clock (their time to first token) and the calls still waiting for theirs
  (how long they have waited so far, given by the driver), so engines that stop answering read as
  slow, not as silent; None while fewer than `min_calls` calls count (too little evidence).
- A latency must be finite and >= 0; anything else is refused (`ValueError`) and changes nothing.
- The window keeps at most `max_samples` calls (the oldest drop first): memory stays bounded.
- Pure: time comes in as `now`; calls must be recorded in time order.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

DEFAULT_WINDOW_S = 60.0
DEFAULT_MIN_CALLS = 5


class LatencyWindow:
    """Median time to first token over the calls of the last `window_s` seconds."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, min_calls: int = DEFAULT_MIN_CALLS,
                 max_samples: int = 100_000) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if min_calls < 1:
            raise ValueError(f"min_calls must be >= 1, got {min_calls!r}")
        self.window_s = window_s
        self.min_calls = min_calls
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def record(self, now: float, ttft_s: float) -> None:
        """Add one call's time to first token (seconds)."""
        if not (isinstance(ttft_s, int | float) and math.isfinite(ttft_s) and ttft_s >= 0):
            raise ValueError(f"a time to first token must be a finite number of seconds >= 0, got {ttft_s!r}")
        self._samples.append((now, float(ttft_s)))

    def median_s(self, now: float, waiting_s: Iterable[float] = ()) -> float | None:
        """The windowed median time to first token, counting `waiting_s` (how long each call still without a
        first token has waited); None with fewer than `min_calls` calls."""
        values = self.values(now, waiting_s)
        if len(values) < self.min_calls:
            return None
        return statistics.median(values)

    def values(self, now: float, waiting_s: Iterable[float] = ()) -> list[float]:
        """Every latency the median is taken over: the window's calls and `waiting_s` (what replicas report)."""
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        values = [ttft for _, ttft in self._samples]
        values.extend(waiting_s)
        return values

"""The long-run arrival rate and the decision to shed one queued session.

Shedding: dropping load only when capacity is truly short.

Rules:
- The long-run arrival rate is the number of arrivals in the sliding window (now - window_s, now]
  divided by the window, or by the time since the policy first saw a `now` if that is shorter.
  It is undefined (no shedding) before any time has passed.
- Shed only when shedding is configured (peak completion rate measured), the arrival rate
  exceeds the peak completion rate, and the queue head has waited at least shed_wait_s.
- What is shed is the lowest-priority queued session (largest p, latest arrival on ties); at
  most one session per tick, so a short burst of ticks cannot empty the queue at once.
- Nothing else ever drops a session; a shed session is forgotten by the policy.
Invariant: the arrival deque holds only arrivals inside the window, oldest first.
"""

from __future__ import annotations

from collections import deque


class ArrivalRateMeter:
    """Counts arrivals over a sliding window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._arrivals_s: deque[float] = deque()

    def record(self, now: float) -> None:
        """Count one arrival at `now`."""
        self._arrivals_s.append(now)
        self._prune(now)

    def rate_per_s(self, now: float, started_s: float) -> float | None:
        """Arrivals per second over the window (or since `started_s`); None if no time passed."""
        self._prune(now)
        span_s = min(self._window_s, now - started_s)
        if span_s <= 0:
            return None
        return len(self._arrivals_s) / span_s

    def arrivals_s(self) -> list[float]:
        """The arrivals still held, oldest first (`Policy.to_state`)."""
        return list(self._arrivals_s)

    def load(self, arrivals_s: list[float]) -> None:
        """Hold exactly these arrivals (oldest first), as `arrivals_s` returned them."""
        self._arrivals_s = deque(arrivals_s)

    def _prune(self, now: float) -> None:
        horizon_s = now - self._window_s
        while self._arrivals_s and self._arrivals_s[0] <= horizon_s:
            self._arrivals_s.popleft()


def should_shed(
    arrival_rate_per_s: float | None,
    peak_completion_rate_per_s: float | None,
    head_waited_s: float,
    shed_wait_s: float,
) -> bool:
    """True when capacity is truly short: arrivals outrun peak completions and the head starves."""
    if arrival_rate_per_s is None or peak_completion_rate_per_s is None:
        return False
    return arrival_rate_per_s > peak_completion_rate_per_s and head_waited_s >= shed_wait_s


def shed_reason(arrival_rate_per_s: float, peak_completion_rate_per_s: float, head_waited_s: float) -> str:
    """The reason a person reads when a session is shed."""
    return (
        f"arrival rate {arrival_rate_per_s:.3g}/s exceeds peak completion rate "
        f"{peak_completion_rate_per_s:.3g}/s; queue head waited {head_waited_s:.0f} s"
    )

"""Goodput as the paper defines it: per-session outcomes and the arithmetic.

Rules:
- A session is good when it finished (not killed, shed, aborted, or abandoned by its client after its
  attempts timed out or its time limit passed), its end-to-end time (from its arrival at the door, so
  time held in an admission queue and waits between retried attempts count) is at most
  GOODPUT_DEADLINE_FACTOR (4) x its unloaded time (the same session simulated alone on an empty deployment),
  and at least STEP_SHARE of its decode steps took less than STEP_SLO_S. A session with no decode
  step meets the step rule.
- Goodput over a window = good sessions among those that ARRIVED in [start, end), per hour of
  window. Sessions that arrived in the window but had not finished when the run stopped count as
  failures (the runner only stops once each of them has finished or passed its deadline).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from basin_runtime.policy.deadline import goodput_deadline_s

STEP_SLO_S = 0.05
STEP_SHARE = 0.95


@dataclass(frozen=True)
class SessionOutcome:
    """How one session fared."""

    session_id: str
    arrival_s: float
    ended_s: float | None  # None: still running when the run stopped
    status: str  # finished, killed, shed, aborted, abandoned, live, queued
    unloaded_s: float | None  # None when not needed (outside every goodput window)
    steps: float
    good_steps: float
    is_burst: bool = False
    first_token_s: float | None = None  # the first token of the first call (None: never came)

    @property
    def deadline_s(self) -> float | None:
        """The latest end that still counts as good."""
        if self.unloaded_s is None:
            return None
        return goodput_deadline_s(self.arrival_s, self.unloaded_s)

    @property
    def meets_step_slo(self) -> bool:
        """True when enough decode steps were fast."""
        return self.steps <= 0 or self.good_steps >= STEP_SHARE * self.steps


def is_good(outcome: SessionOutcome) -> bool:
    """True when the session counts toward goodput."""
    deadline = outcome.deadline_s
    if outcome.status != "finished" or outcome.ended_s is None or deadline is None:
        return False
    return outcome.ended_s <= deadline and outcome.meets_step_slo


@dataclass(frozen=True)
class Goodput:
    """Sessions arrived in a window, how many were good, and the rate per hour of window."""

    arrived: int
    good: int
    finished: int
    per_hour: float


def goodput(outcomes: Iterable[SessionOutcome], start_s: float, end_s: float) -> Goodput:
    """Goodput of the sessions that arrived in [start_s, end_s) (burst sessions excluded)."""
    if not end_s > start_s:
        raise ValueError(f"goodput window must have end > start, got [{start_s}, {end_s})")
    window = [o for o in outcomes if start_s <= o.arrival_s < end_s and not o.is_burst]
    good = sum(is_good(o) for o in window)
    finished = sum(o.status == "finished" for o in window)
    return Goodput(len(window), good, finished, good / ((end_s - start_s) / 3600.0))

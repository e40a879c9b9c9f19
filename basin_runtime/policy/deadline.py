"""Goodput's deadline, the paper's: a session counts as good only if it ends within 4x its unloaded time.

Rules:
- The deadline of a session is its arrival (at the door) + GOODPUT_DEADLINE_FACTOR x its unloaded
  time (the same session alone on an empty deployment). This is its one definition: the simulator's
  goodput and run loop, the replayer's drain and the calibration's latency gate all read it here.
"""

from __future__ import annotations

GOODPUT_DEADLINE_FACTOR = 4.0


def goodput_deadline_s(arrival_s: float, unloaded_s: float) -> float:
    """The latest end at which a session arriving at `arrival_s` still counts toward goodput."""
    return arrival_s + GOODPUT_DEADLINE_FACTOR * unloaded_s

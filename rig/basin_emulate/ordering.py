"""The queue key of a request's priority, as SGLang's scheduler orders its waiting queue.

Rules (SGLang `--enable-priority-scheduling`, `--schedule-low-priority-values-first`):
- Off (the default): first come, first served; a request's `priority` is ignored.
- On: higher values first, or lower first with `low_values_first`; a request without a priority
  gets the lowest one (it runs after every request that has one); ties are first come, first served.
- Metrics label requests by priority only with priority scheduling on (`label`), as SGLang does.
- basin_sim's queues pop the smallest key first and break ties by arrival, so the key is 0 (FCFS),
  -priority (higher first) or priority (lower first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueOrder:
    """How `priority` orders the prefill queue and decode's pre-allocation queue."""

    is_priority_scheduling: bool = False
    is_low_values_first: bool = False

    def key(self, priority: int | None) -> float:
        """The key basin_sim's queues sort on (smallest first, ties by arrival)."""
        if not self.is_priority_scheduling:
            return 0.0
        if priority is None:
            return math.inf
        return float(priority) if self.is_low_values_first else -float(priority)

    def label(self, priority: int | None) -> int | None:
        """The metrics' `priority` label value: the request's priority with priority scheduling on, else none."""
        return priority if self.is_priority_scheduling else None

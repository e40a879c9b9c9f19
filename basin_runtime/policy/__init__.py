"""The Basin policy core: admission, priority, budget, shedding and the lending ledger.

The Basin policy core: one pure implementation (no I/O, no clock, stdlib only) that the HTTP
gateway drives with a real clock and the simulator with a simulated one.

Modules, one job each:
  config.py     PolicyConfig, the PolicyError tree, value checks
  priority.py   p = arrival_s + predicted_peak_tokens / tokens_per_s (prototype: arrival_s)
  admission.py  the queue (strict priority order, no backfilling) and the admission rule
  budget.py     the reference budget B and its small hit-rate moves
  shedding.py   long-run arrival rate; shed one lowest-priority session when capacity is short
  recovery.py   a collapse (hit rate off its plateau, working set over the budget): hold live sessions at
                their tool boundary, lowest priority first; resume them by priority; a bounded hold
  lending.py    the ledger of decode memory lent to the prefix cache
  events.py     decisions out (Admitted, Requeued, BudgetMoved, Shed, Held, Resumed) and the state snapshot
  lifecycle.py  the session states, steps and the one transition table every driver checks against
  core.py       Policy, wiring the above around one state
  hit_rate.py   HitRateWindow: the windowed prefix hit rate that moves the budget
  calibrated.py Calibration and policy_config: the one construction from measured numbers
  capacity.py   a deployment's cache capacity: the sum of its instances' KV pools
"""

from __future__ import annotations

from basin_runtime.policy.budget import reference_budget_tokens
from basin_runtime.policy.config import (
    ClockError,
    DuplicateSessionError,
    PolicyConfig,
    PolicyError,
    PolicyMode,
    UnknownSessionError,
)
from basin_runtime.policy.core import Policy
from basin_runtime.policy.events import (
    Admitted,
    BudgetMoved,
    Event,
    Held,
    PolicySnapshot,
    Requeued,
    Resumed,
    Shed,
    admitted_ids,
)
from basin_runtime.policy.lending import LendingLedger, LentEntry, Reclaimed, WriteBackPlan
from basin_runtime.policy.lifecycle import HeldState, LifecycleError, LifecycleEvent, SessionState, transition

__all__ = [
    "Admitted",
    "BudgetMoved",
    "ClockError",
    "DuplicateSessionError",
    "Event",
    "Held",
    "HeldState",
    "LendingLedger",
    "LentEntry",
    "LifecycleError",
    "LifecycleEvent",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "PolicyMode",
    "PolicySnapshot",
    "Reclaimed",
    "Requeued",
    "Resumed",
    "SessionState",
    "Shed",
    "UnknownSessionError",
    "WriteBackPlan",
    "admitted_ids",
    "reference_budget_tokens",
    "transition",
]

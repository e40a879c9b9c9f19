"""Events the policy core emits and the snapshot of its state.

Decisions out of the policy core, as data.

Rules:
- Every decision the policy makes is one frozen event: `Admitted` (a session may start: at its
  arrival with a wait of 0, or from the queue; `is_resumed` when it had run before and was held
  for a call that outgrew its reservation), `Requeued` (a live session's call outgrew its
  reservation while admission was engaged and did not fit: the session waits in the queue again),
  `BudgetMoved` (the budget changed), `Shed` (a
  queued session is dropped, with a reason a person can read; or a live one held past its bounded hold,
  `recovery.py`), `Held` (a collapse is under way: a live session's next call waits at its tool boundary,
  its engine session closed) and `Resumed` (a held session's call may go). Every step returns its events.
- `PolicySnapshot` is the whole observable state; tests compare it field by field, and
  `to_dict()` gives the same content as plain JSON types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias


@dataclass(frozen=True)
class Admitted:
    """A session was admitted (at arrival, adopted, or from the queue) and may start."""

    session_id: str
    now_s: float
    priority: float
    waited_s: float
    reservation_tokens: int
    is_resumed: bool = False  # it had run, and was held for a call that outgrew its reservation


@dataclass(frozen=True)
class Requeued:
    """A live session's call outgrew its reservation while admission was engaged: it waits in the queue again."""

    session_id: str
    now_s: float
    priority: float
    context_tokens: int  # the outgrowing call's context
    reservation_tokens: int  # what it reserves now: that context plus the predicted growth
    reserved_tokens: int  # the other live sessions' reservations, summed
    budget_tokens: int
    reason: str


@dataclass(frozen=True)
class BudgetMoved:
    """The budget changed: a hit-rate step on `tick`, or an operator changed the reference."""

    now_s: float
    old_budget_tokens: int
    new_budget_tokens: int
    reference_budget_tokens: int
    hit_rate: float | None  # None for an operator change
    reason: str


@dataclass(frozen=True)
class Shed:
    """A queued session was dropped because capacity is truly short; it is forgotten."""

    session_id: str
    now_s: float
    priority: float
    waited_s: float
    arrival_rate_per_s: float
    peak_completion_rate_per_s: float
    head_waited_s: float
    reason: str


@dataclass(frozen=True)
class Held:
    """A collapse is under way: a live session's next call waits at its tool boundary (`recovery.py`)."""

    session_id: str
    now_s: float
    priority: float
    context_tokens: int  # its context, out of the working set while held
    reason: str


@dataclass(frozen=True)
class Resumed:
    """A held session may send its call again: the hit rate is back on its plateau, or its hold ran out."""

    session_id: str
    now_s: float
    priority: float
    held_s: float
    reason: str
    is_bounded: bool = False  # its hold ran out (`recovery_max_hold_s`), whatever the hit rate


Event: TypeAlias = Admitted | Requeued | BudgetMoved | Shed | Held | Resumed


def admitted_ids(events: list[Event]) -> tuple[str, ...]:
    """The ids of the `Admitted` events, in order."""
    return tuple(e.session_id for e in events if isinstance(e, Admitted))


@dataclass(frozen=True)
class PolicySnapshot:
    """The policy's whole observable state at the last `now` it saw."""

    now_s: float | None
    live: tuple[str, ...]  # in admission order
    queued: tuple[str, ...]  # in service order, head first
    reserved_tokens: int
    working_set_tokens: int
    budget_tokens: int
    reference_budget_tokens: int
    is_engaged: bool

    def to_dict(self) -> dict[str, Any]:
        """The snapshot as JSON-ready plain types."""
        return {
            "now_s": self.now_s,
            "live": list(self.live),
            "queued": list(self.queued),
            "reserved_tokens": self.reserved_tokens,
            "working_set_tokens": self.working_set_tokens,
            "budget_tokens": self.budget_tokens,
            "reference_budget_tokens": self.reference_budget_tokens,
            "is_engaged": self.is_engaged,
        }

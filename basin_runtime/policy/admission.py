"""The admission queue (a heap in priority order) and the admission rule.

Admission queue and admission rule.

Rules:
- The queue serves strictly in (priority, seq) order. The head blocks everyone behind it: there is
  no backfilling, so a big session is never starved by a stream of smaller ones that would fit.
- While admission is engaged, the head is admitted only if
      reserved_tokens(live) + reservation(head) <= budget_tokens,
  or if no session is live at all (the lone head goes in even over budget: service progresses).
- A reservation is max(peak_reservation_tokens, context_tokens, regrown_tokens) in basin mode (the
  predicted peak times the session's reservation multiplier m(q), or the current context once the
  session has grown past it, or what it was re-reserved when a call outgrew its reservation:
  that call's context plus the predicted growth, `regrowth_tokens`) and context_tokens in prototype
  mode. Reservations are whole tokens (m x predicted peak rounded up), so their sums stay exact.
  Priority uses the bare predicted peak, not the reservation.
Invariants:
- Every queued session has exactly one current entry in each heap; an entry is current when its
  id maps to a record with the same seq. Admitted, withdrawn and shed sessions leave stale
  entries that are skipped lazily; a heap is rebuilt when stale entries outnumber current ones,
  so memory stays O(queued) and every operation is O(log n) amortized.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from basin_runtime.policy.config import PolicyMode

_COMPACT_SLACK = 64


@dataclass(slots=True)
class SessionRecord:
    """What the policy keeps about one live or queued session."""

    session_id: str
    seq: int
    arrival_s: float
    predicted_peak_tokens: float
    priority: float
    context_tokens: int
    reservation_multiplier: float = 1.0  # m(q) of the predictor's file (`basin_runtime/predictor.py`)
    first_context_tokens: int = -1  # its context at arrival (-1: `context_tokens`)
    regrown_tokens: int = 0  # re-reserved when a call outgrew its reservation (0: never)
    queued_s: float = math.nan  # when it last entered the queue (NaN: at arrival)
    has_run: bool = False  # it was admitted once (a queued one with this set was held when a call outgrew it)
    peak_reservation_tokens: int = field(init=False)  # m x the predicted peak, rounded up

    def __post_init__(self) -> None:
        self.peak_reservation_tokens = math.ceil(self.predicted_peak_tokens * self.reservation_multiplier)
        if self.first_context_tokens < 0:
            self.first_context_tokens = self.context_tokens
        if math.isnan(self.queued_s):
            self.queued_s = self.arrival_s

    @property
    def growth_tokens(self) -> int:
        """The growth its prediction expects past its first call: ceil(m x peak) - first context, at least 0."""
        return max(0, self.peak_reservation_tokens - self.first_context_tokens)

    def regrowth_tokens(self, context_tokens: int) -> int:
        """What a call with this context reserves by the first call's rule: its context plus the predicted growth."""
        return context_tokens + self.growth_tokens


def reservation_tokens(mode: PolicyMode, record: SessionRecord) -> int:
    """The tokens a session holds against the budget while it is live."""
    if mode == "prototype":
        return record.context_tokens
    return max(record.peak_reservation_tokens, record.context_tokens, record.regrown_tokens)


def fits(reserved_tokens: int, head_tokens: int, budget_tokens: int, num_live: int) -> bool:
    """The admission rule for the queue head while admission is engaged."""
    return num_live == 0 or reserved_tokens + head_tokens <= budget_tokens


class AdmissionQueue:
    """Queued sessions in service order, with the lowest-priority one at hand for shedding."""

    def __init__(self) -> None:
        self._records: dict[str, SessionRecord] = {}
        self._front: list[tuple[float, int, str]] = []  # min-heap of (priority, seq, id)
        self._back: list[tuple[float, int, str]] = []  # min-heap of (-priority, -seq, id)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def get(self, session_id: str) -> SessionRecord | None:
        """The queued record for `session_id`, or None."""
        return self._records.get(session_id)

    def push(self, record: SessionRecord) -> None:
        """Queue a session; its id must not be queued already."""
        assert record.session_id not in self._records, record.session_id
        self._records[record.session_id] = record
        heapq.heappush(self._front, (record.priority, record.seq, record.session_id))
        heapq.heappush(self._back, (-record.priority, -record.seq, record.session_id))

    def remove(self, session_id: str) -> SessionRecord:
        """Take a queued session out (admitted, withdrawn or shed); its heap entries go stale."""
        record = self._records.pop(session_id)
        self._compact()
        return record

    def head(self) -> SessionRecord | None:
        """The session served next (smallest priority, then earliest arrival), or None."""
        while self._front:
            _, seq, session_id = self._front[0]
            record = self._records.get(session_id)
            if record is not None and record.seq == seq:
                return record
            heapq.heappop(self._front)
        return None

    def tail(self) -> SessionRecord | None:
        """The session served last (largest priority, then latest arrival), or None."""
        while self._back:
            _, neg_seq, session_id = self._back[0]
            record = self._records.get(session_id)
            if record is not None and record.seq == -neg_seq:
                return record
            heapq.heappop(self._back)
        return None

    def shed_candidate(self) -> SessionRecord | None:
        """The session served last among those never admitted (a session held for an outgrown call is not shed)."""
        tail = self.tail()
        if tail is None or not tail.has_run:
            return tail
        return next((r for r in reversed(self.in_service_order()) if not r.has_run), None)

    def in_service_order(self) -> list[SessionRecord]:
        """All queued sessions, head first (O(n log n); for snapshots, not the hot path)."""
        return sorted(self._records.values(), key=lambda r: (r.priority, r.seq))

    def _compact(self) -> None:
        limit = 2 * len(self._records) + _COMPACT_SLACK
        if len(self._front) > limit:
            self._front = [(r.priority, r.seq, r.session_id) for r in self._records.values()]
            heapq.heapify(self._front)
        if len(self._back) > limit:
            self._back = [(-r.priority, -r.seq, r.session_id) for r in self._records.values()]
            heapq.heapify(self._back)

"""`budgeter`: the vLLM study's budgeter as we read its summary: admission and suspension against the KV pool.

Rules (P = the KV pool: the deployment's prefill cache capacity, all prefill instances):
- Demand = the sum of the current contexts (latest prompt) of the active sessions: admitted and
  not suspended, tool-idle ones included. A suspended session's context leaves the demand when it
  is suspended and comes back when it is resumed.
- Admission: new sessions wait at the door in arrival order; the head is admitted while demand +
  its first prompt <= P, and only while no session is suspended (suspended sessions were admitted
  earlier: they come back first). Strict order: a head that does not fit blocks those behind it.
- Suspension: when a call's prompt pushes demand above P, the most recently admitted active
  sessions are suspended (newest first) until demand <= P; each is parked at its next call
  boundary, the call then held (the engine parks it; a session calling now is parked now). The
  oldest active session is never suspended, so one session alone over P still runs.
- Resumption: in admission order, while demand is below RESUME_FRACTION x P and stays <= P with the
  resumed session's last known context (its parked call's prompt when the engine told it). The gap
  between the two thresholds keeps a session suspended at P from resuming at once.
- Thresholds are fractions of the pool, never per workload. Requests are served first come, first
  served (priority = send time), as plain SGLang; no pins.
- Where the summary is silent (how many to suspend, the resume order against new arrivals), the
  choice above is ours: suspend just enough, resume before admitting.
"""

from __future__ import annotations

import collections
import itertools

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    NO_REPORT,
    Decisions,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)

RESUME_FRACTION = 0.9


class BudgeterPolicy:
    """Bound the active sessions' contexts by the KV pool; suspend the newest, resume the oldest."""

    def __init__(self, pool_tokens: int, resume_fraction: float = RESUME_FRACTION) -> None:
        if pool_tokens <= 0:
            raise ValueError(f"budgeter pool_tokens must be > 0, got {pool_tokens!r}")
        if not 0 < resume_fraction <= 1:
            raise ValueError(f"budgeter resume_fraction must be in (0, 1], got {resume_fraction!r}")
        self.name = "budgeter"
        self.pins: PinRule | None = None
        self.pool_tokens = pool_tokens
        self.resume_below_tokens = resume_fraction * pool_tokens
        self._seq = itertools.count()
        self._order: dict[str, int] = {}  # admitted session -> admission sequence number
        self._active: dict[str, int] = {}  # active session -> context, in admission order
        self._suspended: dict[str, int] = {}  # suspended session -> last known context
        self._waiting: collections.OrderedDict[str, int] = collections.OrderedDict()  # at the door -> first prompt
        self.demand_tokens = 0

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Queue the session at the door; admit what fits."""
        self._waiting[session_id] = session.first_prompt_tokens
        return self._fill()

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """Update the session's context; over the pool, suspend the newest sessions."""
        if session_id in self._suspended:
            self._suspended[session_id] = prompt_tokens  # its parked call: known for its resumption
            return NO_DECISIONS
        self.demand_tokens += prompt_tokens - self._active[session_id]
        self._active[session_id] = prompt_tokens
        if self.demand_tokens <= self.pool_tokens:
            return NO_DECISIONS
        suspend = []
        for sid in reversed(list(self._active)[1:]):  # newest first; the oldest keeps running
            if self.demand_tokens <= self.pool_tokens:
                break
            context = self._active.pop(sid)
            self.demand_tokens -= context
            self._suspended[sid] = context
            suspend.append(sid)
        if not suspend:
            return NO_DECISIONS
        self._suspended = dict(sorted(self._suspended.items(), key=lambda item: self._order[item[0]]))
        return Decisions(suspend=tuple(suspend))

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """Forget the session (live, suspended or waiting); admit or resume what now fits."""
        self._waiting.pop(session_id, None)
        self._suspended.pop(session_id, None)
        self._order.pop(session_id, None)
        context = self._active.pop(session_id, None)
        if context is not None:
            self.demand_tokens -= context
        return self._fill()

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing moves on a tick: demand changes only at calls and ends."""
        return NO_DECISIONS

    def report(self) -> PolicyReport:
        """Nothing to report."""
        return NO_REPORT

    def priority(self, session_id: str, now: float) -> float:
        """First come, first served."""
        return now

    def _fill(self) -> Decisions:
        resume: list[str] = []
        for sid, context in list(self._suspended.items()):  # admission order
            fits = self.demand_tokens + context <= self.pool_tokens
            if self._active and not (self.demand_tokens < self.resume_below_tokens and fits):
                break
            del self._suspended[sid]
            self._active[sid] = context
            self.demand_tokens += context
            resume.append(sid)
        if resume:
            self._active = dict(sorted(self._active.items(), key=lambda item: self._order[item[0]]))
        admit: list[str] = []
        while self._waiting and not self._suspended:
            sid, first = next(iter(self._waiting.items()))
            if self._active and self.demand_tokens + first > self.pool_tokens:
                break
            del self._waiting[sid]
            self._order[sid] = next(self._seq)
            self._active[sid] = first
            self.demand_tokens += first
            admit.append(sid)
        if not admit and not resume:
            return NO_DECISIONS
        return Decisions(admit=tuple(admit), resume=tuple(resume))


def _budgeter(context: PolicyContext) -> BudgeterPolicy:
    deployment = context.deployment
    return BudgeterPolicy(deployment.cache_capacity_tokens)


BUDGETER = PolicySpec("budgeter", "vLLM study's budgeter: active sessions' contexts bounded by the KV pool; the "
                      "newest suspended at their next call when it overflows, resumed in admission order below 0.9",
                      False, _budgeter)

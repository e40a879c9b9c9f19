"""`continuum`: per-call KV pins with Continuum's online TTL rule across tool calls, program-level FCFS.

Continuum (as published): no admission control; every request of a session carries the session's
arrival time as its priority (program-level FCFS); after each answer the prefill cache keeps the
session's chain pinned for a TTL chosen for that call, so the next call finds it; a pin that outlives
its TTL becomes evictable. The engine keeps the pins (pins.py, radix_cache.py: holds) and asks this
policy, as its `PinRule`, for each answer's TTL.

Rules:
- The TTL is the paper's tau* for the answered call (continuum_ttl.py: the argmax of its Eq. 2 utility),
  every term measured online by this policy from what the engine has shown it so far:
  - a tool duration is the time from a session's answer to its next call (the first attempt; a retry
    after a timeout adds none);
  - a session whose pin had expired (or whose TTL was 0) when its next call came is evicted; that
    call's wait from then until it is scheduled (`on_scheduled`) is one sample of T;
  - a session that ends with every call answered is a completed program (eta).
  An explicit `PolicyContext.pin_ttl_s` pins every answer for that long instead (nothing measured).
- The last call of a session is not pinned (its program is over); neither is an aborted call (the
  engine does not ask: Continuum pins only answered calls).
- Report (`report`): answers, the share of them pinned, the mean TTL over answers, the share of
  tool time spent pinned (sum of min(TTL, duration) / sum of durations), the mean over answers of the T
  their choice read, eta now, the evicted re-entries measured.
- Substitution: in the paper's vLLM a preempted running request also marks its program evicted; in
  this PD model prefill holds no running request (decode's retractions do not touch the prefill
  cache), so only expired pins evict. (The paper's v6 also puts a pinned request ahead of unpinned
  ones; here both keep their session's arrival as priority.)
"""

from __future__ import annotations

from dataclasses import dataclass

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    Decisions,
    PinReport,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)
from basin_sim.policies.continuum_ttl import TtlEstimator
from basin_sim.profile import Deployment


@dataclass
class _Program:
    arrival_s: float
    num_calls: int
    answered: int = 0
    answer_s: float | None = None  # the last answer not yet followed by a call
    ttl_s: float = 0.0  # that answer's TTL
    evicted_since_s: float | None = None  # an evicted program's call waiting to be scheduled


class ContinuumPolicy:
    """Admit everyone; priority = session arrival; pin each answered call's KV for its tau* (or a fixed TTL)."""

    def __init__(self, deployment: Deployment, fixed_ttl_s: float | None = None) -> None:
        if fixed_ttl_s is not None and not fixed_ttl_s > 0:
            raise ValueError(f"continuum pin_ttl_s must be > 0 (or None: the online rule), got {fixed_ttl_s!r}")
        self.name = "continuum"
        self.pins: PinRule | None = self
        self.fixed_ttl_s = fixed_ttl_s
        self.estimator = TtlEstimator(deployment.profile, deployment.has_host_tier)
        self._programs: dict[str, _Program] = {}
        self.answers = 0
        self.pinned_answers = 0
        self.ttl_sum_s = 0.0
        self.queue_delay_sum_s = 0.0  # T as each answer's choice read it
        self.tool_s = 0.0
        self.pinned_tool_s = 0.0
        self.evicted_reentries = 0

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Always admit; remember the arrival time and how many calls make the program."""
        self._programs[session_id] = _Program(now, session.n_calls)
        return Decisions(admit=(session_id,))

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """The first attempt after an answer: one tool duration; evicted if the pin had expired."""
        program = self._programs[session_id]
        if program.answer_s is not None:
            duration = now - program.answer_s
            self.estimator.observe_tool(duration)
            self.tool_s += duration
            self.pinned_tool_s += min(program.ttl_s, duration)
            if duration > program.ttl_s:
                program.evicted_since_s = now
            program.answer_s = None
        return NO_DECISIONS

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        """tau* for the answered call's context (0 after the program's last call)."""
        program = self._programs[session_id]
        program.answered += 1
        if program.answered >= program.num_calls:
            return 0.0
        ttl = self.fixed_ttl_s if self.fixed_ttl_s is not None else self.estimator.choose(context_tokens).ttl_s
        program.answer_s, program.ttl_s = now, ttl
        self.answers += 1
        self.pinned_answers += ttl > 0
        self.ttl_sum_s += ttl
        self.queue_delay_sum_s += self.estimator.queue_delay_s
        return ttl

    def on_scheduled(self, session_id: str, now: float) -> None:
        """An evicted program's call is scheduled: the wait since its arrival is a sample of T."""
        program = self._programs.get(session_id)
        if program is not None and program.evicted_since_s is not None:
            self.estimator.observe_evicted_wait(now - program.evicted_since_s)
            self.evicted_reentries += 1
            program.evicted_since_s = None

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """A program with every call answered completed (eta); forget the session."""
        program = self._programs.pop(session_id, None)
        if program is not None and program.answered >= program.num_calls:
            self.estimator.observe_completed(program.num_calls)
        return NO_DECISIONS

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def priority(self, session_id: str, now: float) -> float:
        """Program-level FCFS: the session's arrival time."""
        return self._programs[session_id].arrival_s

    def report(self) -> PolicyReport:
        """What the pins did over the run (see the rules above)."""
        return PolicyReport(pins=PinReport(
            pin_answers=self.answers,
            pin_answer_share=self.pinned_answers / self.answers if self.answers else None,
            pin_ttl_mean_s=self.ttl_sum_s / self.answers if self.answers else None,
            pin_tool_time_share=self.pinned_tool_s / self.tool_s if self.tool_s > 0 else None,
            pin_queue_delay_s=self.queue_delay_sum_s / self.answers if self.answers else None,
            pin_eta=self.estimator.eta,
            pin_evicted_reentries=self.evicted_reentries))


def _continuum(context: PolicyContext) -> ContinuumPolicy:
    return ContinuumPolicy(context.deployment, context.pin_ttl_s)


CONTINUUM = PolicySpec("continuum", "Continuum: KV pinned across tool calls for a TTL chosen per call from its "
                       "online rule, program-level FCFS, no admission control", False, _continuum)

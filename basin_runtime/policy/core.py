"""`Policy`: admission, priority, budget and shedding wired together around one state.

The policy core: sessions in, decisions out, time passed in as `now` (seconds). No I/O.

Rules:
- Working set = sum of the current contexts of all live sessions (tool-running ones included);
  a session's context is the latest prompt size observed for it, its context at arrival before.
- Admission is engaged while working set x r > budget, while anyone is queued, or always if
  `always_engaged` (r = `reservation_ratio`: the budget is in reservation units, r times the live
  contexts on the knee ramp, so the working set is held against B / r, the knee side of B).
  With a latency gate (`latency_gate_s`), the working set engages admission only while the engines
  are slow: the windowed median time to first token given to the last `tick` is >= the gate (no
  report yet: not slow). Past the knee the hit rate falls, but as long as the engines keep up the
  cache's misses cost less than holding sessions at the door would.
  An arrival is judged on the working set it would make: its own context counts (a first call
  carrying a long history is held like the same tokens already live). A session arriving while
  that does not engage admission is admitted at once; otherwise it queues and the queue is drained
  by the rule in `admission.py` (strict priority order, lone head goes in over budget).
- An adopted session (already running, e.g. across a gateway restart) is live at once and does not
  count as an arrival for the shedding rate.
- Admitted sessions run to completion unless a call outgrows its reservation while admission is
  engaged: no budget change ever evicts a live session. Only shedding (`shedding.py`, on `tick`)
  drops a queued session, and only one never admitted; `finish` of a queued session is the client
  withdrawing it.
- Outgrowth (basin mode, unless `can_outgrow_reservation`): a live session's call whose context
  passes its reservation is re-reserved by the first call's rule, its context plus the predicted
  growth (ceil(m x peak) minus its first context, at least 0). If admission is engaged with the
  working set that call makes, the session keeps running only if it would be admitted now: the
  queue head is not ahead of it and it fits beside the others (alone, it goes in over budget, the
  lone-head rule). Otherwise it leaves the live set (its context and reservation with it) and waits
  in the queue by its fixed priority (`Requeued`); its next admission is an `Admitted` with
  `is_resumed`, its wait counted from the requeue. Not engaged, the new reservation just holds.
  A revision replaces the re-reservation (the new estimate covers the growth seen).
- Revision (`revise`): a live or queued session's predicted peak and multiplier may be replaced
  while it runs (an online re-estimate), up or down. Its fixed priority stays fixed (it came from
  the arrival's prediction). Its reservation becomes max(ceil(m x new peak), context) and the
  reserved sum moves by the difference at once. A revision down may let queue heads in (it returns
  their admissions, in order, like `observe`); a revision up never evicts anyone, even past the
  budget: the budget then holds the queue until enough finishes. Prototype mode reserves contexts,
  so a revision there changes nothing but the stored prediction.
- Every step (`arrive`, `adopt`, `observe`, `revise`, `finish`, `tick`, `set_reference_budget`) returns its
  list of events, in order: each admission is an `Admitted` with its wait and reservation (the
  arriving session's own admission too, with a wait of 0), so a driver has one translation path.
- A session's states and steps are `lifecycle.py`'s (queued, live; arrive, adopt, admit, requeue, shed,
  and `finish` is its `end`); each change of state is checked against its table before anything changes.
- Every public method validates everything before it changes anything: an illegal step raises
  `PolicyError` and leaves the state exactly as it was. `now` never runs backwards.
- Recovery (`PolicyConfig.recovery`, basin mode only: the prototype runs as the paper's did; `recovery.py`):
  on `tick`, after the budget, the admissions and the
  shedding, a collapse (the hit rate off its plateau while the working set not held is over the budget)
  holds live sessions at their tool boundary (`Held`), lowest priority first; they stay live with their
  reservation and come back highest priority first (`Resumed`) once the hit rate is back, or when their
  bounded hold runs out (then `Resumed`, or `Shed` by the shedding rule: the one way a live session is
  shed). A held session that finishes or is requeued leaves its hold.
- `to_state()` is everything that affects a decision (configuration, clock, sessions in admission
  and service order, budget, arrival window, last first-token latency) as versioned JSON-ready
  data; `Policy.from_state` rebuilds a policy that takes every later step exactly as the original
  would (replicas restart from it, `basin_runtime/state/`). A state that does not add up is refused.
Invariants (after every public call):
- working_set_tokens == sum(context of live); reserved_tokens == sum(reservation of live).
- The queue is settled: if it is not empty, some session is live and the head does not fit.
- While admission is engaged, a step that lets a live session grow past its reservation never takes
  reserved_tokens past the budget, unless that session is the only one live.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from basin_runtime.policy.admission import (
    AdmissionQueue,
    SessionRecord,
    fits,
    reservation_tokens,
)
from basin_runtime.policy.budget import BudgetController
from basin_runtime.policy.config import (
    ClockError,
    DuplicateSessionError,
    PolicyConfig,
    PolicyError,
    UnknownSessionError,
    require_finite,
    require_tokens,
)
from basin_runtime.policy.events import Admitted, Event, Held, PolicySnapshot, Requeued, Resumed, Shed
from basin_runtime.policy.lifecycle import HeldState, LifecycleEvent, SessionState, transition
from basin_runtime.policy.priority import priority_s, service_key
from basin_runtime.policy.recovery import Recovery
from basin_runtime.policy.shedding import ArrivalRateMeter, shed_reason, should_shed

STATE_FORMAT = "basin-policy-state"
STATE_VERSION = 2  # 2: records carry first context, re-reservation, queue time, has run


class Policy:
    """The Basin policy core; drive it with `arrive`, `observe`, `finish` and `tick`."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._budget = BudgetController(config)
        self._queue = AdmissionQueue()
        self._live: dict[str, SessionRecord] = {}
        self._arrivals = ArrivalRateMeter(config.arrival_window_s)
        self._next_seq = 0
        self._started_s: float | None = None
        self._now_s: float | None = None
        self._working_set_tokens = 0
        self._reserved_tokens = 0
        self._ttft_s: float | None = None  # the windowed time to first token at the last tick
        self._recovery = Recovery(config)

    # --- events in -------------------------------------------------------------------------

    def arrive(self, session_id: str, now: float, predicted_peak_tokens: float, context_tokens: int,
               reservation_multiplier: float = 1.0) -> list[Event]:
        """A session arrives; its `Admitted` event is in the list if it is admitted now (else it queues).

        It reserves `reservation_multiplier` x `predicted_peak_tokens` (or its context, when larger);
        its priority comes from the bare prediction.
        """
        return self._enter(session_id, now, predicted_peak_tokens, context_tokens, reservation_multiplier,
                           is_adopted=False)

    def adopt(self, session_id: str, now: float, predicted_peak_tokens: float, context_tokens: int,
              reservation_multiplier: float = 1.0) -> list[Event]:
        """Make a session that is already running elsewhere live at once (e.g. after a gateway restart).

        It is not new work: it never queues, whatever the budget, and its priority is fixed from `now`.
        Returns its `Admitted` event.
        """
        return self._enter(session_id, now, predicted_peak_tokens, context_tokens, reservation_multiplier,
                           is_adopted=True)

    def _enter(self, session_id: str, now: float, predicted_peak_tokens: float, context_tokens: int,
               reservation_multiplier: float, is_adopted: bool) -> list[Event]:
        now = self._check_now(now)
        _check_session_id(session_id)
        if session_id in self._live or session_id in self._queue:
            raise DuplicateSessionError(f"session {session_id!r} arrived again while {self.state_of(session_id)}")
        peak = require_finite(f"predicted_peak_tokens of session {session_id!r}", predicted_peak_tokens, minimum=0)
        context = require_tokens(f"context_tokens of session {session_id!r}", context_tokens)
        multiplier = _check_multiplier(f"reservation_multiplier of session {session_id!r}", reservation_multiplier)
        entered = self._step(session_id, "adopt" if is_adopted else "arrive")
        was_engaged = self._engages_with(context)
        if entered == "queued" and not was_engaged:
            entered = transition(entered, "admit")
        self._advance(now)
        priority = priority_s(self.config.mode, now, peak, self.config.tokens_per_s)
        record = SessionRecord(session_id, self._next_seq, now, peak, priority, context, multiplier)
        self._next_seq += 1
        if not is_adopted:
            self._arrivals.record(now)
        if entered == "live":
            reservation = reservation_tokens(self.config.mode, record)
            self._make_live(record, reservation)
            return [Admitted(session_id, now, priority, 0.0, reservation)]
        self._queue.push(record)
        return self._admitted_events(now)

    def observe(self, session_id: str, now: float, context_tokens: int) -> list[Event]:
        """A call's prompt size was seen; return the admissions it caused, in order."""
        now = self._check_now(now)
        context = require_tokens(f"context_tokens of session {session_id!r}", context_tokens)
        record = self._record(session_id, "observe")
        self._advance(now)
        if session_id not in self._live:
            record.context_tokens = context
            return self._admitted_events(now)
        old_reservation = reservation_tokens(self.config.mode, record)
        if self._outgrows(record, context, old_reservation):
            regrown = record.regrowth_tokens(context)
            if self._engages_with(context - record.context_tokens) and not self._stays(record, regrown,
                                                                                         old_reservation):
                return self._requeue(record, now, context, regrown, old_reservation)
            record.regrown_tokens = regrown
        self._working_set_tokens += context - record.context_tokens
        self._reserved_tokens -= old_reservation
        record.context_tokens = context
        self._reserved_tokens += reservation_tokens(self.config.mode, record)
        return self._admitted_events(now)

    def _outgrows(self, record: SessionRecord, context: int, reservation: int) -> bool:
        """Does this call of a live session pass its reservation under the outgrowth rule?"""
        return self.config.mode == "basin" and not self.config.can_outgrow_reservation and context > reservation

    def _stays(self, record: SessionRecord, regrown: int, old_reservation: int) -> bool:
        """Would a live session re-reserving `regrown` be admitted now, were it at the door (the head not ahead)?"""
        head = self._queue.head()
        if head is not None and service_key(head.priority, head.seq) < service_key(record.priority, record.seq):
            return False
        return fits(self._reserved_tokens - old_reservation, regrown, self._budget.budget_tokens, len(self._live) - 1)

    def _requeue(self, record: SessionRecord, now: float, context: int, regrown: int,
                 old_reservation: int) -> list[Event]:
        """Take a live session whose call outgrew its reservation back to the queue (see the rules)."""
        head = self._queue.head()
        why = (f"it waits behind queued session {head.session_id!r}" if head is not None
               and service_key(head.priority, head.seq) < service_key(record.priority, record.seq) else
               f"which does not fit beside {self._reserved_tokens - old_reservation} reserved in a budget of "
               f"{self._budget.budget_tokens} while admission is engaged")
        self._step(record.session_id, "requeue")
        self._recovery.forget(record.session_id)
        del self._live[record.session_id]
        self._working_set_tokens -= record.context_tokens
        self._reserved_tokens -= old_reservation
        record.context_tokens = context
        record.regrown_tokens = regrown
        record.queued_s = now
        self._queue.push(record)
        events: list[Event] = [Requeued(
            record.session_id, now, record.priority, context, regrown, self._reserved_tokens,
            self._budget.budget_tokens,
            f"a call of {context} tokens outgrew its reservation of {old_reservation} tokens; re-reserved {regrown} "
            f"(its context + the predicted growth of {record.growth_tokens}), {why}")]
        events.extend(self._admitted_events(now))
        return events

    def revise(self, session_id: str, now: float, predicted_peak_tokens: float,
               reservation_multiplier: float = 1.0) -> list[Event]:
        """Replace a session's predicted peak (and multiplier) mid-session; return the admissions it caused.

        The priority stays as it was; see the revision rule at the top of this module.
        """
        now = self._check_now(now)
        peak = require_finite(f"predicted_peak_tokens of session {session_id!r}", predicted_peak_tokens, minimum=0)
        multiplier = _check_multiplier(f"reservation_multiplier of session {session_id!r}", reservation_multiplier)
        record = self._record(session_id, "revise")
        self._advance(now)
        is_live = session_id in self._live
        if is_live:
            self._reserved_tokens -= reservation_tokens(self.config.mode, record)
        record.predicted_peak_tokens = peak
        record.reservation_multiplier = multiplier
        record.peak_reservation_tokens = math.ceil(peak * multiplier)
        record.regrown_tokens = 0  # the new estimate replaces a re-reservation
        if is_live:
            self._reserved_tokens += reservation_tokens(self.config.mode, record)
        return self._admitted_events(now)

    def finish(self, session_id: str, now: float) -> list[Event]:
        """End a live session or withdraw a queued one; return the admissions it caused, in order."""
        now = self._check_now(now)
        record = self._record(session_id, "finish")
        self._step(session_id, "end")
        self._advance(now)
        if session_id in self._live:
            self._recovery.forget(session_id)
            del self._live[session_id]
            self._working_set_tokens -= record.context_tokens
            self._reserved_tokens -= reservation_tokens(self.config.mode, record)
        else:
            self._queue.remove(session_id)
        return self._admitted_events(now)

    def tick(self, now: float, hit_rate: float | None = None, ttft_s: float | None = None) -> list[Event]:
        """Let time pass: move the budget, admit, and shed at most one queued session.

        `ttft_s` is the engines' windowed time to first token now (None: no new evidence; the last one stands).
        """
        now = self._check_now(now)
        if hit_rate is not None:
            rate = require_finite("hit_rate", hit_rate)
            if not 0 <= rate <= 1:
                raise PolicyError(f"hit_rate must be in [0, 1], got {hit_rate!r}")
        if ttft_s is not None:
            require_finite("ttft_s", ttft_s, minimum=0)
            self._ttft_s = float(ttft_s)
        self._advance(now)
        events: list[Event] = []
        moved = self._budget.tick(now, hit_rate, has_queued=len(self._queue) > 0)
        if moved is not None:
            events.append(moved)
        events.extend(self._admitted_events(now))
        shed = self._maybe_shed(now)
        if shed is not None:
            events.append(shed)
        if self.config.recovery and self.config.mode == "basin":
            events.extend(self._recover(now, hit_rate))
        return events

    def _recover(self, now: float, hit_rate: float | None) -> list[Event]:
        """The recovery's turn on a tick (`recovery.py`): its holds, resumes and sheds as events, in that order."""
        rate = None if self._started_s is None else self._arrivals.rate_per_s(now, self._started_s)
        plan = self._recovery.step(now, hit_rate, tuple(self._live.values()), self._budget.budget_tokens, rate)
        events: list[Event] = []
        for sid in plan.hold:
            record = self._live[sid]
            events.append(Held(sid, now, record.priority, record.context_tokens, plan.reason))
        for sid in plan.resume:
            held_s = plan.held_s[sid]
            is_bounded = held_s >= self.config.recovery_max_hold_s
            reason = f"its hold ran out after {held_s:.0f} s" if is_bounded else plan.reason
            events.append(Resumed(sid, now, self._live[sid].priority, held_s, reason, is_bounded))
        for sid in plan.shed:
            events.append(self._shed_held(self._live[sid], now, rate, plan.held_s[sid]))
        if plan.shed:
            events.extend(self._admitted_events(now))
        return events

    def _shed_held(self, record: SessionRecord, now: float, rate: float | None, held_s: float) -> Shed:
        """Shed a live session whose bounded hold ran out while capacity is truly short (`recovery.py`)."""
        self._step(record.session_id, "shed")
        self._recovery.forget(record.session_id)
        del self._live[record.session_id]
        self._working_set_tokens -= record.context_tokens
        self._reserved_tokens -= reservation_tokens(self.config.mode, record)
        peak_rate = self.config.peak_completion_rate_per_s
        assert rate is not None and peak_rate is not None  # should_shed held
        return Shed(record.session_id, now, record.priority, held_s, rate, peak_rate, held_s,
                    f"held {held_s:.0f} s at its tool boundary (the bound {self.config.recovery_max_hold_s:.0f} s) "
                    f"while {shed_reason(rate, peak_rate, held_s)}")

    def set_reference_budget(self, budget_tokens: int, now: float | None = None) -> list[Event]:
        """Operator change of the reference budget B; never evicts, may admit if it grew.

        `now` defaults to the last `now` seen (0.0 in the events if none was seen yet; the policy's
        clock is then left unset).
        """
        checked = None if now is None else self._check_now(now)
        tokens = require_tokens("reference budget_tokens", budget_tokens)
        if tokens == 0:
            raise PolicyError("reference budget_tokens must be > 0, got 0")
        if checked is not None:
            self._advance(checked)
        when = 0.0 if self._now_s is None else self._now_s
        events: list[Event] = [self._budget.set_reference(when, tokens)]
        events.extend(self._admitted_events(when))
        return events

    # --- questions ---------------------------------------------------------------------------

    @property
    def is_engaged(self) -> bool:
        """True while arrivals go through the admission queue (an arrival's own context may engage it too)."""
        return self._engages_with(0)

    def _engages_with(self, arriving_context_tokens: int) -> bool:
        """Would an arrival with this context go through the admission queue?"""
        working_set = self._working_set_tokens + arriving_context_tokens
        return (
            self.config.always_engaged
            or len(self._queue) > 0
            or (working_set * self.config.reservation_ratio > self._budget.budget_tokens and self.is_pressed)
        )

    @property
    def reserved_tokens(self) -> int:
        """The live sessions' reservations, summed (O(1))."""
        return self._reserved_tokens

    @property
    def budget_tokens(self) -> int:
        """The budget admission uses now (O(1))."""
        return self._budget.budget_tokens

    @property
    def now_s(self) -> float | None:
        """The last `now` the policy saw (None before any)."""
        return self._now_s

    @property
    def is_pressed(self) -> bool:
        """True unless a latency gate is set and the engines' last reported first-token latency is under it."""
        gate = self.config.latency_gate_s
        return gate is None or (self._ttft_s is not None and self._ttft_s >= gate)

    def reservation_of(self, session_id: str) -> int:
        """What a live or queued session reserves (or will, once admitted); an unknown id raises."""
        return reservation_tokens(self.config.mode, self._record(session_id, "reservation_of"))

    def would_outgrow(self, session_id: str, context_tokens: int) -> bool:
        """Would a call of this context pass a live session's reservation under the outgrowth rule? No change."""
        record = self._live.get(session_id)
        return record is not None and self._outgrows(record, context_tokens, reservation_tokens(self.config.mode,
                                                                                               record))

    def priority_of(self, session_id: str) -> float:
        """The fixed priority of a live or queued session (smaller is served first)."""
        return self._record(session_id, "priority_of").priority

    def state_of(self, session_id: str) -> HeldState:
        """'live' or 'queued'; an unknown id raises `UnknownSessionError`."""
        self._record(session_id, "state_of")
        return "live" if session_id in self._live else "queued"

    def record_of(self, session_id: str) -> SessionRecord:
        """A copy of what the policy keeps about a live or queued session; an unknown id raises."""
        return dataclasses.replace(self._record(session_id, "record_of"))

    def live_ids(self) -> tuple[str, ...]:
        """The live sessions' ids, in admission order (O(live))."""
        return tuple(self._live)

    def records(self) -> list[SessionRecord]:
        """Copies of every held session's record, live and queued, in arrival order (O(n log n))."""
        held = [*self._live.values(), *self._queue.in_service_order()]
        return [dataclasses.replace(r) for r in sorted(held, key=lambda r: r.seq)]

    def is_live(self, session_id: str) -> bool:
        """True if the session is admitted and not finished (False for unknown ids)."""
        return session_id in self._live

    def is_held(self, session_id: str) -> bool:
        """True if the session is live and held at its tool boundary by recovery (False for unknown ids)."""
        return self._recovery.is_held(session_id)

    def held_ids(self) -> tuple[str, ...]:
        """The live sessions recovery holds, in the order they were held."""
        return self._recovery.held_ids()

    def plateau_hit_rate(self) -> float:
        """The hit-rate plateau recovery measures a collapse against (`recovery.py`)."""
        return self._recovery.plateau_hit_rate()

    def is_queued(self, session_id: str) -> bool:
        """True if the session waits in the admission queue (False for unknown ids)."""
        return session_id in self._queue

    def has_capacity(self, predicted_peak_tokens: float, context_tokens: int = 0,
                     reservation_multiplier: float = 1.0) -> bool:
        """Would a session with this peak (and context) be admitted if it arrived now? No change."""
        peak = require_finite("predicted_peak_tokens", predicted_peak_tokens, minimum=0)
        context = require_tokens("context_tokens", context_tokens)
        multiplier = _check_multiplier("reservation_multiplier", reservation_multiplier)
        if not self._engages_with(context):
            return True
        now = 0.0 if self._now_s is None else self._now_s
        priority = priority_s(self.config.mode, now, peak, self.config.tokens_per_s)
        candidate = SessionRecord("", self._next_seq, now, peak, priority, context, multiplier)
        head = self._queue.head()
        if head is not None and service_key(head.priority, head.seq) < service_key(priority, candidate.seq):
            return False
        needed = reservation_tokens(self.config.mode, candidate)
        return fits(self._reserved_tokens, needed, self._budget.budget_tokens, len(self._live))

    def snapshot(self) -> PolicySnapshot:
        """The whole observable state (O(n log n) in the queue length: not for the hot path)."""
        return PolicySnapshot(
            now_s=self._now_s,
            live=tuple(self._live),
            queued=tuple(r.session_id for r in self._queue.in_service_order()),
            reserved_tokens=self._reserved_tokens,
            working_set_tokens=self._working_set_tokens,
            budget_tokens=self._budget.budget_tokens,
            reference_budget_tokens=self._budget.reference_tokens,
            is_engaged=self.is_engaged,
        )

    def to_state(self) -> dict[str, Any]:
        """Everything that affects a decision, as JSON-ready plain types (see the rules on top)."""
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION, "config": dataclasses.asdict(self.config),
            "now_s": self._now_s, "started_s": self._started_s, "next_seq": self._next_seq,
            "ttft_s": self._ttft_s, "working_set_tokens": self._working_set_tokens,
            "reserved_tokens": self._reserved_tokens, "budget": self._budget.to_state(),
            "arrivals_s": self._arrivals.arrivals_s(),
            "live": [_record_row(r) for r in self._live.values()],
            "queued": [_record_row(r) for r in sorted(self._queue.in_service_order(), key=lambda r: r.seq)],
            "recovery": self._recovery.to_state(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Policy:
        """The policy `to_state` described; `PolicyError` naming the first field that is wrong."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise PolicyError(f"not a {STATE_FORMAT} record")
        if state.get("version") != STATE_VERSION:
            raise PolicyError(f"{STATE_FORMAT} version {state.get('version')!r} is not {STATE_VERSION}")
        config = state.get("config")
        if not isinstance(config, Mapping):
            raise PolicyError(f"state config must be a mapping, got {config!r}")
        try:
            policy = cls(PolicyConfig(**config))
        except TypeError as exc:
            raise PolicyError(f"state config: {exc}") from None
        policy._load(state)
        return policy

    # --- internals ---------------------------------------------------------------------------

    def _load(self, state: Mapping[str, Any]) -> None:
        self._now_s = _optional_time("now_s", state.get("now_s"))
        self._started_s = _optional_time("started_s", state.get("started_s"))
        self._next_seq = require_tokens("state next_seq", state.get("next_seq"))
        ttft = state.get("ttft_s")
        self._ttft_s = None if ttft is None else require_finite("state ttft_s", ttft, minimum=0)
        budget = state.get("budget")
        if not isinstance(budget, Mapping):
            raise PolicyError(f"state budget must be a mapping, got {budget!r}")
        self._budget.load_state(budget)
        arrivals = state.get("arrivals_s")
        if not isinstance(arrivals, list):
            raise PolicyError(f"state arrivals_s must be a list, got {arrivals!r}")
        self._arrivals.load([require_finite("state arrivals_s[]", t) for t in arrivals])
        for key, is_live in (("live", True), ("queued", False)):
            rows = state.get(key)
            if not isinstance(rows, list):
                raise PolicyError(f"state {key} must be a list, got {rows!r}")
            for row in rows:
                record = _record_of(key, row, self._next_seq)
                if record.session_id in self._live or record.session_id in self._queue:
                    raise PolicyError(f"state {key}: session {record.session_id!r} is held twice")
                if is_live:
                    self._make_live(record, reservation_tokens(self.config.mode, record))
                else:
                    self._queue.push(record)
        recovery = state.get("recovery")  # absent: a state from before recovery, nobody held
        if recovery is not None:
            if not isinstance(recovery, Mapping):
                raise PolicyError(f"state recovery must be a mapping, got {recovery!r}")
            self._recovery.load_state(recovery, tuple(self._live))
        sums = (("working_set_tokens", self._working_set_tokens), ("reserved_tokens", self._reserved_tokens))
        for key, value in sums:
            if state.get(key) != value:
                raise PolicyError(f"state {key} is {state.get(key)!r} but its live sessions sum to {value}")


    def _check_now(self, now: float) -> float:
        value = require_finite("now", now)
        if self._now_s is not None and value < self._now_s:
            raise ClockError(f"now={now!r} runs backwards: the last now seen was {self._now_s!r}")
        return value

    def _advance(self, now: float) -> None:
        if self._started_s is None:
            self._started_s = now
        self._now_s = now

    def _record(self, session_id: str, step: str) -> SessionRecord:
        record = self._live.get(session_id) or self._queue.get(session_id)
        if record is None:
            raise UnknownSessionError(
                f"{step}: session {session_id!r} is neither live nor queued "
                "(never arrived, already finished, withdrawn or shed)"
            )
        return record

    def _step(self, session_id: str, event: LifecycleEvent) -> SessionState:
        """The state `event` takes the session to (`lifecycle.py`; unknown here: arriving); changes nothing."""
        state: SessionState = ("live" if session_id in self._live else "queued" if session_id in self._queue
                               else "arriving")
        return transition(state, event)

    def _make_live(self, record: SessionRecord, reservation: int) -> None:
        record.has_run = True
        self._live[record.session_id] = record
        self._working_set_tokens += record.context_tokens
        self._reserved_tokens += reservation

    def _drain(self) -> list[tuple[SessionRecord, int, bool]]:
        """Admit queue heads while they fit; return (record, reservation, had run) in admission order."""
        admitted: list[tuple[SessionRecord, int, bool]] = []
        while (head := self._queue.head()) is not None:
            needed = reservation_tokens(self.config.mode, head)
            if not fits(self._reserved_tokens, needed, self._budget.budget_tokens, len(self._live)):
                break
            self._step(head.session_id, "admit")
            self._queue.remove(head.session_id)
            had_run = head.has_run
            self._make_live(head, needed)
            admitted.append((head, needed, had_run))
        return admitted

    def _admitted_events(self, now: float) -> list[Event]:
        events: list[Event] = []
        for record, reservation, is_resumed in self._drain():
            events.append(Admitted(record.session_id, now, record.priority, now - record.queued_s, reservation,
                                   is_resumed=is_resumed))
        return events

    def _maybe_shed(self, now: float) -> Shed | None:
        head = self._queue.head()
        peak_rate = self.config.peak_completion_rate_per_s
        if head is None or peak_rate is None or self._started_s is None:
            return None
        rate = self._arrivals.rate_per_s(now, self._started_s)
        head_waited_s = now - head.queued_s
        if rate is None or not should_shed(rate, peak_rate, head_waited_s, self.config.shed_wait_s):
            return None
        victim = self._queue.shed_candidate()
        if victim is None:  # only sessions held for an outgrown call wait: they are not shed
            return None
        self._step(victim.session_id, "shed")
        self._queue.remove(victim.session_id)
        return Shed(
            session_id=victim.session_id,
            now_s=now,
            priority=victim.priority,
            waited_s=now - victim.queued_s,
            arrival_rate_per_s=rate,
            peak_completion_rate_per_s=peak_rate,
            head_waited_s=head_waited_s,
            reason=shed_reason(rate, peak_rate, head_waited_s),
        )


def _record_row(record: SessionRecord) -> list[Any]:
    return [record.session_id, record.seq, record.arrival_s, record.predicted_peak_tokens, record.priority,
            record.context_tokens, record.reservation_multiplier, record.first_context_tokens,
            record.regrown_tokens, record.queued_s, record.has_run]


def _record_of(key: str, row: object, next_seq: int) -> SessionRecord:
    """A session record from its `to_state` row; `PolicyError` naming what is wrong."""
    if not isinstance(row, list) or len(row) != 11:
        raise PolicyError(f"state {key}: a session must be [id, seq, arrival_s, peak, priority, context, "
                          f"multiplier, first context, regrown, queued_s, has run], got {row!r}")
    session_id, seq, arrival, peak, priority, context, multiplier, first, regrown, queued, has_run = row
    _check_session_id(session_id)
    what = f"state {key} session {session_id!r}"
    number = require_tokens(f"{what} seq", seq)
    if number >= next_seq:
        raise PolicyError(f"{what}: seq {number} is not below next_seq {next_seq}")
    if not isinstance(has_run, bool) or (key == "live" and not has_run):
        raise PolicyError(f"{what}: has_run must be a bool (true for a live session), got {has_run!r}")
    return SessionRecord(session_id, number, require_finite(f"{what} arrival_s", arrival),
                         require_finite(f"{what} peak", peak, minimum=0), require_finite(f"{what} priority", priority),
                         require_tokens(f"{what} context", context),
                         _check_multiplier(f"{what} multiplier", multiplier),
                         first_context_tokens=require_tokens(f"{what} first context", first),
                         regrown_tokens=require_tokens(f"{what} regrown", regrown),
                         queued_s=require_finite(f"{what} queued_s", queued), has_run=has_run)


def _optional_time(key: str, value: Any) -> float | None:
    return None if value is None else require_finite(f"state {key}", value)


def _check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise PolicyError(f"session_id must be a non-empty string, got {session_id!r}")


def _check_multiplier(what: str, value: float) -> float:
    multiplier = require_finite(what, value)
    if multiplier <= 0:
        raise PolicyError(f"{what} must be > 0, got {value!r}")
    return multiplier

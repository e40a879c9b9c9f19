"""`basin` and `basin-proto`: the Basin gateway's policy core (`basin_runtime.policy.Policy`) driven by the engine.

Rules:
- Every engine event goes to the policy core unchanged: arrival -> `arrive`, each call's prompt
  -> `observe`, any end but a shed (finished, killed, aborted, abandoned, withdrawn while held) ->
  `finish`, tick -> `tick` with the windowed hit rate and first-token latency. Every step's events
  become `Decisions` through one translation (`decisions_of`), in the core's order: `Admitted` ->
  admit, `Shed` -> shed, and the outgrowth rule's pair (as the gateway holds the call): `Requeued` ->
  suspend (the call that outgrew its reservation is parked at the door), `Admitted` with `is_resumed`
  -> resume (it is sent then).
- Recovery (`PolicyConfig.recovery`, basin mode; the core's `recovery.py`): `Held` -> suspend with close
  (its next call is parked at its tool boundary and, with the session radix cache, its engine session is
  closed then, so its KV is evictable while it waits), `Resumed` -> resume, a `Shed` of a held (live)
  session -> shed (it ends at once). A held session whose parked call outgrows its reservation is
  requeued by the core: it is parked already, so no second suspend; its `Admitted` with `is_resumed`
  resumes it. Report (`RecoveryReport`): holds, sessions ever held, resumes (of which by the bound), sheds
  after a hold, the time held (total, mean per hold ended); only with recovery on in basin mode.
- `basin`: the predicted peak of a session is looked up from `PolicyContext.predicted_peak_tokens`
  (the pool batch-predicted once from task text and first prompt size); it reserves m(q) x that
  (`PolicyContext.reservation_multipliers`, the predictor file's multiplier for the session's
  benchmark, as the gateway reserves) x `reservation_scale`; its priority is the bare prediction's.
  A session with no prediction (or, with multipliers, none for it) is an error, never a default.
- Revisions: at call k of a session with a re-estimate for k (`PolicyContext.revisions`, made from
  the pool once, as the gateway's online model makes them), `Policy.revise` with that peak and
  `reservation_scale` x m_k(q), right after the call's `observe`. The call index is found from the
  session's own call list (the first call at or after the last one seen with this prompt size), so
  a retried call is not counted twice.
- Memory of finished tasks (`PolicyContext.task_memory`, `basin` only): the peak told at arrival is
  the prediction shrunk toward the run's own finished peaks of the same task (policies/task_memory.py,
  which follows every call and end to build the memory); reservation and priority follow it.
- Reservation report: sessions admitted, and of those how many outgrew their first reservation
  (a call's prompt above ceil(m x peak)), for `run_summary`.
- `basin-proto` (mode "prototype"): arrival order, admission by current context; no predictor.
- The policy core's configuration is built exactly as the gateway builds it:
  `basin_runtime.policy.calibrated.policy_config` over the operator's calibration (the gateway's
  calibration file) and overrides, so budget, its ceiling at the completion peak, plateau hit rate
  and shedding rate are the served ones. With no calibration, the knee is taken as the cache
  capacity (B = 0.9 x capacity). Shedding only with a measured peak completion rate. The latency
  gate (beyond the paper) only with `PolicyContext.latency_gate`, as the gateway's `--latency-gate`.
- Request priority = the core's fixed session priority (smaller first), for prefill and decode.
- Lending is the deployment's switch (`Deployment.lending`, kv_tiers.py), not the policy's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from basin_runtime.policy import (
    Admitted,
    BudgetMoved,
    Event,
    Held,
    Policy,
    PolicyConfig,
    PolicyMode,
    Requeued,
    Resumed,
    Shed,
)
from basin_runtime.policy.calibrated import Calibration, policy_config, uncalibrated
from basin_runtime.session_table import Session
from basin_runtime.task_memory import Shrinkage
from basin_sim.policies.base import (
    NO_DECISIONS,
    Decisions,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
    RecoveryReport,
    ReservationReport,
)
from basin_sim.policies.task_memory import RunTaskMemory


class MissingPredictionError(KeyError):
    """`basin` was handed a session the pool predictions do not cover."""


def served_calibration(context: PolicyContext) -> Calibration:
    """The operator's calibration, or, with none, `uncalibrated`: the knee taken as the cache capacity."""
    if context.calibration is not None:
        return context.calibration
    deployment = context.deployment
    return uncalibrated(float(deployment.cache_capacity_tokens))


def config_for(context: PolicyContext, mode: PolicyMode) -> PolicyConfig:
    """The policy core's configuration: `policy_config` as the gateway calls it, in this mode."""
    return policy_config(served_calibration(context), {**context.policy_overrides, "mode": mode},
                         latency_gate=context.latency_gate)


class BasinPolicy:
    """The engine's seam around one `basin_runtime.policy.Policy`."""

    def __init__(self, name: str, core: Policy, predicted_peak_tokens: dict[str, float] | None,
                 reservation_scale: float = 1.0, reservation_multipliers: Mapping[str, float] | None = None,
                 revisions: Mapping[str, Mapping[int, tuple[float, float]]] | None = None,
                 task_memory: Shrinkage | None = None) -> None:
        self.name = name
        self.core = core
        self.pins: PinRule | None = None
        self._peaks = predicted_peak_tokens
        self._scale = reservation_scale
        self._multipliers = dict(reservation_multipliers or {})
        self._first_reservation: dict[str, int] = {}  # session -> ceil(m x peak) (basin) while held
        self.sessions_admitted = 0
        self.sessions_overflowed = 0  # admitted sessions with a call's prompt above their first reservation
        self._overflowed: set[str] = set()
        self._revisions = revisions or {}
        # arrival -> (its pool session, its calls' prompt sizes), for sessions with revisions
        self._calls: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._call_index: dict[str, int] = {}  # session -> index of the last call seen
        self.sessions_revised = 0
        self._held: set[str] = set()  # sessions the core holds (recovery), suspended in the engine
        self._ever_held: set[str] = set()
        self._held_since: dict[str, float] = {}
        self._holds = self._resumes = self._resumes_bounded = self._sheds_after_hold = self._holds_ended = 0
        self._hold_time_s = 0.0
        self._memory = None if task_memory is None or predicted_peak_tokens is None else RunTaskMemory(task_memory)

    def predicted_peak(self, session: Session) -> float:
        """The predicted peak of a session (its context at arrival for the prototype)."""
        if self._peaks is None:
            return float(session.first_prompt_tokens)
        peak = self._peaks.get(session.session_id)
        if peak is None:
            raise MissingPredictionError(f"policy {self.name!r}: no predicted peak for pool session "
                                         f"{session.session_id!r}")
        return peak

    def reservation_multiplier(self, session: Session) -> float:
        """`reservation_scale` x m(q) of the session (1 for the prototype or without multipliers)."""
        if self._peaks is None:
            return 1.0
        if not self._multipliers:
            return self._scale
        m = self._multipliers.get(session.session_id)
        if m is None:
            raise MissingPredictionError(f"policy {self.name!r}: no reservation multiplier for pool session "
                                         f"{session.session_id!r}")
        return self._scale * m

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """`Policy.arrive` with the predicted peak, its multiplier and the first prompt's size."""
        peak, multiplier = self.predicted_peak(session), self.reservation_multiplier(session)
        if self._memory is not None:
            peak = self._memory.told_peak(session_id, now, session, peak)
        if self._peaks is not None:
            self._first_reservation[session_id] = math.ceil(peak * multiplier)
        if self._revisions.get(session.session_id):  # keyed by the pool session (an arrival is a draw of one)
            self._calls[session_id] = (session.session_id, tuple(c.prompt_tokens for c in session.calls))
        return self._decided(self.core.arrive(session_id, now, peak, session.first_prompt_tokens, multiplier))

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """`Policy.observe`."""
        first = self._first_reservation.get(session_id)
        if first is not None and prompt_tokens > first and session_id not in self._overflowed:
            self._overflowed.add(session_id)
            self.sessions_overflowed += 1
        if self._memory is not None:
            self._memory.on_call(session_id, prompt_tokens)
        decisions = self._decided(self.core.observe(session_id, now, prompt_tokens))
        revision = self._revision_at(session_id, prompt_tokens)
        if revision is None:
            return decisions
        peak, multiplier = revision
        self.sessions_revised += 1
        more = self._decided(self.core.revise(session_id, now, peak, self._scale * multiplier))
        if more is NO_DECISIONS:
            return decisions
        return Decisions(decisions.admit + more.admit, decisions.shed + more.shed, decisions.suspend + more.suspend,
                         decisions.resume + more.resume)

    def _revision_at(self, session_id: str, prompt_tokens: int) -> tuple[float, float] | None:
        drawn = self._calls.get(session_id)
        if drawn is None:
            return None
        pool_id, calls = drawn
        last = self._call_index.get(session_id, -1)
        start = max(last, 0)
        index = next((j for j in range(start, len(calls)) if calls[j] == prompt_tokens), None)
        if index is None or index == last:
            return None  # an unknown prompt, or the same call again (a retry)
        self._call_index[session_id] = index
        return self._revisions[pool_id].get(index + 1)

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """`Policy.finish` (ends a live session or withdraws a queued one)."""
        self._first_reservation.pop(session_id, None)
        self._overflowed.discard(session_id)
        self._calls.pop(session_id, None)
        self._call_index.pop(session_id, None)
        if session_id in self._held:
            self._held.discard(session_id)
            self._holds_ended += 1
            self._hold_time_s += now - self._held_since.pop(session_id)
        if self._memory is not None:
            self._memory.on_end(session_id, now)
        return self._decided(self.core.finish(session_id, now))

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """`Policy.tick`."""
        return self._decided(self.core.tick(now, hit_rate, ttft_s))

    def report(self) -> PolicyReport:
        """Sessions admitted so far, how many of them outgrew their first reservation, revisions applied; the
        recovery's holds (recovery on, basin mode)."""
        config = self.core.config
        recovery = None
        if config.recovery and config.mode == "basin":
            mean = self._hold_time_s / self._holds_ended if self._holds_ended else None
            recovery = RecoveryReport(self._holds, len(self._ever_held), self._resumes, self._resumes_bounded,
                                      self._sheds_after_hold, self._hold_time_s, mean)
        return PolicyReport(reservations=ReservationReport(self.sessions_admitted, self.sessions_overflowed,
                                                           self.sessions_revised), recovery=recovery,
                            task_memory=None if self._memory is None else self._memory.report())

    def _decided(self, events: list[Event]) -> Decisions:
        held_before = frozenset(self._held)
        self._count_holds(events)
        decisions = decisions_of(events, held_before)
        self.sessions_admitted += len(decisions.admit)
        return decisions

    def _count_holds(self, events: list[Event]) -> None:
        """The recovery's counts, from one step's events (before `decisions_of` reads the held set)."""
        for event in events:
            sid = event.session_id if not isinstance(event, BudgetMoved) else ""
            if isinstance(event, Held):
                self._holds += 1
                self._ever_held.add(sid)
                self._held_since[sid] = event.now_s
                self._held.add(sid)
            elif sid in self._held and isinstance(event, (Resumed, Shed, Requeued)):
                self._holds_ended += 1
                self._hold_time_s += event.now_s - self._held_since.pop(sid)
                self._resumes += isinstance(event, Resumed)
                self._resumes_bounded += isinstance(event, Resumed) and event.is_bounded
                self._sheds_after_hold += isinstance(event, Shed)
                self._held.discard(sid)

    def priority(self, session_id: str, now: float) -> float:
        """The session's fixed priority from the core."""
        return self.core.priority_of(session_id)


def decisions_of(events: list[Event], held: frozenset[str] | set[str] = frozenset()) -> Decisions:
    """The engine's decisions from one step's events, in order (`held`: the sessions suspended by a recovery hold
    before these events, whose requeue needs no second suspend)."""
    if not events:
        return NO_DECISIONS
    admit = tuple(e.session_id for e in events if isinstance(e, Admitted) and not e.is_resumed)
    shed = tuple(e.session_id for e in events if isinstance(e, Shed))
    suspend = tuple(e.session_id for e in events
                    if isinstance(e, Held) or (isinstance(e, Requeued) and e.session_id not in held))
    resume = tuple(e.session_id for e in events if (isinstance(e, Admitted) and e.is_resumed)
                   or isinstance(e, Resumed))
    close = tuple(e.session_id for e in events if isinstance(e, Held))
    if not (admit or shed or suspend or resume):
        return NO_DECISIONS
    return Decisions(admit, shed, suspend, resume, close)


def _basin(context: PolicyContext) -> BasinPolicy:
    if not context.predicted_peak_tokens:
        raise MissingPredictionError("policy 'basin' needs predicted peaks (PolicyContext.predicted_peak_tokens); "
                                     "load them with basin_sim.experiments.predictions.predict_pool")
    return BasinPolicy("basin", Policy(config_for(context, "basin")), dict(context.predicted_peak_tokens),
                       context.reservation_scale, context.reservation_multipliers, context.revisions,
                       context.task_memory)


def _basin_proto(context: PolicyContext) -> BasinPolicy:
    return BasinPolicy("basin-proto", Policy(config_for(context, "prototype")), None)


BASIN = PolicySpec("basin", "Basin: predicted-peak admission, size-aware priority, adaptive budget, shedding "
                   "(basin_runtime.policy)", False, _basin)
BASIN_PROTO = PolicySpec("basin-proto", "Basin hardware prototype: arrival order, admission by current context, "
                         "shedding (basin_runtime.policy, mode prototype)", False, _basin_proto)

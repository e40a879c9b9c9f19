"""The asynchronous waiting room around the policy core (through a `StateBackend`).

Rules:
- Every policy step goes through the state backend (`basin_runtime/state/`), with `now` read from the
  injected clock when the step is made; the room hears of every step applied through one listener, in
  order, and that listener is the one translation of policy events into gateway state. In process
  (the default) a step applies at once, inside the room's own bookkeeping;
  no bookkeeping section awaits between reading and writing the registry.
- The registry holds the sessions this gateway serves: exactly the sessions the policy holds without
  a shared backend; with one (`--state`), the held sessions this replica owns (`replica.py`).
- A session's first call that the policy queues waits on the session's `decision` future, which
  is resolved once: "admitted" (by any event that admits it, whichever replica's step caused it), a
  `Shed`, or "ended" (ended by the admin endpoint while queued). Later calls wait on the same future.
- A later call that outgrows its session's reservation while admission is engaged (the core's
  outgrowth rule: `Requeued`) puts the session back in the queue with a new `decision` future: the
  call waits on it like a first call (`is_held_for_growth`, adopted sessions too). Such a call's
  `observe` is awaited through the backend (not just submitted), so with a shared backend the
  call is held before it is forwarded.
- When the last waiter of a queued session leaves (client gone or task cancelled), the session is
  withdrawn (`finish`). Adopted sessions (`restart.py`: live before a restart) never wait at their
  adoption, even if the policy queues them, but a call held for outgrowing its reservation waits; if
  the policy sheds one, it is forgotten and its next call arrives anew.
- Draining (a graceful shutdown has begun): nothing new is admitted. Every queued session's waiting
  calls get "shutdown" (503) at once, and a session arriving while draining is refused the same way.
  In process the queued sessions are withdrawn; with a shared backend they keep their place (their
  clients reconnect to another replica), and at shutdown `hand_over` lets every session go (`reap`).
- Recovery (`recovery_holds.py`): `Held` holds a live session's next call before it is forwarded until
  `Resumed`; a held session shed, ended or drained ends its hold with that verdict (`wait_held`).
- Timers: `tick` every `tick_interval_s` (hit rate and first-token latency from its signals;
  with a shared backend only the leader ticks, with the deployment's signals), and an idle sweep of
  this room's sessions (their calls in flight are known here only).
- Engine priority levels rank every session the policy holds (`registry.levels`), fed by the listener:
  with a shared backend, two replicas give a session the same level.
- Shared backend only: a step another replica made may end (`finish`) or take over (`claim`) a session
  held here, which then leaves this room (`ended` / `moved`); after the shared state was rebuilt or
  this replica's sessions were let go (`reap`: its lease had lapsed), `reconcile` puts each session
  held here back (adopt, claim, or arrive anew if the store lost it).
- The room is built whole: its signals (`RoomSignals`: hit rate, first-token latency) and its listener
  (`RoomListener`) come in its constructor and are never replaced. The listener's `session_ended(entry,
  reason)` is told of every session that leaves, and its `session_admitted(entry, waited_s)` of every
  session admitted here (at arrival with 0 s): the seams for the session log, metrics and lending.
- Nothing here imports a web framework: a waiting call brings the ASGI `receive` its edge handed down
  (`basin_runtime/disconnect.py`), whose next message is the client's disconnect.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from basin_runtime.clock import Clock
from basin_runtime.disconnect import Receive, race_client
from basin_runtime.gateway import recovery_holds
from basin_runtime.gateway.errors import (
    ClientGoneError,
    SessionEndedError,
    SessionNotFoundError,
    SessionShedError,
    ShuttingDownError,
)
from basin_runtime.gateway.measure import FirstCall, PromptMemo
from basin_runtime.gateway.priority import PriorityLevels, routing_key
from basin_runtime.gateway.sessions import SessionEntry, SessionRegistry, Verdict
from basin_runtime.policy import Admitted, BudgetMoved, Event, Held, Policy, PolicyError, Requeued, Resumed, Shed
from basin_runtime.policy.lifecycle import held_transition
from basin_runtime.state.backend import InProcessBackend, StateBackend, StateUnavailableError
from basin_runtime.state.replica import Applied
from basin_runtime.state.steps import Step, StepKind


@dataclass(frozen=True)
class Ended:
    """A session ended on a client's or the operator's word: what it was and its calls (None: it was held by
    another replica, or let go by a dead one, which served them)."""

    session_id: str
    was: str
    calls: int | None

logger = logging.getLogger(__name__)

EndReason = Literal["ended", "idle", "withdrawn", "shed", "failed", "shutdown", "moved"]


class RoomSignals(Protocol):
    """What the room ticks the policy with: the windowed hit rate and first-token latency (None: no evidence)."""

    def hit_rate(self) -> float | None:
        """The prefix hit rate now."""
        ...

    def ttft_s(self) -> float | None:
        """The median time to first token now."""
        ...


class RoomListener(Protocol):
    """Who hears of the room's sessions: every admission here and every session that leaves."""

    def session_admitted(self, entry: SessionEntry, waited_s: float) -> None:
        """A session was admitted here after `waited_s` in the queue."""
        ...

    def session_ended(self, entry: SessionEntry, reason: EndReason) -> None:
        """A session left the room."""
        ...

    def session_held(self, entry: SessionEntry) -> None:
        """Recovery holds a live session here at its tool boundary."""
        ...

    def session_resumed(self, entry: SessionEntry, held_s: float) -> None:
        """Recovery resumed a session held here for `held_s`."""
        ...


class NoSignals:
    """Signals with no evidence (a room ticked without a hit rate or latency)."""

    def hit_rate(self) -> float | None:
        """None: no evidence."""
        return None

    def ttft_s(self) -> float | None:
        """None: no evidence."""
        return None


class WaitingRoom:
    """Admits, queues, withdraws, sheds and ends sessions by driving the policy through a state backend."""

    def __init__(self, policy: Policy | None, clock: Clock, *, retry_after_s: float,
                 signals: RoomSignals | None = None, listener: RoomListener | None = None,
                 levels: PriorityLevels | None = None, backend: StateBackend | None = None) -> None:
        if backend is None:
            if policy is None:
                raise ValueError("a waiting room needs a policy or a state backend")
            backend = InProcessBackend(policy)
        self.backend = backend
        self.clock = clock
        self.registry = SessionRegistry(levels)
        self._retry_after_s = retry_after_s
        self.retry_after_s = retry_after_s  # what a shed or shutting-down answer's Retry-After says
        self._signals: RoomSignals = signals or NoSignals()
        self._listener = listener
        self.is_draining = False
        backend.bind(self._on_applied, self.reconcile)

    @property
    def policy(self) -> Policy:
        """The policy core (this replica's copy of it with a shared backend)."""
        return self.backend.policy

    async def arrive(self, session_id: str, first: FirstCall, predicted_peak_tokens: float, *,
                     workload: str | None, memo: PromptMemo, is_adopted: bool = False,
                     is_single_call: bool = False, model: str | None = None,
                     reservation_multiplier: float = 1.0,
                     context_tokens: int | None = None) -> tuple[SessionEntry, bool]:
        """Register a new session with the policy; (entry, True), or (existing entry, False) if one won a race.
        `context_tokens` is what it enters with (default: the first call's prompt; an adopted session: its context
        before the restart)."""
        existing = self.registry.get(session_id)
        if existing is not None:
            return existing, False
        self._refuse_if_draining()
        now = self.clock.now()
        entry = self._entry(session_id, now, predicted_peak_tokens, first.task_text, workload, memo, is_adopted,
                            is_single_call, model, reservation_multiplier)
        context = first.prompt_tokens if context_tokens is None else context_tokens
        entry.context_tokens = context
        step = Step("adopt" if is_adopted else "arrive", session_id, (predicted_peak_tokens, context,
                                                                     reservation_multiplier), now)
        await self._step_for(entry, step)
        return entry, True

    async def take_over(self, session_id: str, first: FirstCall, *, workload: str | None, memo: PromptMemo,
                        model: str | None = None) -> SessionEntry | None:
        """Shared state only: continue here a session another replica holds (`claim`: live or in its place in
        the queue) or let go (an orphan: adopted, never queued). None if the shared state has no such session."""
        state = self.backend.replicated
        if state is None or self.registry.get(session_id) is not None:
            return self.registry.get(session_id)
        now = self.clock.now()
        orphan = state.orphans.get(session_id)
        if state.is_held(session_id):
            record = self.policy.record_of(session_id)
            peak, multiplier, step = (record.predicted_peak_tokens, record.reservation_multiplier,
                                      Step("claim", session_id, (), now))
        elif orphan is not None:
            peak, multiplier = orphan.predicted_peak_tokens, orphan.reservation_multiplier
            # the context it had: the call that takes it over is then observed (the outgrowth rule holds it if it
            # brings more than its reservation and does not fit)
            step = Step("adopt", session_id, (peak, min(orphan.context_tokens, first.prompt_tokens), multiplier), now)
        else:
            return None
        self._refuse_if_draining()
        is_live = step.kind == "adopt" or self.policy.is_live(session_id)
        entry = self._entry(session_id, now, peak, first.task_text, workload, memo, is_live, False, model, multiplier)
        entry.context_tokens = first.prompt_tokens
        try:
            await self._step_for(entry, step)
        except PolicyError as exc:  # it ended, or another replica took it first: a session of its own then
            logger.info("session %s could not be taken over (%s); it starts anew", session_id, exc)
            return None
        if self.registry.get(session_id) is not entry:
            return None  # ended elsewhere the moment it was taken over
        if step.kind == "claim":
            entry.priority_s = self.policy.priority_of(session_id)
            if self.policy.is_live(session_id):
                self._set_live(entry, now)
        logger.info("session %s taken over here (%s)", session_id, "claimed" if step.kind == "claim" else "orphan")
        return entry

    async def observe(self, entry: SessionEntry, prompt_tokens: int,
                      revision: tuple[float, float] | None = None) -> bool:
        """Tell the policy a call's prompt size, and with `revision` (re-estimated peak, multiplier) revise
        the session's reservation right after; False if the session is no longer held."""
        if self.registry.get(entry.session_id) is not entry:
            return False
        now = self.clock.now()
        entry.last_active_s = now
        entry.context_tokens = prompt_tokens
        step = Step("observe", entry.session_id, (prompt_tokens,), now)
        if self.policy.would_outgrow(entry.session_id, prompt_tokens):
            await self.backend.step(step)  # it may hold the call: the decision must be in before it goes on
            if self.registry.get(entry.session_id) is not entry:
                return False
        else:
            self.backend.submit(step)
        if revision is not None:
            peak, multiplier = revision
            self.backend.submit(Step("revise", entry.session_id, (peak, multiplier), now))
            entry.revised_peak_tokens, entry.reservation_multiplier = peak, multiplier
        return True

    async def wait(self, entry: SessionEntry, receive: Receive) -> None:
        """Hold a call until its session is admitted; raise if it is shed or ended, or the client leaves."""
        entry.waiters += 1
        try:
            verdict = await race_client(asyncio.shield(entry.decision), receive, ClientGoneError)
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.decision.done():
                await self.release(entry.session_id, "withdrawn")
        self._raise_unless_admitted(entry, verdict)

    async def wait_held(self, entry: SessionEntry, receive: Receive) -> None:
        """Hold a call of a session recovery holds until it is resumed; raise if it is shed or ended meanwhile."""
        self._raise_unless_admitted(entry, await recovery_holds.wait_held(entry, receive))

    async def end(self, session_id: str, reason: EndReason = "ended") -> Ended:
        """End a live session or withdraw a queued one; `SessionNotFoundError` if it is not held.

        Shared state: a session another replica holds is ended there by this replica's `finish` step (its
        holder logs it, "ended through replica ..."), and an orphan (its replica died) is adopted and
        finished at once, so it is forgotten and not adopted again: a client may end its session through
        any replica, as a load balancer sends it."""
        entry = await self.release(session_id, reason)
        if entry is not None:
            return Ended(session_id, entry.state, len(entry.calls))
        state = self.backend.replicated
        if state is not None:
            now = self.clock.now()
            if state.is_held(session_id):
                was = "live" if self.policy.is_live(session_id) else "queued"
                await self._shared_finish(Step("finish", session_id, (), now))
                logger.info("session %s %s through this replica (held by %s)", session_id, reason,
                            state.owner_of(session_id) or "nobody")
                return Ended(session_id, was, None)
            orphan = state.orphans.get(session_id)
            if orphan is not None:
                await self._shared_finish(Step("adopt", session_id, (orphan.predicted_peak_tokens,
                                                                     orphan.context_tokens,
                                                                     orphan.reservation_multiplier), now))
                await self._shared_finish(Step("finish", session_id, (), now))
                logger.info("session %s %s through this replica (an orphan: its replica died)", session_id, reason)
                return Ended(session_id, "orphan", None)
        raise SessionNotFoundError(f"no live or queued session {session_id!r}")

    async def drain(self) -> list[SessionEntry]:
        """Stop admitting: every queued session's calls get 503 (withdrawn in process); return them."""
        self.is_draining = True
        queued = [e for e in self.registry if e.state == "queued"]
        now = self.clock.now()
        for entry in queued:
            self.registry.remove(entry.session_id)
            if not self.backend.is_shared:  # shared: it keeps its place for its client's next replica
                await self.backend.step(Step("finish", entry.session_id, (), now))
            if not entry.decision.done():
                entry.decision.set_result("shutdown")
        reason: EndReason = "moved" if self.backend.is_shared else "withdrawn"
        for entry in queued:
            logger.info("session %s %s: the gateway is shutting down", entry.session_id, reason)
            self._notify_end(entry, reason)
        return queued

    async def hand_over(self, orphan_window_s: float) -> None:
        """Shared state only, at shutdown: let every session this replica holds go (live ones become orphans any
        replica adopts, queued ones keep their place), as the leader would once this replica's lease lapsed."""
        if self.backend.is_shared:
            dead = [self.backend.replica_id]
            try:
                await self.backend.step(Step("reap", None, (dead, orphan_window_s), self.clock.now()))
            except StateUnavailableError as exc:
                logger.warning("could not hand the sessions over (%s); the leader lets them go once the lease "
                               "lapses", exc.reason)

    async def tick(self) -> list[Event]:
        """Let the policy move the budget, admit and shed; the events (nothing while draining, nor off the leader)."""
        if self.is_draining or not self.backend.is_leader:
            return []
        try:
            signals = self._signals
            return await self.backend.step(Step("tick", None, (signals.hit_rate(), signals.ttft_s()), self.clock.now()))
        except StateUnavailableError:
            return []

    async def set_budget(self, budget_tokens: int) -> list[Event]:
        """Set the operator's reference budget; `PolicyError` if the value is not allowed."""
        return await self.backend.step(Step("set_reference_budget", None, (budget_tokens,), self.clock.now()))

    async def sweep_idle(self, idle_timeout_s: float) -> list[str]:
        """End every session idle for `idle_timeout_s`; return their ids."""
        ids = self.registry.idle_ids(self.clock.now(), idle_timeout_s)
        for session_id in ids:
            await self.release(session_id, "idle")
        return ids

    async def run_timers(self, tick_interval_s: float, idle_timeout_s: float) -> None:
        """Run the tick and idle timers until cancelled."""
        idle_every_s = max(0.05, min(idle_timeout_s / 4, 10.0))
        async with asyncio.TaskGroup() as group:
            group.create_task(self.every(tick_interval_s, self.tick))
            group.create_task(self.every(idle_every_s, lambda: self.sweep_idle(idle_timeout_s)))

    async def every(self, interval_s: float, step: Callable[[], Awaitable[object]]) -> None:
        """Run `step` every `interval_s` of the room's clock until cancelled; a failed step is logged."""
        while True:
            await self.clock.sleep(interval_s)
            try:
                await step()
            except Exception:  # a timer must outlive one bad step; the traceback goes to the log
                logger.exception("gateway timer step failed")

    async def release(self, session_id: str, reason: EndReason) -> SessionEntry | None:
        """End a live session or withdraw a queued one; None if it is not held (already gone)."""
        entry = self.registry.remove(session_id)
        if entry is None:
            return None
        step = Step("finish", session_id, (), self.clock.now())
        if not self.backend.is_shared:
            await self.backend.step(step)
        else:
            await self._shared_finish(step)
        if not entry.decision.done():
            entry.decision.set_result("ended")
        recovery_holds.end_hold(entry, "ended")
        logger.info("session %s %s after %d calls", session_id, reason, len(entry.calls))
        self._notify_end(entry, reason)
        return entry

    def reconcile(self, is_state_lost: bool) -> None:
        """Shared state only: put every session held here back in line with the shared state (see the rules)."""
        state = self.backend.replicated
        if state is None:
            return
        self.registry.levels.reset([(r.session_id, r.priority) for r in self.policy.records()])
        now = self.clock.now()
        for entry in self.registry:
            sid, owner = entry.session_id, state.owner_of(entry.session_id)
            if state.is_held(sid):
                if owner == self.backend.replica_id:
                    if entry.state == "queued" and self.policy.is_live(sid):
                        self._set_live(entry, now)
                elif owner is None:
                    self.backend.submit(Step("claim", sid, (), now))
                else:
                    self.leave(entry, "moved", "taken over by replica " + owner)
            elif sid in state.orphans:
                orphan = state.orphans[sid]
                self.backend.submit(Step("adopt", sid, (orphan.predicted_peak_tokens, orphan.context_tokens,
                                                        orphan.reservation_multiplier), now))
            elif is_state_lost:  # the store lost everything: register it again (live: adopted; queued: anew)
                context = entry.calls[-1].prompt_tokens if entry.calls else 0
                peak = entry.predicted_peak_tokens if entry.revised_peak_tokens is None else entry.revised_peak_tokens
                kind: StepKind = "adopt" if entry.state == "live" else "arrive"
                self.backend.submit(Step(kind, sid, (peak, context, entry.reservation_multiplier), now))
            else:
                self.leave(entry, "ended", "ended by another replica")
        if not self.is_draining:  # held here by the shared state but unknown to this room: its step's answer was lost
            for sid, owner in list(state.owners.items()):
                if owner == self.backend.replica_id and self.registry.get(sid) is None:
                    self.backend.submit(Step("finish", sid, (), now))

    # --- the listener ----------------------------------------------------------------------------

    def _on_applied(self, applied: Applied) -> None:
        """Every step applied, in order (this room's and, shared, every replica's): the one translation into
        gateway state."""
        if applied.error is not None or applied.is_duplicate:
            return
        for sid in applied.entered:
            priority = self.policy.priority_of(sid)
            self.registry.levels.add(sid, priority)
            entry = self.registry.get(sid)
            if entry is not None:
                entry.priority_s = priority
        self._apply(list(applied.events), self.clock.now())
        for sid in applied.left:
            self.registry.levels.remove(sid)
        if self.backend.is_shared:
            self._apply_shared(applied)

    def _apply_shared(self, applied: Applied) -> None:
        me = self.backend.replica_id
        sid = applied.step.session_id
        entry = None if sid is None else self.registry.get(sid)
        if applied.replica != me and entry is not None:
            if applied.step.kind == "finish":
                self.leave(entry, "ended", f"ended through replica {applied.replica}")
            elif applied.step.kind == "claim" and applied.claimed_from in (me, None):
                self.leave(entry, "moved", f"taken over by replica {applied.replica}")
        if applied.reaped and applied.replica != me and any(self.registry.get(s) is not None for s in applied.reaped):
            logger.warning("sessions held here were let go by replica %s (this replica's lease had lapsed); "
                           "registering them again", applied.replica)
            self.reconcile(is_state_lost=False)

    def _apply(self, events: list[Event], now: float) -> None:
        """The one translation of policy events into gateway state, for every step."""
        for event in events:
            if isinstance(event, Admitted):
                self._admit(event, now)
            elif isinstance(event, Requeued):
                self._hold_for_growth(event)
            elif isinstance(event, Shed):
                self._shed(event)
            elif isinstance(event, (Held, Resumed)):
                self._recovery(event)
            elif isinstance(event, BudgetMoved):
                logger.info("budget %d -> %d tokens: %s", event.old_budget_tokens, event.new_budget_tokens,
                            event.reason)

    def _admit(self, admitted: Admitted, now: float) -> None:
        entry = self.registry.get(admitted.session_id)
        if entry is None:
            assert self.backend.is_shared, (f"the policy admitted {admitted.session_id!r}, which the gateway "
                                            "does not hold")
            return  # another replica's session
        was_live = entry.state == "live"  # (shared: registered again after the store lost it)
        entry.is_held_for_growth = False
        self._set_live(entry, now)
        if not was_live and not admitted.is_resumed:
            self._notify_admitted(entry, admitted.waited_s)
        elif admitted.is_resumed:
            logger.info("session %s resumed after %.1f s held for its outgrown call", entry.session_id,
                        admitted.waited_s)

    def _hold_for_growth(self, requeued: Requeued) -> None:
        entry = self.registry.get(requeued.session_id)
        if entry is None:
            assert self.backend.is_shared, (f"the policy requeued {requeued.session_id!r}, which the gateway "
                                            "does not hold")
            return  # another replica's session
        entry.state = held_transition(entry.state, "requeue")
        entry.is_held_for_growth = True
        recovery_holds.end_hold(entry, "admitted")  # the core forgot its recovery hold: it waits in the queue now
        if entry.decision.done():
            entry.decision = asyncio.get_running_loop().create_future()
        logger.info("session %s held: %s", entry.session_id, requeued.reason)

    def _recovery(self, event: Held | Resumed) -> None:
        entry = self.registry.get(event.session_id)
        if entry is None:
            return  # another replica's session
        if isinstance(event, Held):
            recovery_holds.hold(entry)
            if self._listener is not None:
                self._listener.session_held(entry)
            logger.info("session %s held at its tool boundary: %s", entry.session_id, event.reason)
        else:
            recovery_holds.end_hold(entry, "admitted")
            if self._listener is not None:
                self._listener.session_resumed(entry, event.held_s)
            logger.info("session %s resumed after %.1f s held: %s", entry.session_id, event.held_s, event.reason)

    def _set_live(self, entry: SessionEntry, now: float) -> None:
        if entry.state != "live":  # (shared state: a claim or a re-registration may admit a live session again)
            entry.state = held_transition(entry.state, "admit")
        entry.last_active_s = now
        if not entry.decision.done():
            entry.decision.set_result("admitted")

    def _shed(self, shed: Shed) -> None:
        entry = self.registry.remove(shed.session_id)
        if entry is None:
            assert self.backend.is_shared, f"the policy shed {shed.session_id!r}, which the gateway does not hold"
            return
        if not entry.decision.done():
            entry.decision.set_result(shed)
        recovery_holds.end_hold(entry, shed)
        logger.warning("session %s shed after %.1f s: %s", shed.session_id, shed.waited_s, shed.reason)
        self._notify_end(entry, "shed")

    def leave(self, entry: SessionEntry, reason: EndReason, why: str) -> None:
        """Shared state only: a session held here leaves this room without a step of its own (another replica's
        step ended or took it; a shutdown handed it over)."""
        if self.registry.get(entry.session_id) is not entry:
            return
        self.registry.remove(entry.session_id)
        if not entry.decision.done():
            entry.decision.set_result("ended")
        recovery_holds.end_hold(entry, "ended")
        logger.info("session %s left this replica: %s", entry.session_id, why)
        self._notify_end(entry, reason)

    # --- internals -------------------------------------------------------------------------------

    def _entry(self, session_id: str, now: float, peak: float, task_text: str, workload: str | None,
               memo: PromptMemo, is_adopted: bool, is_single_call: bool, model: str | None,
               multiplier: float) -> SessionEntry:
        """A new queued entry, registered before its step so the step's own admission finds it."""
        entry = SessionEntry(
            session_id=session_id, state="queued", decision=asyncio.get_running_loop().create_future(),
            priority_s=math.nan, routing_key=routing_key(session_id), predicted_peak_tokens=peak,
            task_text=task_text, workload=workload, started_at=self.clock.wall(), last_active_s=now, memo=memo,
            is_adopted=is_adopted, is_single_call=is_single_call, arrived_s=now, model=model,
            reservation_multiplier=multiplier,
        )
        self.registry.add(entry)
        return entry

    async def _step_for(self, entry: SessionEntry, step: Step) -> None:
        """Run a session's entering step; on any failure its entry leaves the registry again."""
        try:
            await self.backend.step(step)
        except BaseException:
            if self.registry.get(entry.session_id) is entry:
                self.registry.remove(entry.session_id)
            if not entry.decision.done():
                entry.decision.set_result("ended")
            raise

    async def _shared_finish(self, step: Step) -> None:
        try:
            await self.backend.step(step)
        except StateUnavailableError:
            self.backend.submit(step)  # kept until the store is back (or the state it held is gone)
        except PolicyError as exc:  # it was let go meanwhile (reaped, ended through another replica)
            logger.info("session %s was no longer held in the shared state: %s", step.session_id, exc)

    def _refuse_if_draining(self) -> None:
        if self.is_draining:
            raise ShuttingDownError("the gateway is shutting down and admits no new session; retry "
                                    "against its replacement", self._retry_after_s)

    def _notify_end(self, entry: SessionEntry, reason: EndReason) -> None:
        if self._listener is not None:
            self._listener.session_ended(entry, reason)

    def _notify_admitted(self, entry: SessionEntry, waited_s: float) -> None:
        if self._listener is not None:
            self._listener.session_admitted(entry, waited_s)

    def _raise_unless_admitted(self, entry: SessionEntry, verdict: Verdict) -> None:
        if isinstance(verdict, Shed):
            raise SessionShedError(verdict, self._retry_after_s)
        if verdict == "shutdown":
            raise ShuttingDownError(f"the gateway is shutting down; session {entry.session_id!r} was withdrawn "
                                    "from the queue before admission", self._retry_after_s)
        if verdict == "ended":
            raise SessionEndedError(f"session {entry.session_id!r} was ended while its call waited for admission")

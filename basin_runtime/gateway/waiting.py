# The waiting room: the asynchronous shell around the pure policy core.
#
# Rules:
# - Every policy call happens here, under one asyncio lock, with `now` read from the injected clock
#   inside the lock, so the policy sees time in order. No critical section awaits.
# - The registry mirrors the policy: a session is registered exactly when the policy holds it.
# - A session's first call that the policy queues waits on the session's `decision` future, which
#   is resolved once: "admitted" (by any event that admits it), a `Shed`, or "ended" (ended by the
#   admin endpoint while queued). Later calls of a queued session wait on the same future.
# - When the last waiter of a queued session leaves (client gone or task cancelled), the session is
#   withdrawn (`policy.finish`). Adopted sessions (`restart.py`: live before a restart) never wait,
#   even if the policy queues them; if the policy sheds one, it is forgotten and its next call
#   arrives as a new session.
# - Draining (a graceful shutdown has begun): nothing new is admitted. Every queued session is
#   withdrawn at once and its waiting calls get "shutdown" (503); a session arriving while draining
#   is refused the same way. Live sessions keep being served until the server stops.
# - Whatever a policy step admits is applied at once (state, decision). Timers: `tick` every
#   `tick_interval_s` (hit rate from `hit_rate`, None until issue 6 feeds it), and an idle sweep.
# - `on_session_end(entry, reason)` is told of every session that leaves, and `on_admitted(entry,
#   waited_s)` of every session admitted (at arrival with 0 s): the seams for the session log,
#   metrics and lending. `hit_rate` and `ttft` feed each tick (the hit-rate and first-token latency
#   windows, wired by the gateway).
# - `set_budget` changes the operator's reference budget under the lock and applies what it admits.
"""The asynchronous waiting room around `basin_runtime.policy.Policy`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from starlette.types import Receive

from basin_runtime.disconnect import race_client
from basin_runtime.gateway.clock import Clock
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
from basin_runtime.policy import Admitted, BudgetMoved, Event, Policy, Shed

logger = logging.getLogger(__name__)

EndReason = Literal["ended", "idle", "withdrawn", "shed", "failed", "shutdown"]
SessionEndHook = Callable[[SessionEntry, EndReason], None]
AdmittedHook = Callable[[SessionEntry, float], None]


class WaitingRoom:
    """Admits, queues, withdraws, sheds and ends sessions by driving the policy."""

    def __init__(self, policy: Policy, clock: Clock, *, retry_after_s: float,
                 hit_rate: Callable[[], float | None] = lambda: None,
                 ttft: Callable[[], float | None] = lambda: None,
                 on_session_end: SessionEndHook | None = None, levels: PriorityLevels | None = None) -> None:
        self.policy = policy
        self.clock = clock
        self.registry = SessionRegistry(levels)
        self._lock = asyncio.Lock()
        self._retry_after_s = retry_after_s
        self.hit_rate = hit_rate
        self.ttft = ttft
        self.on_session_end = on_session_end
        self.on_admitted: AdmittedHook | None = None
        self.is_draining = False

    async def arrive(self, session_id: str, first: FirstCall, predicted_peak_tokens: float, *,
                     workload: str | None, memo: PromptMemo, is_adopted: bool = False,
                     is_single_call: bool = False, model: str | None = None,
                     reservation_multiplier: float = 1.0) -> tuple[SessionEntry, bool]:
        """Register a new session with the policy; (entry, True), or (existing entry, False) if one won a race."""
        async with self._lock:
            existing = self.registry.get(session_id)
            if existing is not None:
                return existing, False
            if self.is_draining:
                raise ShuttingDownError("the gateway is shutting down and admits no new session; retry "
                                        "against its replacement", self._retry_after_s)
            now = self.clock.now()
            step = self.policy.adopt if is_adopted else self.policy.arrive
            events = step(session_id, now, predicted_peak_tokens, first.prompt_tokens, reservation_multiplier)
            entry = SessionEntry(
                session_id=session_id, state="queued",
                decision=asyncio.get_running_loop().create_future(),
                priority_s=self.policy.priority_of(session_id), routing_key=routing_key(session_id),
                predicted_peak_tokens=predicted_peak_tokens, task_text=first.task_text, workload=workload,
                started_at=self.clock.wall(), last_active_s=now, memo=memo, is_adopted=is_adopted,
                is_single_call=is_single_call, arrived_s=now, model=model,
                reservation_multiplier=reservation_multiplier,
            )
            self.registry.add(entry)
            self._apply(events, now)
            return entry, True

    async def observe(self, entry: SessionEntry, prompt_tokens: int,
                      revision: tuple[float, float] | None = None) -> bool:
        """Tell the policy a call's prompt size, and with `revision` (re-estimated peak, multiplier) revise
        the session's reservation in the same step; False if the session is no longer held."""
        async with self._lock:
            if self.registry.get(entry.session_id) is not entry:
                return False
            now = self.clock.now()
            entry.last_active_s = now
            self._apply(self.policy.observe(entry.session_id, now, prompt_tokens), now)
            if revision is not None:
                peak, multiplier = revision
                self._apply(self.policy.revise(entry.session_id, now, peak, multiplier), now)
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

    async def end(self, session_id: str, reason: EndReason = "ended") -> SessionEntry:
        """End a live session or withdraw a queued one; `SessionNotFoundError` if it is not held."""
        entry = await self.release(session_id, reason)
        if entry is None:
            raise SessionNotFoundError(f"no live or queued session {session_id!r}")
        return entry

    async def drain(self) -> list[SessionEntry]:
        """Stop admitting: withdraw every queued session (its calls get 503); return them."""
        async with self._lock:
            self.is_draining = True
            queued = [e for e in self.registry if e.state == "queued"]
            now = self.clock.now()
            for entry in queued:
                self.registry.remove(entry.session_id)
                self.policy.finish(entry.session_id, now)  # a queued session's finish admits nobody here
                if not entry.decision.done():
                    entry.decision.set_result("shutdown")
        for entry in queued:
            logger.info("session %s withdrawn: the gateway is shutting down", entry.session_id)
            self._notify_end(entry, "withdrawn")
        return queued

    async def tick(self) -> list[Event]:
        """Let the policy move the budget, admit and shed; apply what it decided (nothing while draining)."""
        async with self._lock:
            if self.is_draining:
                return []
            now = self.clock.now()
            events = self.policy.tick(now, self.hit_rate(), self.ttft())
            self._apply(events, now)
            return events

    async def set_budget(self, budget_tokens: int) -> list[Event]:
        """Set the operator's reference budget; `PolicyError` if the value is not allowed."""
        async with self._lock:
            now = self.clock.now()
            events = self.policy.set_reference_budget(budget_tokens, now)
            self._apply(events, now)
            return events

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
        async with self._lock:
            entry = self.registry.remove(session_id)
            if entry is None:
                return None
            now = self.clock.now()
            events = self.policy.finish(session_id, now)
            if not entry.decision.done():
                entry.decision.set_result("ended")
            self._apply(events, now)
        logger.info("session %s %s after %d calls", session_id, reason, len(entry.calls))
        self._notify_end(entry, reason)
        return entry

    def _admit(self, admitted: Admitted, now: float) -> None:
        entry = self.registry.get(admitted.session_id)
        assert entry is not None, f"the policy admitted {admitted.session_id!r}, which the gateway does not hold"
        entry.state = "live"
        entry.last_active_s = now
        if not entry.decision.done():
            entry.decision.set_result("admitted")
        self._notify_admitted(entry, admitted.waited_s)

    def _apply(self, events: list[Event], now: float) -> None:
        """The one translation of policy events into gateway state, for every step."""
        for event in events:
            if isinstance(event, Admitted):
                self._admit(event, now)
            elif isinstance(event, Shed):
                self._shed(event)
            elif isinstance(event, BudgetMoved):
                logger.info("budget %d -> %d tokens: %s", event.old_budget_tokens, event.new_budget_tokens,
                            event.reason)

    def _shed(self, shed: Shed) -> None:
        entry = self.registry.remove(shed.session_id)
        assert entry is not None, f"the policy shed {shed.session_id!r}, which the gateway does not hold"
        if not entry.decision.done():
            entry.decision.set_result(shed)
        logger.warning("session %s shed after %.1f s: %s", shed.session_id, shed.waited_s, shed.reason)
        self._notify_end(entry, "shed")

    def _notify_end(self, entry: SessionEntry, reason: EndReason) -> None:
        if self.on_session_end is not None:
            self.on_session_end(entry, reason)

    def _notify_admitted(self, entry: SessionEntry, waited_s: float) -> None:
        if self.on_admitted is not None:
            self.on_admitted(entry, waited_s)

    def _raise_unless_admitted(self, entry: SessionEntry, verdict: Verdict) -> None:
        if isinstance(verdict, Shed):
            raise SessionShedError(verdict, self._retry_after_s)
        if verdict == "shutdown":
            raise ShuttingDownError(f"the gateway is shutting down; session {entry.session_id!r} was withdrawn "
                                    "from the queue before admission", self._retry_after_s)
        if verdict == "ended":
            raise SessionEndedError(f"session {entry.session_id!r} was ended while its call waited for admission")

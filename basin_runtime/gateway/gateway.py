"""The gateway's request path: one inference call from the client to the upstream and back.

Rules:
- A call's body is read within the limits (`limits.py`) and parsed (400 if malformed), its session
  identified, then: an unknown session is measured (task text, first prompt with any history it
  carries, prediction) and arrives at the policy, which reserves max(m x prediction, context) from its
  first call on; a session the previous run held live, resuming within the adoption window, is
  adopted instead with the context it had (`restart.py`), and its resumed call is then observed; a
  known session's prompt size is observed, under the core's outgrowth rule (a call past its
  reservation may put the session back in the queue). A call under a held session's id that does
  not continue its conversation is a session of its own or refused (`identity.py`,
  `--foreign-call`). A queued session's call then waits in the waiting room (`_admit`, the one place
  a call is held; in shadow mode it is counted, not held).
- A session none of whose calls was ever served is released as `failed` when its last call in flight
  ends: a failed first call holds no budget.
- The forwarded body carries the session's engine priority and a rid (with `engine_session_cache` also
  its routing key as `session_id`, SGLang's session tag; a resent call whose client sent its own is read
  in full, so that copy can be cut; Assumption: a batch goes untagged, as it goes without a rid: SGLang
  normalises a batch's per-request fields, which was not read for `session_id`), and the request its
  routing key (`priority.py`); the answer carries the session id, and a session's first answer its end
  key (`basin_runtime/session_keys.py`).
- A call is in flight from forwarding until its answer ends (`proxy.py` reports the end); idle time
  counts from the end of the last call. A single-call session ends with its call.
- Every call's end, admission and session end reach the signals (hit rate, first-token latency), the
  metrics, the lending reports and the session log.
- Large bodies (OFF_LOOP_BODY_BYTES and up) are parsed, identified and counted in a worker thread,
  HUGE_BODY_BYTES and up in one thread kept for them; the forwarded body is the client's bytes with
  the gateway's fields beside them, uncopied. A resent conversation is read from its new part on
  (`resend.py`).
- Added latency is the wall time from the call's arrival to its forwarding, minus any queue wait.
- Shutdown: `drain` answers queued and new calls 503 while calls in flight run on; `cut_calls` cancels
  those left at the deadline; `shut_down` lists the live sessions for the next run and ends the rest as
  `shutdown` (with `--state`, hands them over to the other replicas instead).
- Replicas (`--state`): a session the shared state knows (another replica's, or an orphan) is taken
  over without a new queue turn or prediction; the leader ticks the policy with every replica's signals.
- Built whole (`build.py`), it owns its lifecycle: `async with gateway.running()` starts the upstream client,
  the shared state, the room's timers, the live-sessions writer and the engines' scraper, and at its end
  shuts down (above) and closes them. Below the edge: a call comes in as an `Inbound` (`inbound.py`), plain
  data; nothing here reads a web framework's request.

Why the thresholds and threads are where they are: docs/gateway/design.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from basin_runtime.gateway import recovery_holds
from basin_runtime.gateway.calls import SESSION_TAG, Call, CallKind, parse_call, tag_session
from basin_runtime.gateway.errors import SessionEndedError, ShuttingDownError
from basin_runtime.gateway.identity import (
    ForeignCall,
    binding_of,
    derived_id,
    head_length,
    key_digest,
    refuse_foreign,
)
from basin_runtime.gateway.inbound import Inbound
from basin_runtime.gateway.limits import BodyBudget, Limits, read_body
from basin_runtime.gateway.measure import Meter, PromptMemo, message_digest
from basin_runtime.gateway.predictors import PREDICTED_TEXT_CHARS, Predictors, predict_peak
from basin_runtime.gateway.priority import ROUTING_KEY_HEADER, request_id, stamp
from basin_runtime.gateway.proxy import Answer, CallEnd, EndHook, Upstream
from basin_runtime.gateway.resend import RESEND_MIN_BYTES, read_resent
from basin_runtime.gateway.restart import Adoption, LiveSession, LiveSessions, Restart, prefix_digest
from basin_runtime.gateway.sessions import CallRecord, SessionEntry, session_id_for
from basin_runtime.gateway.telemetry import Telemetry, logged_calls
from basin_runtime.gateway.waiting import Ended, WaitingRoom
from basin_runtime.policy import DuplicateSessionError, PolicyError
from basin_runtime.session_keys import SESSION_KEY_HEADER, SessionKeys, incarnation
from basin_runtime.session_log import LoggedCall

if TYPE_CHECKING:
    from basin_runtime.state.leases import Coordinator

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Parsing, counting and encoding a body this large move to a worker thread (`_off_loop_if_large`).
# Measured on a growing agent conversation: that work costs ~8 us per KiB (0.9 ms at 76 KiB, 9 ms at
# 1 MiB) against ~60 us per thread hop; below 64 KiB it stays inline and stalls the loop < 1 ms.
OFF_LOOP_BODY_BYTES = 64 << 10
OFF_LOOP_COPY_BYTES = 8 << 20  # a resent body is compared with its prefix (memcmp) on the loop below this size
HUGE_BODY_BYTES = 8 << 20  # such a body's work runs in one thread of its own (`_off_loop_if_large`)
_HUGE_BODY_WORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="basin-huge-body")
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"  # smg's answer header: the worker (the decode one in PD) that served
FAILED_OUTCOMES = frozenset({"rejected", "upstream_error", "gateway_error"})
CUT_MESSAGE = "basin: cut at the shutdown's drain deadline"
LIVE_SESSIONS_INTERVAL_S = 2.0  # how stale the live-sessions file may be after a kill -9
DEFAULT_ADOPTION_WINDOW_S = 600.0


@dataclass(frozen=True)
class GatewaySettings:
    """What the gateway is told: its header names, the answer to a foreign call, its input limits and timers, and
    the secret its session end keys are derived from."""

    session_header: str = "X-Session-ID"
    workload_header: str = "X-Basin-Workload"
    routing_key_header: str = ROUTING_KEY_HEADER
    foreign_call: ForeignCall = "new-session"
    is_shadow: bool = False  # at start (the admin endpoint turns shadow mode on and off)
    limits: Limits = field(default_factory=Limits)
    tick_interval_s: float = 1.0
    idle_timeout_s: float = 600.0
    session_keys: SessionKeys = field(default_factory=SessionKeys)
    tags_engine_sessions: bool = False  # engine_session_cache: calls carry `session_id` (the routing key)


class Gateway:
    """Admits sessions through the waiting room and forwards their calls upstream.

    Built whole (`build.py`): the room comes with its signals and listener (the `telemetry`), a shared backend with
    its hooks and its coordinator with its report; nothing here is wired after construction.
    """

    def __init__(self, settings: GatewaySettings, room: WaitingRoom, meter: Meter, predictors: Predictors,
                 upstream: Upstream, telemetry: Telemetry, restart: Restart | None = None,
                 coordinator: Coordinator | None = None) -> None:
        self.settings = settings
        self.room = room
        self.meter = meter
        self.predictors = predictors  # the admin endpoint swaps in reloaded models
        self.upstream = upstream
        self.telemetry = telemetry
        self.restart = restart or Restart.begin(None, room.clock.now(), DEFAULT_ADOPTION_WINDOW_S)
        self.coordinator = coordinator
        self.is_shadow = settings.is_shadow
        self.bodies = BodyBudget(settings.limits.max_body_bytes_in_flight)
        self.active_calls: set[asyncio.Task[Any]] = set()  # `app._InferencePath` keeps it; a shutdown cuts them
        self.is_cut = False
        if coordinator is not None:
            telemetry.metrics.state_up.set(1 if coordinator.backend.is_up else 0)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve inside: the upstream client, the shared state (`--state`), the room's timers, the live-sessions
        writer and the engines' scraper run; at the end every session still held is ended as `shutdown` (or handed
        over), then the shared state and the session log are closed."""
        await self.upstream.start()
        coordinator = self.coordinator
        if coordinator is not None:
            await coordinator.backend.start()
            coordinator.start()
        settings, scraper = self.settings, self.telemetry.engine_scraper
        tasks = {asyncio.create_task(self.room.run_timers(settings.tick_interval_s, settings.idle_timeout_s))}
        if scraper is not None:
            tasks.add(asyncio.create_task(scraper.run()))
        if self.restart.file is not None:
            tasks.add(asyncio.create_task(self.room.every(LIVE_SESSIONS_INTERVAL_S, self.save_live_sessions)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            if scraper is not None:
                await scraper.aclose()
            await self.shut_down()
            if self.telemetry.engine_sessions is not None:  # after shut_down, whose ended sessions it closes
                await self.telemetry.engine_sessions.aclose()
            if coordinator is not None:
                await coordinator.stop()
                await coordinator.backend.aclose()
            if self.telemetry.task_memory is not None:  # after shut_down, whose ended sessions it records
                await self.telemetry.task_memory.aclose()
            if self.telemetry.session_log is not None:
                await asyncio.to_thread(self.telemetry.session_log.close)

    def hit_rate(self) -> float | None:
        """The windowed prefix hit rate now, as this gateway measures it (None: too little evidence)."""
        return self.telemetry.hit_rate()

    def ttft_s(self) -> float | None:
        """The windowed median time to first token now, as this gateway measures it (None: too few calls)."""
        return self.telemetry.ttft_s()

    def refresh_metrics(self) -> None:
        """Set the state gauges from the policy (on a scrape and after each tick)."""
        metrics, session_log = self.telemetry.metrics, self.telemetry.session_log
        metrics.refresh(self.room.policy.snapshot(), self.hit_rate(), self.is_shadow, self.ttft_s(),
                        sum(1 for entry in self.room.registry if recovery_holds.is_held(entry)))
        backend = self.room.backend
        metrics.refresh_state(backend.is_up, backend.is_leader, backend.num_pending)
        if session_log is not None:
            metrics.log_failed.set(session_log.num_failed)
            metrics.log_dropped.set(session_log.num_dropped)

    async def handle(self, kind: CallKind, inbound: Inbound) -> Answer:
        """Serve one inference call (its body held in the large-body budget until it has been forwarded)."""
        if self.room.is_draining:
            raise self.shutting_down("no new call is taken")
        arrived = time.perf_counter()
        hold = self.bodies.hold()
        try:
            raw = await read_body(inbound.body, inbound.headers.content_length, self.settings.limits.max_body_bytes,
                                  hold)
            return await self._serve(kind, inbound, raw, arrived)
        finally:
            hold.release()

    async def _serve(self, kind: CallKind, inbound: Inbound, raw: bytes, arrived: float) -> Answer:
        named = inbound.headers.session_id
        call, (session_id, is_single_call) = await self._read(kind, raw, named)
        if call.resent is not None and (self.room.registry.get(session_id) is None  # it ended meanwhile: read in full
                                        or (self.settings.tags_engine_sessions and SESSION_TAG in call.sent)):
            call, (session_id, is_single_call) = await _off_loop_if_large(len(raw), self._read_call, kind, raw, named)
        entry, prompt_tokens, held_s = await self._admit(call, session_id, is_single_call, inbound)
        priority = self.room.registry.engine_priority(entry)
        rid = stamp(call.body, priority, None if call.is_batch else request_id(entry.routing_key, len(entry.calls)))
        if self.settings.tags_engine_sessions and not call.is_batch:
            call = tag_session(call, entry.routing_key)
        headers = self._headers(entry, inbound.headers.items)
        record = CallRecord(self.room.clock.wall(), prompt_tokens, rid, call.is_stream, engine_priority=priority)
        entry.calls.append(record)
        entry.in_flight += 1
        self.telemetry.metrics.calls_in_flight.inc()
        end = _EndOnce(partial(self._call_ended, entry, record))
        try:  # from here every exit path ends the call exactly once, or the session could never be released
            drop_usage_chunk = _ask_for_usage(call)
            # the client's bytes in views, the gateway's fields beside them: O(1), unless a field the client sent
            # must be cut out (a scan of the body's top level)
            body = await _off_loop_if_large(call.num_bytes if call.sent else 0, call.encode_pieces)
            self.telemetry.metrics.added_latency.observe(max(0.0, time.perf_counter() - arrived - held_s))
            self.telemetry.call_forwarded(record)
            response = await self.upstream.forward("POST", call.path, headers, body, inbound.receive,
                                                   on_end=end, drop_usage_chunk=drop_usage_chunk,
                                                   on_first_byte=partial(self.telemetry.first_byte, record))
        except BaseException as exc:
            if not end.has_ended:
                if isinstance(exc, asyncio.CancelledError):
                    logger.info("call %s of session %r cut before its answer began", rid, entry.session_id)
                else:
                    logger.exception("call %s of session %r failed inside the gateway", rid, entry.session_id)
                await asyncio.shield(end(CallEnd("gateway_error")))
            raise
        if entry.session_id.isascii() and entry.session_id.isprintable():
            response.headers[self.settings.session_header] = entry.session_id
        if not (entry.has_sent_key or entry.is_single_call):
            of = self.incarnation_of(entry.session_id)
            if of is not None:
                response.headers[SESSION_KEY_HEADER] = self.settings.session_keys.key(entry.session_id, of)
                entry.has_sent_key = True
        return response

    @property
    def num_active_calls(self) -> int:
        """Requests the app is serving on the hot path (`app._InferencePath`: inference calls, session ends)."""
        return len(self.active_calls)

    def cut_calls(self) -> int:
        """A shutdown's drain deadline passed: cancel every call still being served (each answers for itself: a JSON
        503, or an error event in a stream that began); how many there were."""
        self.is_cut = True
        for task in self.active_calls:
            task.cancel(CUT_MESSAGE)
        return len(self.active_calls)

    def shutting_down(self, what: str) -> ShuttingDownError:
        """The 503 a call gets while the gateway drains or after it was cut."""
        return ShuttingDownError(f"the gateway is shutting down: {what}; send it again to its replacement",
                                 self.room.retry_after_s)

    def incarnation_of(self, session_id: str) -> str | None:
        """The incarnation of the session held now under this id (its end key is bound to it); None if none is."""
        try:
            record = self.room.policy.record_of(session_id)
        except PolicyError:
            return None
        return incarnation(record.seq, record.arrival_s)

    def is_orphan(self, session_id: str) -> bool:
        """Replicas: True if a dead replica let this session go (its key went with that replica's record)."""
        state = self.room.backend.replicated
        return state is not None and session_id in state.orphans

    async def end_session(self, session_id: str) -> Ended:
        """End a session on the client's or operator's word (shared state: held here or anywhere)."""
        return await self.room.end(session_id, "ended")

    async def save_live_sessions(self, *, is_logged: bool = False) -> None:
        """Write the live-sessions file if the live sessions or their calls changed (off the event loop; `is_logged`:
        their records so far are in the session log, a graceful shutdown's last write)."""
        file = self.restart.file
        if file is None:
            return
        live = [e for e in self.room.registry if e.state == "live" and not e.is_single_call]
        signature = (is_logged, frozenset((e.session_id, len(e.memo.keys), sum(c.ended_at is not None
                                                                              for c in e.calls)) for e in live))
        if not file.is_unchanged(signature):
            sessions = LiveSessions({e.session_id: _live_session(e) for e in live}, is_logged)
            await asyncio.to_thread(file.write, sessions, signature)

    async def drain(self) -> None:
        """A graceful shutdown begins: admit nothing more; queued calls get 503 now."""
        withdrawn = await self.room.drain()
        logger.info("draining: %d queued sessions withdrawn, %d live sessions served until the server stops",
                    len(withdrawn), len(self.room.registry))

    async def shut_down(self) -> None:
        """The server has stopped: end each session still held as `shutdown` (logged), then list the live ones for
        the next run, marked logged."""
        self.room.is_draining = True
        await self.save_live_sessions()  # (if anything below fails, the file lists them unlogged: whole next time)
        snapshot = {e.session_id: _live_session(e) for e in self.room.registry
                    if e.state == "live" and not e.is_single_call}
        held = list(self.room.registry)
        if self.room.backend.is_shared:  # handed over: live ones become orphans any replica adopts
            await self.room.hand_over(self.restart.adoption.window_s)
            for entry in held:
                self.room.leave(entry, "shutdown", "the replica shut down; handed over")
        else:
            for entry in held:
                await self.room.release(entry.session_id, "shutdown")
        session_log, file = self.telemetry.session_log, self.restart.file
        if session_log is not None:
            await asyncio.to_thread(session_log.flush)
        if file is not None:
            await asyncio.to_thread(file.write, LiveSessions(snapshot, is_logged=True))
        if held:
            logger.info("shut down with %d sessions live: each logged as `shutdown`%s", len(held),
                        "" if file is None else f", listed in {file.path}")

    def _headers(self, entry: SessionEntry, items: Sequence[tuple[str, str]]) -> dict[str, str]:
        """The client's headers, its routing key (if any) replaced by the session's."""
        key_header = self.settings.routing_key_header
        lowered = key_header.lower()
        headers = {k: v for k, v in items if k.lower() != lowered}
        headers[key_header] = entry.routing_key
        return headers

    async def _read(self, kind: CallKind, raw: bytes, named: str) -> tuple[Call, tuple[str, bool]]:
        """The parsed call and its session (`named`: the session header's value): a known session's resent
        conversation from its new part on (`resend.py`; on the loop when that part and the prefix comparison are
        small), else the whole body."""
        limits = self.settings.limits
        if kind == "chat" and len(raw) >= RESEND_MIN_BYTES:
            entry = self.room.registry.get(named.strip())
            base = None if entry is None else entry.memo.counts  # read once: another call may swap it
            if entry is not None and base is not None and base.prefix is not None:
                if len(raw) < OFF_LOOP_COPY_BYTES and len(raw) - base.prefix.end < OFF_LOOP_BODY_BYTES:
                    call = read_resent(raw, base, limits)
                else:
                    call = await asyncio.to_thread(read_resent, raw, base, limits)
                if call is not None:
                    return call, (entry.session_id, False)
        return await _off_loop_if_large(len(raw), self._read_call, kind, raw, named)

    def _read_call(self, kind: CallKind, raw: bytes, named: str) -> tuple[Call, tuple[str, bool]]:
        """The parsed call and its session (id, is a single call): one step, so a large body costs one thread
        hop for both (a conversation's hash reads its first messages)."""
        limits = self.settings.limits
        call = parse_call(kind, raw, limits)
        return call, session_id_for(call, named, self.settings.session_header, limits.max_session_id_chars)

    async def _admit(self, call: Call, session_id: str, is_single_call: bool,
                     inbound: Inbound) -> tuple[SessionEntry, int, float]:
        key = key_digest(inbound.headers.authorization)
        workload = inbound.headers.workload
        entry = self.room.registry.get(session_id)
        if entry is not None and not entry.is_single_call and not _continues(entry, call, key):
            call, session_id = await self._foreign(call, session_id, key, "its first messages or API key differ")
            entry = self.room.registry.get(session_id)
        is_new = False
        if entry is None and self.room.backend.is_shared and not is_single_call:
            entry = await self._take_over(session_id, call, workload)
        if entry is None:
            try:
                entry, prompt_tokens, is_new = await self._arrive(session_id, is_single_call, call, workload, key)
            except DuplicateSessionError:  # replicas: it arrived elsewhere a moment before; now this copy knows it
                if (entry := await self._take_over(session_id, call, workload)) is None:
                    raise
                prompt_tokens = await _off_loop_if_large(call.read_bytes, self.meter.prompt_tokens, call, entry.memo)
        else:
            prompt_tokens = await _off_loop_if_large(call.read_bytes, self.meter.prompt_tokens, call, entry.memo)
        revision = None
        if not is_new and not entry.is_adopted and self.predictors.revises_at(entry.workload, len(entry.calls) + 1):
            revision = self.predictors.revision(
                entry.workload, entry.predicted_peak_tokens, [c.prompt_tokens for c in entry.calls] + [prompt_tokens],
                [c.completion_tokens or 0 for c in entry.calls])
        is_resumed = entry.is_adopted and entry.context_tokens != prompt_tokens  # its call past its listed context
        if (not is_new or is_resumed) and not await self.room.observe(entry, prompt_tokens, revision):
            raise SessionEndedError(f"session {session_id!r} ended while this call was being read; send it again")
        held_s = 0.0
        if entry.state == "queued" and (not entry.is_adopted or entry.is_held_for_growth):
            if self.is_shadow:
                self.telemetry.metrics.shadow_held.inc()
            else:
                started = time.perf_counter()
                await self.room.wait(entry, inbound.receive)
                held_s = time.perf_counter() - started
        if recovery_holds.is_held(entry) and not self.is_shadow:  # at its tool boundary (`recovery_holds.py`)
            sessions = self.telemetry.engine_sessions
            if sessions is not None and self.settings.tags_engine_sessions and not entry.is_engine_session_closed:
                entry.is_engine_session_closed = True
                sessions.close(entry.routing_key)
            started = time.perf_counter()
            await self.room.wait_held(entry, inbound.receive)
            held_s += time.perf_counter() - started
        return entry, prompt_tokens, held_s

    async def _foreign(self, call: Call, session_id: str, key: bytes | None, why: str) -> tuple[Call, str]:
        """A call that does not continue the conversation its id names (`identity.py`): (the call, read in full,
        and the id of its own session), or the 409 under `--foreign-call refuse`."""
        if self.settings.foreign_call == "refuse":
            raise refuse_foreign(session_id, why)
        if call.resent is not None:  # read against the other conversation's memo: read it whole, as its own
            call, _ = await _off_loop_if_large(call.num_bytes, self._read_call, call.kind, call.raw, "")
        heads = [message_digest(m) for m in call.messages[:head_length(call.messages)]] if call.messages else []
        own = derived_id(session_id, binding_of(call, key, heads))
        logger.info("a call under session id %r does not continue its conversation (%s): it goes on as session %r",
                    session_id, why, own)
        return call, own

    async def _take_over(self, session_id: str, call: Call, workload: str | None) -> SessionEntry | None:
        """Replicas: continue a session the shared state holds or let go; None if it knows no such session."""
        state = self.room.backend.replicated
        if state is None or not (state.is_held(session_id) or session_id in state.orphans):
            return None
        memo = PromptMemo()
        first = await _off_loop_if_large(call.num_bytes, self.meter.first_call, call, memo)
        model = call.body.get("model")
        return await self.room.take_over(session_id, first, workload=workload, memo=memo,
                                         model=model if isinstance(model, str) else None)

    async def _arrive(self, session_id: str, is_single_call: bool, call: Call, workload: str | None,
                      key: bytes | None) -> tuple[SessionEntry, int, bool]:
        model = self.predictors.for_workload(workload)
        memo = PromptMemo()
        first = await _off_loop_if_large(call.num_bytes, self.meter.first_call, call, memo)
        binding = binding_of(call, key, memo.keys)
        previous = None
        adoption = self.restart.adoption
        listed = None if is_single_call else adoption.listed(session_id, self.room.clock.now())
        if listed is not None:
            if Adoption.continues(listed, call.is_continuation, memo.keys, key):
                previous = adoption.take(session_id)
            else:  # the listed entry stays for its owner (`restart.py`)
                if self.settings.foreign_call == "refuse":
                    raise refuse_foreign(session_id, "it does not continue the conversation listed before the "
                                                     "restart")
                session_id = derived_id(session_id, binding)
                logger.info("a call does not continue the conversation listed before the restart: it goes on as "
                            "session %r", session_id)
        is_adopted = previous is not None
        # What the engine will hold is the whole first prompt, history or not (a made-up one reserved like an empty
        # task); only an adopted session, which ran before, is predicted as its real first call was.
        prompt_tokens = first.first_prompt_tokens if is_adopted else first.prompt_tokens
        peak = await _off_loop_if_large(min(len(first.task_text), PREDICTED_TEXT_CHARS), predict_peak, model,
                                        first.task_text, prompt_tokens)
        memory = self.telemetry.task_memory
        if memory is not None and not is_adopted and not is_single_call:  # task_memory.py's rules
            peak = await memory.told_peak(first.task_text, peak, self.telemetry.clock.wall())
        # adopted: it reserves what it held before the restart, and its resumed call is then observed like any call
        # (the outgrowth rule holds it if it brings more than that reservation and does not fit)
        context = None if previous is None else min(first.prompt_tokens, previous.calls[-1].prompt_tokens
                                                    if previous.calls else first.first_prompt_tokens)
        entry, is_new = await self.room.arrive(session_id, first, peak, workload=workload, memo=memo,
                                               is_adopted=is_adopted, is_single_call=is_single_call,
                                               context_tokens=context,
                                               model=call.body.get("model") if isinstance(call.body.get("model"),
                                                                                          str) else None,
                                               reservation_multiplier=self.predictors.multiplier(workload))
        if is_new:
            entry.binding = binding
        if previous is not None and is_new and not adoption.is_logged:  # the last run was killed: log it whole
            entry.earlier = previous
            unrecorded = self.meter.unrecorded_calls(call, memo.counts, len(previous.calls))
            since = previous.calls[-1].ended_at if previous.calls else previous.started_at
            entry.unrecorded_calls = tuple(LoggedCall(since or previous.started_at, None, c.prompt_tokens,
                                                      c.completion_tokens) for c in unrecorded)
        return entry, first.prompt_tokens, is_new

    async def _call_ended(self, entry: SessionEntry, record: CallRecord, end: CallEnd) -> None:
        telemetry = self.telemetry
        telemetry.call_done(record)
        record.ended_at = self.room.clock.wall()
        record.outcome = end.outcome
        record.status_code = end.status_code
        record.served_by = end.upstream_headers.get(ROUTED_WORKER_HEADER)
        now = self.room.clock.now()
        usage = end.usage
        if usage is not None:
            record.completion_tokens = usage.completion_tokens
            record.cached_tokens = usage.cached_tokens
            if usage.cached_tokens is not None:
                telemetry.hit_window.record(now, usage.prompt_tokens or record.prompt_tokens, usage.cached_tokens)
        telemetry.metrics.call_ended(end.outcome, usage)
        is_held = self.room.registry.get(entry.session_id) is entry
        if end.outcome == "completed" and not entry.is_single_call and is_held:
            moved = telemetry.lending.call_finished(entry.session_id, record.served_by, record.cached_tokens,
                                               None if usage is None else usage.cached_tiers)
            if moved:
                telemetry.metrics.calls_moved.inc()
        entry.in_flight -= 1
        telemetry.metrics.calls_in_flight.dec()
        entry.last_active_s = now
        if end.outcome in FAILED_OUTCOMES:
            log = logger.info if end.outcome == "rejected" else logger.warning
            log("call %s of session %r ended %s (upstream status %s)", record.rid, entry.session_id, end.outcome,
                end.status_code)
        if entry.is_single_call:
            await self.room.release(entry.session_id, "ended")
        elif (end.outcome in FAILED_OUTCOMES and is_held and entry.in_flight == 0
              and not any(c.outcome == "completed" for c in entry.calls)):
            await self.room.release(entry.session_id, "failed")  # nothing served: hold no budget for it


class _EndOnce:
    """A call's end hook that runs once, however many exit paths reach it."""

    def __init__(self, hook: EndHook) -> None:
        self._hook = hook
        self.has_ended = False

    async def __call__(self, end: CallEnd) -> None:
        if self.has_ended:
            return
        self.has_ended = True
        await self._hook(end)


async def _off_loop_if_large(num_bytes: int, work: Callable[..., T], *args: object) -> T:
    """`work(*args)`, in a worker thread when the call's body is at least OFF_LOOP_BODY_BYTES; one of HUGE_BODY_BYTES
    or more in the one thread kept for them (see the rules)."""
    if num_bytes < OFF_LOOP_BODY_BYTES:
        return work(*args)
    if num_bytes < HUGE_BODY_BYTES:
        return await asyncio.to_thread(work, *args)
    return await asyncio.get_running_loop().run_in_executor(_HUGE_BODY_WORKER, functools.partial(work, *args))


def _continues(entry: SessionEntry, call: Call, key: bytes | None) -> bool:
    """Does this call continue the session's conversation (`identity.py`)? A session taken over from another
    replica is bound by its first call here."""
    if entry.binding is None:
        heads = [message_digest(m) for m in call.messages[:head_length(call.messages)]] if call.messages else []
        if call.resent is None:
            entry.binding = binding_of(call, key, heads)
        return True
    return entry.binding.continues(call, key)


def _ask_for_usage(call: Call) -> bool:
    """Ask a streamed OpenAI call for its usage; True if the gateway added the request (drop the extra chunk)."""
    if not call.is_stream or call.kind == "generate":
        return False
    options = call.body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    call.body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return True


def _live_session(entry: SessionEntry) -> LiveSession:
    """What the next run needs of a live session: the conversation it last sent, its record so far (ended calls)."""
    earlier = entry.earlier
    own = tuple(c for c in logged_calls(entry) if c.ended_at is not None)
    calls = own if earlier is None else earlier.calls + entry.unrecorded_calls + own
    keys = entry.memo.keys
    key = None if entry.binding is None or entry.binding.key is None else entry.binding.key.hex()
    return LiveSession(prefix_digest(keys), len(keys), entry.started_at if earlier is None else earlier.started_at,
                       entry.predicted_peak_tokens if earlier is None else earlier.predicted_peak_tokens,
                       entry.reserved_peak_tokens, len(entry.task_text), entry.model, entry.workload, calls, key)

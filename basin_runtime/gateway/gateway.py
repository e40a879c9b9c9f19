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
- The forwarded body carries the session's engine priority and a rid, and the request its routing
  key (`priority.py`); the answer carries the session id, and a session's first answer its end key
  (`basin_runtime/session_keys.py`).
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

Why the thresholds and threads are where they are: docs/gateway/design.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from basin_runtime.gateway.calls import Call, CallKind, parse_call
from basin_runtime.gateway.engine_metrics import EngineHitWindow, EngineScraper
from basin_runtime.gateway.errors import SessionEndedError, ShuttingDownError
from basin_runtime.gateway.identity import (
    ForeignCall,
    binding_of,
    derived_id,
    head_length,
    key_digest,
    refuse_foreign,
)
from basin_runtime.gateway.lending import LendingTracker
from basin_runtime.gateway.limits import BodyBudget, Limits, read_body
from basin_runtime.gateway.measure import Meter, PromptMemo, message_digest
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.paths import forwarded_target
from basin_runtime.gateway.predictors import PREDICTED_TEXT_CHARS, Predictors, predict_peak
from basin_runtime.gateway.priority import ROUTING_KEY_HEADER, request_id, stamp
from basin_runtime.gateway.proxy import CallEnd, EndHook, Upstream
from basin_runtime.gateway.resend import RESEND_MIN_BYTES, read_resent
from basin_runtime.gateway.restart import Adoption, LiveSession, LiveSessions, LiveSessionsFile, prefix_digest
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.gateway.sessions import CallRecord, SessionEntry, session_id_for
from basin_runtime.gateway.waiting import Ended, EndReason, WaitingRoom
from basin_runtime.policy import DuplicateSessionError, PolicyError
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.session_keys import SESSION_KEY_HEADER, SessionKeys, incarnation
from basin_runtime.session_log import LoggedCall, SessionLogRecord
from basin_runtime.state.backend import StateHooks
from basin_runtime.state.signals import SignalReport

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


class Gateway:
    """Admits sessions through the waiting room and forwards their calls upstream."""

    def __init__(self, room: WaitingRoom, meter: Meter, predictors: Predictors, upstream: Upstream, *,
                 session_header: str = "X-Session-ID", workload_header: str = "X-Basin-Workload",
                 hit_window: HitRateWindow | None = None, lending: LendingTracker | None = None,
                 session_log: SessionLogWriter | None = None, is_shadow: bool = False,
                 engine_metrics_urls: Sequence[str] = (), engine_metrics_interval_s: float = 5.0,
                 live_sessions: LiveSessionsFile | None = None, adoption_window_s: float = 600.0,
                 limits: Limits | None = None, routing_key_header: str = ROUTING_KEY_HEADER,
                 coordinator: Coordinator | None = None, foreign_call: ForeignCall = "new-session") -> None:
        self.room = room
        self.meter = meter
        self.predictors = predictors
        self.upstream = upstream
        self.session_header = session_header
        self.workload_header = workload_header
        self.foreign_call = foreign_call
        self.routing_key_header = routing_key_header
        self.session_keys = SessionKeys()  # `create_app` derives them from its admin token
        self.metrics = GatewayMetrics()
        self.hit_window = hit_window or HitRateWindow()
        self.latency_window = LatencyWindow()
        self._awaiting_first_byte: dict[int, float] = {}  # id of a call in flight -> perf_counter when forwarded
        self.lending = lending or LendingTracker()
        self.session_log = session_log
        self.is_shadow = is_shadow
        self.limits = limits or Limits()
        self.bodies = BodyBudget(self.limits.max_body_bytes_in_flight)
        self.active_calls: set[asyncio.Task[Any]] = set()  # `app._InferencePath` keeps it; a shutdown cuts them
        self.is_cut = False
        self.engine_scraper = None if not engine_metrics_urls else EngineScraper(
            engine_metrics_urls, EngineHitWindow(self.hit_window.window_s, self.hit_window.min_prompt_tokens),
            room.clock.now, self.metrics.engine_scrape_errors, interval_s=engine_metrics_interval_s)
        self.live_sessions = live_sessions
        previous = LiveSessions({}) if live_sessions is None else live_sessions.read()
        self.adoption = Adoption(previous, room.clock.now(), adoption_window_s)
        if previous.sessions:
            logger.info("%d sessions live before the restart may be adopted within %.0f s (the run before %s)",
                        len(previous.sessions), adoption_window_s,
                        "shut down gracefully" if previous.is_logged else "was killed: they are logged whole here")
        room.hit_rate = self.hit_rate
        room.ttft = self.ttft_s
        room.on_session_end = self._session_ended
        room.on_admitted = self._session_admitted
        self.coordinator = coordinator
        if coordinator is not None:
            self._share(coordinator)

    def _share(self, coordinator: Coordinator) -> None:
        """Replicas: tick with the deployment's signals (the leader's), report this replica's, feed the metrics."""
        coordinator.report = self.signal_report
        self.room.hit_rate = lambda: coordinator.hit_rate
        self.room.ttft = lambda: coordinator.ttft_s
        m = self.metrics
        coordinator.backend.hooks = StateHooks(
            on_up=lambda is_up: m.state_up.set(1 if is_up else 0),
            on_error=lambda kind: m.state_errors.labels(kind).inc(),
            on_step_latency=m.state_step_seconds.observe, on_dropped=m.state_dropped.inc,
            on_apply_lag=m.state_apply_lag.observe)
        m.state_up.set(1 if coordinator.backend.is_up else 0)

    def signal_report(self) -> SignalReport:
        """This replica's windows, for the leader to combine into the deployment's signals."""
        now = self.room.clock.now()
        cached, prompt = self.hit_window.sums(now)
        engine = None if self.engine_scraper is None else self.engine_scraper.window.rate(now)
        started = time.perf_counter()
        waiting = [started - sent for sent in self._awaiting_first_byte.values()]
        return SignalReport.of(cached, prompt, engine, self.latency_window.values(now, waiting))

    def hit_rate(self) -> float | None:
        """The windowed prefix hit rate now (None: too little evidence).

        From the engines' /metrics counters when they are scraped and have evidence, else from the
        upstream's reported usage.
        """
        now = self.room.clock.now()
        if self.engine_scraper is not None:
            rate = self.engine_scraper.window.rate(now)
            if rate is not None:
                return rate
        return self.hit_window.rate(now)

    def ttft_s(self) -> float | None:
        """The engines' windowed median time to first token (calls still waiting for theirs counted; None: too
        few calls), as this gateway saw its forwarded calls' answers begin."""
        started = time.perf_counter()
        waiting = [started - sent for sent in self._awaiting_first_byte.values()]
        return self.latency_window.median_s(self.room.clock.now(), waiting)

    def refresh_metrics(self) -> None:
        """Set the state gauges from the policy (on a scrape and after each tick)."""
        self.metrics.refresh(self.room.policy.snapshot(), self.hit_rate(), self.is_shadow, self.ttft_s())
        backend = self.room.backend
        self.metrics.refresh_state(backend.is_up, backend.is_leader, backend.num_pending)
        if self.session_log is not None:
            self.metrics.log_failed.set(self.session_log.num_failed)
            self.metrics.log_dropped.set(self.session_log.num_dropped)

    async def handle(self, kind: CallKind, request: Request) -> Response:
        """Serve one inference call (its body held in the large-body budget until it has been forwarded)."""
        if self.room.is_draining:
            raise self.shutting_down("no new call is taken")
        arrived = time.perf_counter()
        hold = self.bodies.hold()
        try:
            raw = await read_body(request, self.limits.max_body_bytes, hold)
            return await self._serve(kind, request, raw, arrived)
        finally:
            hold.release()

    async def _serve(self, kind: CallKind, request: Request, raw: bytes, arrived: float) -> Response:
        call, (session_id, is_single_call) = await self._read(kind, raw, request.headers)
        if call.resent is not None and self.room.registry.get(session_id) is None:  # it ended meanwhile: read in full
            call, (session_id, is_single_call) = await _off_loop_if_large(len(raw), self._read_call, kind, raw,
                                                                          request.headers)
        entry, prompt_tokens, held_s = await self._admit(call, session_id, is_single_call, request)
        priority = self.room.registry.engine_priority(entry)
        rid = stamp(call.body, priority, None if call.is_batch else request_id(entry.routing_key, len(entry.calls)))
        headers = self._headers(entry, request)
        record = CallRecord(self.room.clock.wall(), prompt_tokens, rid, call.is_stream, engine_priority=priority)
        entry.calls.append(record)
        entry.in_flight += 1
        self.metrics.calls_in_flight.inc()
        end = _EndOnce(partial(self._call_ended, entry, record))
        try:  # from here every exit path ends the call exactly once, or the session could never be released
            drop_usage_chunk = _ask_for_usage(call)
            # the client's bytes in views, the gateway's fields beside them: O(1), unless a field the client sent
            # must be cut out (a scan of the body's top level)
            body = await _off_loop_if_large(call.num_bytes if call.sent else 0, call.encode_pieces)
            self.metrics.added_latency.observe(max(0.0, time.perf_counter() - arrived - held_s))
            self._awaiting_first_byte[id(record)] = time.perf_counter()
            response = await self.upstream.forward("POST", call.path, headers, body, request.receive,
                                                   on_end=end, drop_usage_chunk=drop_usage_chunk,
                                                   on_first_byte=partial(self._first_byte, record))
        except BaseException as exc:
            if not end.has_ended:
                if isinstance(exc, asyncio.CancelledError):
                    logger.info("call %s of session %r cut before its answer began", rid, entry.session_id)
                else:
                    logger.exception("call %s of session %r failed inside the gateway", rid, entry.session_id)
                await asyncio.shield(end(CallEnd("gateway_error")))
            raise
        if entry.session_id.isascii() and entry.session_id.isprintable():
            response.headers[self.session_header] = entry.session_id
        if not (entry.has_sent_key or entry.is_single_call):
            of = self.incarnation_of(entry.session_id)
            if of is not None:
                response.headers[SESSION_KEY_HEADER] = self.session_keys.key(entry.session_id, of)
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
        state = getattr(self.room.backend, "replicated", None)
        return state is not None and session_id in state.orphans

    async def pass_through(self, request: Request) -> Response:
        """Forward a read-only request (models, server info) without session accounting.

        Only the listed paths go upstream, exactly as the client encoded them, and only a well-formed target
        (`paths.forwarded_target`): no `.` or `..` segment, empty segment or encoded slash or backslash, so
        `/v1/models/../../workers` cannot reach the router's internals.
        """
        raw_path = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
        path, query = forwarded_target(raw_path.split(b"?", 1)[0], request.scope.get("query_string", b""))
        return await self.upstream.forward(request.method, path, request.headers, None, request.receive,
                                           params=query)

    async def end_session(self, session_id: str) -> Ended:
        """End a session on the client's or operator's word (shared state: held here or anywhere)."""
        return await self.room.end(session_id, "ended")

    async def save_live_sessions(self, *, is_logged: bool = False) -> None:
        """Write the live-sessions file if the live sessions or their calls changed (off the event loop; `is_logged`:
        their records so far are in the session log, a graceful shutdown's last write)."""
        if self.live_sessions is None:
            return
        live = [e for e in self.room.registry if e.state == "live" and not e.is_single_call]
        signature = (is_logged, frozenset((e.session_id, len(e.memo.keys), sum(c.ended_at is not None
                                                                              for c in e.calls)) for e in live))
        if not self.live_sessions.is_unchanged(signature):
            sessions = LiveSessions({e.session_id: _live_session(e) for e in live}, is_logged)
            await asyncio.to_thread(self.live_sessions.write, sessions, signature)

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
            await self.room.hand_over(self.adoption.window_s)
            for entry in held:
                self.room.leave(entry, "shutdown", "the replica shut down; handed over")
        else:
            for entry in held:
                await self.room.release(entry.session_id, "shutdown")
        if self.session_log is not None:
            await asyncio.to_thread(self.session_log.flush)
        if self.live_sessions is not None:
            await asyncio.to_thread(self.live_sessions.write, LiveSessions(snapshot, is_logged=True))
        if held:
            logger.info("shut down with %d sessions live: each logged as `shutdown`%s", len(held),
                        "" if self.live_sessions is None else f", listed in {self.live_sessions.path}")

    def _headers(self, entry: SessionEntry, request: Request) -> dict[str, str]:
        """The client's headers, its routing key (if any) replaced by the session's."""
        key_header = self.routing_key_header.lower()
        headers = {k: v for k, v in request.headers.items() if k.lower() != key_header}
        headers[self.routing_key_header] = entry.routing_key
        return headers

    async def _read(self, kind: CallKind, raw: bytes, headers: Mapping[str, str]) -> tuple[Call, tuple[str, bool]]:
        """The parsed call and its session: a known session's resent conversation from its new part on
        (`resend.py`; on the loop when that part and the prefix comparison are small), else the whole body."""
        if kind == "chat" and len(raw) >= RESEND_MIN_BYTES:
            entry = self.room.registry.get(headers.get(self.session_header, "").strip())
            base = None if entry is None else entry.memo.counts  # read once: another call may swap it
            if entry is not None and base is not None and base.prefix is not None:
                if len(raw) < OFF_LOOP_COPY_BYTES and len(raw) - base.prefix.end < OFF_LOOP_BODY_BYTES:
                    call = read_resent(raw, base, self.limits)
                else:
                    call = await asyncio.to_thread(read_resent, raw, base, self.limits)
                if call is not None:
                    return call, (entry.session_id, False)
        return await _off_loop_if_large(len(raw), self._read_call, kind, raw, headers)

    def _read_call(self, kind: CallKind, raw: bytes, headers: Mapping[str, str]) -> tuple[Call, tuple[str, bool]]:
        """The parsed call and its session (id, is a single call): one step, so a large body costs one thread
        hop for both (a conversation's hash reads its first messages)."""
        call = parse_call(kind, raw, self.limits)
        return call, session_id_for(call, headers, self.session_header, self.limits.max_session_id_chars)

    async def _admit(self, call: Call, session_id: str, is_single_call: bool,
                     request: Request) -> tuple[SessionEntry, int, float]:
        key = key_digest(request.headers)
        entry = self.room.registry.get(session_id)
        if entry is not None and not entry.is_single_call and not _continues(entry, call, key):
            call, session_id = await self._foreign(call, session_id, key, "its first messages or API key differ")
            entry = self.room.registry.get(session_id)
        is_new = False
        if entry is None and self.room.backend.is_shared and not is_single_call:
            entry = await self._take_over(session_id, call, request)
        if entry is None:
            try:
                entry, prompt_tokens, is_new = await self._arrive(session_id, is_single_call, call, request, key)
            except DuplicateSessionError:  # replicas: it arrived elsewhere a moment before; now this copy knows it
                if (entry := await self._take_over(session_id, call, request)) is None:
                    raise
                prompt_tokens = await _off_loop_if_large(call.read_bytes, self.meter.prompt_tokens, call, entry.memo)
        else:
            prompt_tokens = await _off_loop_if_large(call.read_bytes, self.meter.prompt_tokens, call, entry.memo)
        revision = None
        if not is_new and not entry.is_adopted and len(entry.calls) + 1 in self.predictors.revise_at_calls:
            revision = self.predictors.revision(
                entry.workload, entry.predicted_peak_tokens, [c.prompt_tokens for c in entry.calls] + [prompt_tokens],
                [c.completion_tokens or 0 for c in entry.calls])
        is_resumed = entry.is_adopted and entry.context_tokens != prompt_tokens  # its call past its listed context
        if (not is_new or is_resumed) and not await self.room.observe(entry, prompt_tokens, revision):
            raise SessionEndedError(f"session {session_id!r} ended while this call was being read; send it again")
        held_s = 0.0
        if entry.state == "queued" and (not entry.is_adopted or entry.is_held_for_growth):
            if self.is_shadow:
                self.metrics.shadow_held.inc()
            else:
                started = time.perf_counter()
                await self.room.wait(entry, request.receive)
                held_s = time.perf_counter() - started
        return entry, prompt_tokens, held_s

    async def _foreign(self, call: Call, session_id: str, key: bytes | None, why: str) -> tuple[Call, str]:
        """A call that does not continue the conversation its id names (`identity.py`): (the call, read in full,
        and the id of its own session), or the 409 under `--foreign-call refuse`."""
        if self.foreign_call == "refuse":
            raise refuse_foreign(session_id, why)
        if call.resent is not None:  # read against the other conversation's memo: read it whole, as its own
            call, _ = await _off_loop_if_large(call.num_bytes, self._read_call, call.kind, call.raw, {})
        heads = [message_digest(m) for m in call.messages[:head_length(call.messages)]] if call.messages else []
        own = derived_id(session_id, binding_of(call, key, heads))
        logger.info("a call under session id %r does not continue its conversation (%s): it goes on as session %r",
                    session_id, why, own)
        return call, own

    async def _take_over(self, session_id: str, call: Call, request: Request) -> SessionEntry | None:
        """Replicas: continue a session the shared state holds or let go; None if it knows no such session."""
        state = getattr(self.room.backend, "replicated", None)
        if state is None or not (state.is_held(session_id) or session_id in state.orphans):
            return None
        memo = PromptMemo()
        first = await _off_loop_if_large(call.num_bytes, self.meter.first_call, call, memo)
        model = call.body.get("model")
        return await self.room.take_over(session_id, first, workload=request.headers.get(self.workload_header) or None,
                                         memo=memo, model=model if isinstance(model, str) else None)

    async def _arrive(self, session_id: str, is_single_call: bool, call: Call, request: Request,
                      key: bytes | None) -> tuple[SessionEntry, int, bool]:
        workload = request.headers.get(self.workload_header) or None
        model = self.predictors.for_workload(workload)
        memo = PromptMemo()
        first = await _off_loop_if_large(call.num_bytes, self.meter.first_call, call, memo)
        binding = binding_of(call, key, memo.keys)
        previous = None
        listed = None if is_single_call else self.adoption.listed(session_id, self.room.clock.now())
        if listed is not None:
            if Adoption.continues(listed, call.is_continuation, memo.keys, key):
                previous = self.adoption.take(session_id)
            else:  # the listed entry stays for its owner (`restart.py`)
                if self.foreign_call == "refuse":
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
        if previous is not None and is_new and not self.adoption.is_logged:  # the last run was killed: log it whole
            entry.earlier = previous
            unrecorded = self.meter.unrecorded_calls(call, memo.counts, len(previous.calls))
            since = previous.calls[-1].ended_at if previous.calls else previous.started_at
            entry.unrecorded_calls = tuple(LoggedCall(since or previous.started_at, None, c.prompt_tokens,
                                                      c.completion_tokens) for c in unrecorded)
        return entry, first.prompt_tokens, is_new

    def _first_byte(self, record: CallRecord, ttft_s: float) -> None:
        self._awaiting_first_byte.pop(id(record), None)
        self.latency_window.record(self.room.clock.now(), max(0.0, ttft_s))

    async def _call_ended(self, entry: SessionEntry, record: CallRecord, end: CallEnd) -> None:
        self._awaiting_first_byte.pop(id(record), None)
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
                self.hit_window.record(now, usage.prompt_tokens or record.prompt_tokens, usage.cached_tokens)
        self.metrics.call_ended(end.outcome, usage)
        is_held = self.room.registry.get(entry.session_id) is entry
        if end.outcome == "completed" and not entry.is_single_call and is_held:
            moved = self.lending.call_finished(entry.session_id, record.served_by, record.cached_tokens,
                                               None if usage is None else usage.cached_tiers)
            if moved:
                self.metrics.calls_moved.inc()
        entry.in_flight -= 1
        self.metrics.calls_in_flight.dec()
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

    def _session_admitted(self, entry: SessionEntry, waited_s: float) -> None:
        self.metrics.session_admitted(waited_s)

    def _session_ended(self, entry: SessionEntry, reason: EndReason) -> None:
        self.metrics.session_ended(entry, reason)
        self.lending.session_ended(entry.session_id)
        if self.session_log is not None and entry.calls:
            self.session_log.append(log_record(entry, reason, self.room.clock.wall(), self.meter.tokenizer.name))


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


def log_record(entry: SessionEntry, reason: EndReason, ended_at: float, tokenizer: str) -> SessionLogRecord:
    """The session-log line of a finished session (unknown completion tokens are written as 0). A session adopted
    after a run that was killed is logged whole: the previous run's part, the calls only its conversation shows,
    then this run's (`restart.py`)."""
    calls = _logged_calls(entry)
    earlier = entry.earlier
    if earlier is not None:
        calls = earlier.calls + entry.unrecorded_calls + calls
    return SessionLogRecord(
        session_id=entry.session_id, model=entry.model or "unknown", tokenizer=tokenizer, task_text=entry.task_text,
        task_chars=len(entry.task_text), started_at=entry.started_at if earlier is None else earlier.started_at,
        ended_at=ended_at, end_reason=reason, calls=calls, workload=entry.workload,
        predicted_peak_tokens=entry.predicted_peak_tokens if earlier is None else earlier.predicted_peak_tokens,
        reserved_peak_tokens=entry.reserved_peak_tokens, adopted=entry.is_adopted and earlier is None,
    )


def _logged_calls(entry: SessionEntry) -> tuple[LoggedCall, ...]:
    return tuple(LoggedCall(c.started_at, c.ended_at, c.prompt_tokens, c.completion_tokens or 0, c.cached_tokens,
                            c.outcome) for c in entry.calls)


def _live_session(entry: SessionEntry) -> LiveSession:
    """What the next run needs of a live session: the conversation it last sent, its record so far (ended calls)."""
    earlier = entry.earlier
    own = tuple(c for c in _logged_calls(entry) if c.ended_at is not None)
    calls = own if earlier is None else earlier.calls + entry.unrecorded_calls + own
    keys = entry.memo.keys
    key = None if entry.binding is None or entry.binding.key is None else entry.binding.key.hex()
    return LiveSession(prefix_digest(keys), len(keys), entry.started_at if earlier is None else earlier.started_at,
                       entry.predicted_peak_tokens if earlier is None else earlier.predicted_peak_tokens,
                       entry.reserved_peak_tokens, len(entry.task_text), entry.model, entry.workload, calls, key)

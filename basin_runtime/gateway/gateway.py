# The request path: one inference call from the client to the upstream and back.
#
# Rules:
# - A call is parsed (400 if malformed), its session identified, then:
#   unknown session -> measured (task text, first prompt, prediction; in a worker thread, off the
#     event loop) and arrives at the policy; a continuation (assistant turns already present) is
#     adopted instead: it never waits, whatever the policy says;
#   known session -> the prompt size is observed (counting only the new messages).
#   A queued (not adopted) session's call then waits in the waiting room.
# - The forwarded body carries the session's priority and a rid (`priority.py`); the answer
#   carries the session id in the session header, so a client identified by hash can end it.
# - A call is in flight from forwarding until its answer ends (`proxy.py` reports the end);
#   idle time counts from the end of the last call. A single-call session ends with its call.
# - A call's record keeps the worker that served it when the router names it (smg does).
"""The gateway's request path: identify, admit or queue, stamp, forward, record."""

from __future__ import annotations

import asyncio
import json
import secrets
from functools import partial

from starlette.requests import Request
from starlette.responses import Response

from basin_runtime.gateway.calls import Call, CallKind, parse_call
from basin_runtime.gateway.errors import SessionEndedError
from basin_runtime.gateway.measure import FirstCall, Meter, PromptMemo
from basin_runtime.gateway.predictors import PeakModel, Predictors
from basin_runtime.gateway.priority import request_id, stamp
from basin_runtime.gateway.proxy import CallEnd, Upstream
from basin_runtime.gateway.sessions import CallRecord, SessionEntry, session_id_for
from basin_runtime.gateway.waiting import WaitingRoom

ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"  # smg's answer header: the worker (the decode one in PD) that served


class Gateway:
    """Admits sessions through the waiting room and forwards their calls upstream."""

    def __init__(self, room: WaitingRoom, meter: Meter, predictors: Predictors, upstream: Upstream, *,
                 session_header: str = "X-Session-ID", workload_header: str = "X-Basin-Workload") -> None:
        self.room = room
        self.meter = meter
        self.predictors = predictors
        self.upstream = upstream
        self.session_header = session_header
        self.workload_header = workload_header
        self.tag = secrets.token_hex(2)  # tells this gateway run's rids from an earlier run's

    async def handle(self, kind: CallKind, request: Request) -> Response:
        """Serve one inference call."""
        call = parse_call(kind, await request.body())
        entry, prompt_tokens = await self._admit(call, request)
        rid = stamp(call.body, entry.priority,
                    None if call.is_batch else request_id(self.tag, entry.session_id, len(entry.calls)))
        record = CallRecord(self.room.clock.wall(), prompt_tokens, rid, call.is_stream)
        entry.calls.append(record)
        entry.in_flight += 1
        body = json.dumps(call.body, ensure_ascii=False).encode("utf-8")
        response = await self.upstream.forward("POST", call.path, request.headers, body, request.receive,
                                               on_end=partial(self._call_ended, entry, record))
        if entry.session_id.isascii() and entry.session_id.isprintable():
            response.headers[self.session_header] = entry.session_id
        return response

    async def pass_through(self, request: Request) -> Response:
        """Forward a read-only request (models, server info) without session accounting."""
        return await self.upstream.forward(request.method, request.url.path, request.headers, None,
                                           request.receive, params=request.url.query)

    async def end_session(self, session_id: str) -> SessionEntry:
        """End a session on the client's or operator's word."""
        return await self.room.end(session_id, "ended")

    async def _admit(self, call: Call, request: Request) -> tuple[SessionEntry, int]:
        session_id, is_single_call = session_id_for(call, request.headers, self.session_header)
        entry = self.room.registry.get(session_id)
        is_new = False
        if entry is None:
            entry, prompt_tokens, is_new = await self._arrive(session_id, is_single_call, call, request)
        else:
            prompt_tokens = self.meter.prompt_tokens(call, entry.memo)
        if not is_new and not await self.room.observe(entry, prompt_tokens):
            raise SessionEndedError(f"session {session_id!r} ended while this call was being read; send it again")
        if entry.state == "queued" and not entry.is_adopted:
            await self.room.wait(entry, request.receive)
        return entry, prompt_tokens

    async def _arrive(self, session_id: str, is_single_call: bool, call: Call,
                      request: Request) -> tuple[SessionEntry, int, bool]:
        workload = request.headers.get(self.workload_header) or None
        model = self.predictors.for_workload(workload)
        memo = PromptMemo()
        first, peak = await asyncio.to_thread(self._predict, call, memo, model)
        entry, is_new = await self.room.arrive(session_id, first, peak, workload=workload, memo=memo,
                                               is_adopted=call.is_continuation, is_single_call=is_single_call)
        return entry, first.prompt_tokens, is_new

    def _predict(self, call: Call, memo: PromptMemo, model: PeakModel) -> tuple[FirstCall, float]:
        first = self.meter.first_call(call, memo)
        return first, model.predict(first.task_text, first.first_prompt_tokens)

    async def _call_ended(self, entry: SessionEntry, record: CallRecord, end: CallEnd) -> None:
        record.ended_at = self.room.clock.wall()
        record.outcome = end.outcome
        record.status_code = end.status_code
        record.served_by = end.upstream_headers.get(ROUTED_WORKER_HEADER)
        entry.in_flight -= 1
        entry.last_active_s = self.room.clock.now()
        if entry.is_single_call:
            await self.room.release(entry.session_id, "ended")

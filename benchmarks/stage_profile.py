"""The gateway's own steps for one call, timed one by one in this process (`bench_gateway.py`, item 4).

Each step is the code `Gateway.handle` and the SSE relay run for a session's later call, called the same
way on the same body, without the HTTP server, the upstream client or the event loop around them:

- parse: the body read as JSON and its shape checked (`parse_call`);
- identify: the session id from the header (`session_id_for`);
- count: the prompt's tokens, the session's memo holding its previous call (`Meter.prompt_tokens`);
- policy: the call's prompt size told to the waiting room and the policy, its engine priority;
- serialise: the body to forward (priority, rid, stream_options spliced in) and the upstream's headers;
- relay: the upstream's answer framed and read for usage (SSE: the stand-in worker's events, one per chunk);
- metrics: the call's counters, histograms and latency windows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import ClassVar

from basin_runtime.clock import MonotonicClock
from basin_runtime.gateway.calls import parse_call
from basin_runtime.gateway.gateway import _ask_for_usage
from basin_runtime.gateway.measure import Meter, PromptMemo
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.priority import request_id, stamp
from basin_runtime.gateway.proxy import EVENT_BYTES, _request_headers, _usage_of_json
from basin_runtime.gateway.sessions import session_id_for
from basin_runtime.gateway.signals import Usage
from basin_runtime.gateway.sse import SseEvents, SseFramer
from basin_runtime.gateway.waiting import WaitingRoom
from basin_runtime.policy import Policy, PolicyConfig
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer

HEADERS = {"host": "127.0.0.1", "content-type": "application/json", "content-length": "1000",
           "x-session-id": "bench-1"}


def sse_chunks(prompt_tokens: int) -> list[bytes]:
    """The stand-in worker's streamed answer (`tests/e2e/standin_worker.py`), one event per chunk."""
    base = {"id": "cmpl-standin", "object": "chat.completion.chunk", "created": 1, "model": "standin-model"}
    out = []
    for k, piece in enumerate(("stand-in ", "streamed ", "answer")):
        delta = {"role": "assistant", "content": piece} if k == 0 else {"content": piece}
        out.append({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    out.append({**base, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                                 "total_tokens": prompt_tokens + 3,
                                                 "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}})
    return [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in out] + [b"data: [DONE]\n\n"]


class _Answer:
    """What `_usage_of_json` reads of a whole upstream answer."""

    status_code = 200
    headers: ClassVar[dict[str, str]] = {"content-type": "application/json"}
    url = "http://upstream"


async def profile_call(previous: bytes, raw: bytes, stream: bool, repeat: int) -> dict[str, float]:
    """Microseconds per step (median of `repeat` rounds) of a call with body `raw` after one with `previous`."""
    meter = Meter(get_tokenizer(), TaskTextRule())
    room = WaitingRoom(Policy(PolicyConfig(budget_tokens=10**12)), MonotonicClock(), retry_after_s=30)
    metrics = GatewayMetrics()
    hits, latency = HitRateWindow(60.0, 0), LatencyWindow()
    primed = PromptMemo()
    first = meter.first_call(parse_call("chat", previous), primed)
    entry, _ = await room.arrive("bench-1", first, 50_000.0, workload=None, memo=primed)
    chunks = sse_chunks(first.prompt_tokens)
    answer = json.dumps({"id": "c", "object": "chat.completion", "choices": [], "usage": {
        "prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 80}}}).encode()
    spans: dict[str, list[int]] = {name: [] for name in
                                   ("parse", "identify", "count", "policy", "serialise", "relay", "metrics")}

    def timed(name: str, step: Callable[[], object]) -> object:
        started = time.perf_counter_ns()
        out = step()
        spans[name].append(time.perf_counter_ns() - started)
        return out

    async def one_call() -> None:
        call = timed("parse", lambda: parse_call("chat", raw))
        timed("identify", lambda: session_id_for(call, HEADERS.get("x-session-id", ""), "x-session-id"))
        entry.memo.counts = primed.counts
        tokens = timed("count", lambda: meter.prompt_tokens(call, entry.memo))
        started = time.perf_counter_ns()
        await room.observe(entry, tokens)
        priority = room.registry.engine_priority(entry)
        spans["policy"].append(time.perf_counter_ns() - started)

        def serialise() -> tuple[bytes, dict[str, str], bool]:
            stamp(call.body, priority, request_id(entry.routing_key, len(entry.calls)))
            drop = _ask_for_usage(call)
            headers = {k: v for k, v in HEADERS.items() if k != "x-smg-routing-key"}
            headers["x-smg-routing-key"] = entry.routing_key
            return call.encode(), _request_headers(headers), drop

        _, _, drop = timed("serialise", serialise)

        def relay() -> Usage | None:
            if not stream:
                return _usage_of_json(_Answer(), answer)  # type: ignore[arg-type]
            framer, events = SseFramer(EVENT_BYTES), SseEvents(drop)
            for chunk in chunks:
                events.pass_on(framer.feed(chunk))
            return events.usage()

        usage = timed("relay", relay)

        def account() -> None:
            now = room.clock.now()
            metrics.added_latency.observe(0.0005)
            metrics.calls_in_flight.inc()
            latency.record(now, 0.001)
            assert usage is None or isinstance(usage, Usage)
            if usage is not None and usage.cached_tokens is not None:
                hits.record(now, usage.prompt_tokens or tokens, usage.cached_tokens)
            metrics.call_ended("completed", usage)
            metrics.calls_in_flight.dec()

        timed("metrics", account)

    for _ in range(repeat):
        await one_call()
    return {name: sorted(ns)[len(ns) // 2] / 1000 for name, ns in spans.items()}

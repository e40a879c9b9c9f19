# Forwarding to the upstream (the SGLang router, or one server), streaming the answer through.
#
# Rules:
# - The upstream client is an injected `UpstreamClient` (`upstream.py`: aiohttp by default, or httpx;
#   an `httpx.AsyncClient` given here is wrapped) whose base URL is the upstream; its timeouts are the
#   gateway's. Nothing else in the gateway talks to the upstream.
# - Request headers: the client's end-to-end headers go through, `Authorization` included; hop-by-hop
#   headers, `Host` and `Content-Length` do not (the body may have been rewritten), and the gateway
#   asks for `Accept-Encoding: identity`. A header whose name is not an HTTP token or whose value is
#   not printable ASCII (non-ASCII bytes, control characters: neither upstream client can send them
#   as received) is not forwarded either (logged at debug level).
# - An SSE answer, or one without a small `Content-Length`, streams through chunk by chunk as it
#   arrives: never buffered whole. A non-SSE answer with `Content-Length` up to `WHOLE_BODY_BYTES` is
#   read whole and sent in one piece (`WholeUpstreamResponse`: no streaming machinery per call; a
#   failure while reading it is then a 502 instead of a cut stream). Answers are passed on decoded
#   (a `Content-Encoding` the upstream applied anyway is undone and dropped).
# - Before the answer's head arrives, the client is watched: if it leaves, the upstream request is
#   cancelled. Failures then: cannot connect -> `UpstreamRefusedError`; timeout ->
#   `UpstreamTimeoutError`; a 5xx -> `UpstreamStatusError` with the start of the upstream's body.
#   A 4xx passes through unchanged (the client's own mistake, in the upstream's words).
# - `on_end(CallEnd)` is called exactly once per forwarded call: when the body has been sent, when
#   the client disconnects, or when the upstream fails (before or during the body). It carries the
#   upstream's status and headers (smg names the worker that answered there), and the call's usage.
# - Usage (`signals.py`): a JSON answer is copied aside as it streams (up to `USAGE_BODY_BYTES`) and
#   parsed at its end; an SSE answer is framed into events (`\n\n`-separated, as SGLang writes them)
#   and the last one carrying `usage` or `meta_info` is parsed at the end. When the gateway itself
#   added `stream_options.include_usage` (`drop_usage_chunk`), the final usage-only chunk (empty
#   `choices`) is not passed on: the client did not ask for it, and SGLang would not have sent it.
# - A failure the upstream reports inside an SSE answer (an event `data: {"error": {...}}`: smg writes
#   one, then `[DONE]`, when the engine it streams from dies mid-answer; SGLang does the same for an
#   aborted request) is passed on to the client as written, and the call ends as `upstream_error`,
#   not `completed`, although the stream itself ended cleanly.
"""Upstream forwarding, streaming the answer back chunk by chunk."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio
import httpx
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from basin_runtime.disconnect import race_client
from basin_runtime.gateway.errors import (
    ClientGoneError,
    UpstreamError,
    UpstreamRefusedError,
    UpstreamStatusError,
    UpstreamTimeoutError,
)
from basin_runtime.gateway.sessions import CallOutcome
from basin_runtime.gateway.signals import Usage, usage_of_bytes
from basin_runtime.gateway.upstream import HttpxUpstreamClient, UpstreamAnswer, UpstreamBrokenError, UpstreamClient

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class CallEnd:
    """How a forwarded call ended."""

    outcome: CallOutcome
    status_code: int | None = None
    upstream_headers: Mapping[str, str] = field(default_factory=dict)
    usage: Usage | None = None


EndHook = Callable[[CallEnd], Awaitable[None]]
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)
NOT_SENT = HOP_BY_HOP | {"accept-encoding", "expect"}  # the gateway asks for identity; the body is already here
# Not passed back: hop-by-hop, what the gateway's own server sets, and the encoding undone here.
NOT_RETURNED = HOP_BY_HOP | {"date", "server", "content-encoding"}
ERROR_BODY_BYTES = 4096
WHOLE_BODY_BYTES = 1 << 20  # a non-SSE answer with a Content-Length up to this is read whole, then sent
USAGE_BODY_BYTES = 4 << 20  # a longer JSON answer is passed on but its usage is not read
USAGE_EVENT = re.compile(rb'"usage"\s*:\s*\{|"meta_info"\s*:')
ERROR_KEY = b'"error"'  # in an SSE event: maybe an error event (a JSON string holds it only as \"error\")


async def _no_end(end: CallEnd) -> None:
    """The end hook of calls nobody accounts for (pass-through endpoints)."""


class Upstream:
    """Sends requests to the upstream and streams its answers back."""

    def __init__(self, client: UpstreamClient | httpx.AsyncClient) -> None:
        self.client: UpstreamClient = HttpxUpstreamClient(client) if isinstance(client, httpx.AsyncClient) else client

    async def start(self) -> None:
        """Get the client ready (on the running loop: the app's lifespan)."""
        await self.client.start()

    async def aclose(self) -> None:
        """Close the client."""
        await self.client.aclose()

    async def forward(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                      receive: Receive, on_end: EndHook = _no_end, params: str = "", *,
                      drop_usage_chunk: bool = False) -> Response:
        """Send one request upstream and return its answer as a streaming response."""
        try:
            response = await race_client(self.client.send(method, path, _request_headers(headers), body, params),
                                         receive, ClientGoneError)
        except ClientGoneError:
            await on_end(CallEnd("client_gone"))
            raise
        except (UpstreamTimeoutError, UpstreamRefusedError):
            await on_end(CallEnd("upstream_error"))
            raise
        if response.status_code >= 500:
            text = await _read_start(response)
            await on_end(CallEnd("upstream_error", response.status_code, response.headers))
            raise UpstreamStatusError(response.status_code, text)
        length = _whole_length(response)
        if length is not None:
            try:
                body = await response.read(length)
            except UpstreamBrokenError as exc:
                await on_end(CallEnd("upstream_error", response.status_code, response.headers))
                raise UpstreamError(f"upstream {response.url} failed mid-answer: {exc}") from exc
            finally:
                await response.aclose()
            return WholeUpstreamResponse(body, response.status_code, response.headers, on_end)
        return UpstreamResponse(response, on_end, drop_usage_chunk=drop_usage_chunk)


def _answered(status_code: int) -> CallOutcome:
    """A call answered in full: `completed`, or `rejected` when the upstream refused it (4xx: a bad
    parameter, a rate limit), which must not count as served work nor leave context to lend."""
    return "rejected" if 400 <= status_code < 500 else "completed"


def _whole_length(response: UpstreamAnswer) -> int | None:
    """The body length of an answer to read whole: not SSE, with a small Content-Length; else None."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return None
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        return None  # the decoded length is unknown
    try:
        length = int(response.headers.get("content-length", ""))
    except ValueError:
        return None
    return length if 0 <= length <= WHOLE_BODY_BYTES else None


class WholeUpstreamResponse(Response):
    """An upstream answer read whole, sent in one piece; ends the call exactly once."""

    def __init__(self, body: bytes, status_code: int, upstream_headers: Mapping[str, str], on_end: EndHook) -> None:
        self._upstream_headers = upstream_headers
        self._on_end = on_end
        self._usage = usage_of_bytes(body)
        super().__init__(body, status_code=status_code, headers=_response_headers(upstream_headers))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: CallOutcome = "client_gone"
        try:
            await super().__call__(scope, receive, send)
            outcome = _answered(self.status_code)
        except (ClientDisconnect, OSError):
            outcome = "client_gone"
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end(CallEnd(outcome, self.status_code, self._upstream_headers, self._usage))


class UpstreamResponse(StreamingResponse):
    """The upstream's answer, passed through as its bytes arrive; ends the call exactly once."""

    def __init__(self, upstream: UpstreamAnswer, on_end: EndHook, *, drop_usage_chunk: bool = False) -> None:
        self._upstream = upstream
        self._on_end = on_end
        self._is_complete = False
        self._usage: Usage | None = None
        self._error: str | None = None  # the first error event of an SSE answer
        self._drop_usage_chunk = drop_usage_chunk
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self._chunks = self._relay_sse() if is_sse else self._relay()
        super().__init__(self._chunks, status_code=upstream.status_code, headers=_response_headers(upstream.headers))

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        body = bytearray()
        async for chunk in self._upstream.chunks():
            if len(body) <= USAGE_BODY_BYTES:
                body += chunk
            yield chunk
        if len(body) <= USAGE_BODY_BYTES:
            self._usage = usage_of_bytes(bytes(body))
        self._is_complete = True

    async def _relay_sse(self) -> AsyncGenerator[bytes, None]:
        pending = b""
        last_usage_event: bytes | None = None
        async for chunk in self._upstream.chunks():
            if not self._drop_usage_chunk:
                yield chunk
            *events, pending = (pending + chunk).split(b"\n\n")
            passed = []
            for event in events:
                if self._error is None and ERROR_KEY in event:
                    self._error = _error_of_event(event)
                if USAGE_EVENT.search(event) is not None:
                    last_usage_event = event
                    if self._drop_usage_chunk and _is_usage_only(event):
                        continue
                passed.append(event + b"\n\n")
            if self._drop_usage_chunk and passed:
                yield b"".join(passed)
        if self._drop_usage_chunk and pending:
            yield pending
        if last_usage_event is not None:
            self._usage = usage_of_bytes(last_usage_event)
        self._is_complete = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: CallOutcome = "client_gone"
        try:
            await super().__call__(scope, receive, send)
            if not self._is_complete:
                outcome = "client_gone"
            elif self._error is not None:  # the upstream failed and said so in the stream
                outcome = "upstream_error"
                logger.warning("upstream %s reported a failure mid-answer: %s", self._upstream.url, self._error)
            else:
                outcome = _answered(self.status_code)
        except (ClientDisconnect, OSError):
            outcome = "client_gone"
        except UpstreamBrokenError as exc:  # the upstream failed mid-answer; the client sees a cut stream
            outcome = "upstream_error"
            logger.warning("upstream %s failed mid-answer: %s: %s", self._upstream.url, type(exc).__name__, exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._upstream.aclose()
                await self._on_end(CallEnd(outcome, self.status_code, self._upstream.headers, self._usage))


def _event_json(event: bytes) -> object:
    """The JSON of one SSE event's `data:` payload, or None if it is not JSON."""
    text = event.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _error_of_event(event: bytes) -> str | None:
    """The message of an SSE error event (`data: {"error": {...}}`), else None."""
    chunk = _event_json(event)
    error = chunk.get("error") if isinstance(chunk, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:ERROR_BODY_BYTES]
    return error[:ERROR_BODY_BYTES] if isinstance(error, str) and error else None


def _is_usage_only(event: bytes) -> bool:
    """True for the final chunk `include_usage` adds: usage and an empty `choices` list."""
    chunk = _event_json(event)
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


async def _read_start(response: UpstreamAnswer) -> str:
    try:
        data = await response.read(ERROR_BODY_BYTES)
    except UpstreamBrokenError as exc:
        data = f" [reading the error body failed: {exc}]".encode()
    finally:
        await response.aclose()
    return data[:ERROR_BODY_BYTES].decode("utf-8", errors="replace").strip() or response.reason


def _request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    kept = {}
    for name, value in headers.items():
        if name.lower() in NOT_SENT:
            continue
        if _TOKEN.fullmatch(name) is None or not (value.isascii() and value.replace("\t", " ").isprintable()):
            logger.debug("header %r not forwarded: not an HTTP token name and printable ASCII value", name[:80])
            continue
        kept[name] = value
    kept["accept-encoding"] = "identity"
    return kept


def _response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in NOT_RETURNED}

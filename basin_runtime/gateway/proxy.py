# Forwarding to the upstream (the SGLang router, or one server), streaming the answer through.
#
# Rules:
# - The upstream client is an injected `httpx.AsyncClient` whose base URL is the upstream; its
#   timeouts are the gateway's. Nothing else in the gateway talks to the upstream.
# - Request headers: the client's end-to-end headers go through, `Authorization` included; hop-by-hop
#   headers, `Host` and `Content-Length` do not (the body may have been rewritten), and the gateway
#   asks for `Accept-Encoding: identity`.
# - The answer streams through chunk by chunk as it arrives (SSE or not): never buffered whole. It
#   is passed on decoded (a `Content-Encoding` the upstream applied anyway is undone and dropped).
# - Before the answer's head arrives, the client is watched: if it leaves, the upstream request is
#   cancelled. Failures then: cannot connect -> `UpstreamRefusedError`; timeout ->
#   `UpstreamTimeoutError`; a 5xx -> `UpstreamStatusError` with the start of the upstream's body.
#   A 4xx passes through unchanged (the client's own mistake, in the upstream's words).
# - `on_end(CallEnd)` is called exactly once per forwarded call: when the body has been sent, when
#   the client disconnects, or when the upstream fails (before or during the body). It carries the
#   upstream's status and headers (smg names the worker that answered there), and the call's usage.
# - The upstream client's connections are spread over several pools (`ShardedTransport`): httpcore's
#   pool does work proportional to (connections x waiting requests) on every request, which at 200
#   concurrent calls cost more CPU than everything else the gateway does.
# - Usage (`signals.py`): a JSON answer is copied aside as it streams (up to `USAGE_BODY_BYTES`) and
#   parsed at its end; an SSE answer is framed into events (`\n\n`-separated, as SGLang writes them)
#   and the last one carrying `usage` or `meta_info` is parsed at the end. When the gateway itself
#   added `stream_options.include_usage` (`drop_usage_chunk`), the final usage-only chunk (empty
#   `choices`) is not passed on: the client did not ask for it, and SGLang would not have sent it.
"""Upstream forwarding, streaming the answer back chunk by chunk."""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio
import httpx
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from basin_runtime.gateway.disconnect import race_client
from basin_runtime.gateway.errors import (
    ClientGoneError,
    UpstreamRefusedError,
    UpstreamStatusError,
    UpstreamTimeoutError,
)
from basin_runtime.gateway.sessions import CallOutcome
from basin_runtime.gateway.signals import Usage, usage_of_bytes

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
NOT_SENT = HOP_BY_HOP | {"accept-encoding", "expect"}  # the gateway asks for identity; the body is already here
# Not passed back: hop-by-hop, what the gateway's own server sets, and the encoding undone here.
NOT_RETURNED = HOP_BY_HOP | {"date", "server", "content-encoding"}
ERROR_BODY_BYTES = 4096
USAGE_BODY_BYTES = 4 << 20  # a longer JSON answer is passed on but its usage is not read
USAGE_EVENT = re.compile(rb'"usage"\s*:\s*\{|"meta_info"\s*:')


class ShardedTransport(httpx.AsyncBaseTransport):
    """Round-robin over `num_shards` connection pools, each small enough for httpcore's pool bookkeeping."""

    def __init__(self, num_shards: int = 16, limits: httpx.Limits | None = None) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # a request's head and body go out at once
        self._shards = [httpx.AsyncHTTPTransport(limits=limits or httpx.Limits(), socket_options=options)
                        for _ in range(num_shards)]
        self._next = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send the request on the next pool."""
        shard = self._shards[self._next]
        self._next = (self._next + 1) % len(self._shards)
        return await shard.handle_async_request(request)

    async def aclose(self) -> None:
        """Close every pool."""
        for shard in self._shards:
            await shard.aclose()


async def _no_end(end: CallEnd) -> None:
    """The end hook of calls nobody accounts for (pass-through endpoints)."""


class Upstream:
    """Sends requests to the upstream and streams its answers back."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def forward(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                      receive: Receive, on_end: EndHook = _no_end, params: str = "", *,
                      drop_usage_chunk: bool = False) -> StreamingResponse:
        """Send one request upstream and return its answer as a streaming response."""
        request = self.client.build_request(method, path, headers=_request_headers(headers), content=body,
                                            params=httpx.QueryParams(params))
        try:
            response = await race_client(self.client.send(request, stream=True), receive)
        except ClientGoneError:
            await on_end(CallEnd("client_gone"))
            raise
        except httpx.TimeoutException as exc:
            await on_end(CallEnd("upstream_error"))
            raise UpstreamTimeoutError(f"upstream {request.url} did not answer in time "
                                       f"({type(exc).__name__}: {exc or 'no detail'})") from exc
        except httpx.TransportError as exc:
            await on_end(CallEnd("upstream_error"))
            raise UpstreamRefusedError(f"cannot reach upstream {request.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            text = await _read_start(response)
            await on_end(CallEnd("upstream_error", response.status_code, response.headers))
            raise UpstreamStatusError(response.status_code, text)
        return UpstreamResponse(response, on_end, drop_usage_chunk=drop_usage_chunk)


class UpstreamResponse(StreamingResponse):
    """The upstream's answer, passed through as its bytes arrive; ends the call exactly once."""

    def __init__(self, upstream: httpx.Response, on_end: EndHook, *, drop_usage_chunk: bool = False) -> None:
        self._upstream = upstream
        self._on_end = on_end
        self._is_complete = False
        self._usage: Usage | None = None
        self._drop_usage_chunk = drop_usage_chunk
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self._chunks = self._relay_sse() if is_sse else self._relay()
        super().__init__(self._chunks, status_code=upstream.status_code, headers=_response_headers(upstream.headers))

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        body = bytearray()
        async for chunk in self._upstream.aiter_bytes():
            if len(body) <= USAGE_BODY_BYTES:
                body += chunk
            yield chunk
        if len(body) <= USAGE_BODY_BYTES:
            self._usage = usage_of_bytes(bytes(body))
        self._is_complete = True

    async def _relay_sse(self) -> AsyncGenerator[bytes, None]:
        pending = b""
        last_usage_event: bytes | None = None
        async for chunk in self._upstream.aiter_bytes():
            if not self._drop_usage_chunk:
                yield chunk
            *events, pending = (pending + chunk).split(b"\n\n")
            passed = []
            for event in events:
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
            outcome = "completed" if self._is_complete else "client_gone"
        except (ClientDisconnect, OSError):
            outcome = "client_gone"
        except httpx.HTTPError as exc:  # the upstream failed mid-answer; the client sees a cut stream
            outcome = "upstream_error"
            logger.warning("upstream %s failed mid-answer: %s: %s", self._upstream.url, type(exc).__name__, exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._upstream.aclose()
                await self._on_end(CallEnd(outcome, self.status_code, self._upstream.headers, self._usage))


def _is_usage_only(event: bytes) -> bool:
    """True for the final chunk `include_usage` adds: usage and an empty `choices` list."""
    text = event.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    try:
        chunk = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


async def _read_start(response: httpx.Response) -> str:
    data = b""
    try:
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) >= ERROR_BODY_BYTES:
                break
    except httpx.HTTPError as exc:
        data += f" [reading the error body failed: {exc}]".encode()
    finally:
        await response.aclose()
    return data[:ERROR_BODY_BYTES].decode("utf-8", errors="replace").strip() or response.reason_phrase


def _request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    kept = {k: v for k, v in headers.items() if k.lower() not in NOT_SENT}
    kept["accept-encoding"] = "identity"
    return kept


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in NOT_RETURNED}

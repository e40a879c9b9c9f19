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
#   upstream's status and headers (smg names the worker that answered there).
"""Upstream forwarding, streaming the answer back chunk by chunk."""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class CallEnd:
    """How a forwarded call ended."""

    outcome: CallOutcome
    status_code: int | None = None
    upstream_headers: Mapping[str, str] = field(default_factory=dict)


EndHook = Callable[[CallEnd], Awaitable[None]]
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
NOT_SENT = HOP_BY_HOP | {"accept-encoding", "expect"}  # the gateway asks for identity; the body is already here
# Not passed back: hop-by-hop, what the gateway's own server sets, and the encoding undone here.
NOT_RETURNED = HOP_BY_HOP | {"date", "server", "content-encoding"}
ERROR_BODY_BYTES = 4096


async def _no_end(end: CallEnd) -> None:
    """The end hook of calls nobody accounts for (pass-through endpoints)."""


class Upstream:
    """Sends requests to the upstream and streams its answers back."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def forward(self, method: str, path: str, headers: Mapping[str, str], body: bytes | None,
                      receive: Receive, on_end: EndHook = _no_end, params: str = "") -> StreamingResponse:
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
        return UpstreamResponse(response, on_end)


class UpstreamResponse(StreamingResponse):
    """The upstream's answer, passed through as its bytes arrive; ends the call exactly once."""

    def __init__(self, upstream: httpx.Response, on_end: EndHook) -> None:
        self._upstream = upstream
        self._on_end = on_end
        self._is_complete = False
        self._chunks = self._relay()
        super().__init__(self._chunks, status_code=upstream.status_code, headers=_response_headers(upstream.headers))

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        async for chunk in self._upstream.aiter_bytes():
            yield chunk
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
                await self._on_end(CallEnd(outcome, self.status_code, self._upstream.headers))


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

"""The seam between the gateway and its upstream: the `UpstreamClient` protocol and what every client shares.

Rules:
- A request body is one buffer, or pieces sent one after another (`RequestBody`): the gateway forwards a
  large body as the client's bytes with its own fields around them, never joined into a copy.
- `UpstreamClient.send(method, path, headers, body, params)` sends one request and returns an
  `UpstreamAnswer` once its head has arrived: status, headers, and the body either whole
  (`read(limit)`) or chunk by chunk as it arrives (`chunks()`, never buffered: SSE goes through as
  written). `aclose()` on the answer gives its connection back (or drops it, when the body was not
  read to its end); it is safe to call more than once. An answer may also say `is_received` (optional):
  its whole body has arrived, so the rest of `chunks()` comes without waiting.
- Failures before the head: cannot connect (or any transport failure) -> `UpstreamRefusedError`;
  no connection or bytes in time -> `UpstreamTimeoutError`. Failures while reading the body ->
  `UpstreamBrokenError` (`is_timeout` when no bytes came within the read timeout, which holds mid-body
  too). Cancelling `send` (the client left) releases the connection.
- Timeouts: `connect_s` to connect, `read_s` the longest wait for the next upstream bytes (so a long
  SSE answer is never cut while tokens keep coming); `read_timeout_s` says which (None: no limit).
- The one production client is `http1.Http1UpstreamClient` (asyncio protocols and httptools' parser);
  tests may put a double behind the same protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Protocol

RequestBody = bytes | tuple[bytes | memoryview, ...]  # one buffer, or pieces of bytes sent in order


def body_size(body: RequestBody) -> int:
    """The bytes of a request body, one buffer or pieces (byte views: a view's length is its bytes)."""
    return len(body) if isinstance(body, bytes) else sum(len(piece) for piece in body)


def joined(body: RequestBody) -> bytes:
    """A request body in one buffer (pieces joined: a copy)."""
    return body if isinstance(body, bytes) else b"".join(body)


class UpstreamBrokenError(Exception):
    """The upstream failed while its body was being read (the head had arrived)."""

    def __init__(self, message: str, *, is_timeout: bool = False) -> None:
        super().__init__(message)
        self.is_timeout = is_timeout  # no bytes within the read timeout (else: reset, closed early, bad framing)


class UpstreamAnswer(Protocol):
    """The head of an upstream answer, and its body to read."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def reason(self) -> str: ...

    @property
    def url(self) -> str: ...

    def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body, chunk by chunk as it arrives; `UpstreamBrokenError` if the upstream fails."""
        ...

    async def read(self, limit: int) -> bytes:
        """The body's first `limit` bytes (or all of a shorter body)."""
        ...

    async def aclose(self) -> None:
        """Release the connection (dropped if the body was not read to its end)."""
        ...


class UpstreamClient(Protocol):
    """Sends requests to one upstream base URL."""

    @property
    def base_url(self) -> str: ...

    @property
    def is_closed(self) -> bool: ...

    @property
    def read_timeout_s(self) -> float | None:
        """The longest wait for the next upstream bytes (None: no limit)."""
        ...

    async def start(self) -> None:
        """Get ready to send (on the running loop)."""
        ...

    async def send(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                   params: str = "") -> UpstreamAnswer:
        """Send one request; return once the answer's head has arrived."""
        ...

    async def aclose(self) -> None:
        """Close every connection."""
        ...


async def read_upto(chunks: AsyncGenerator[bytes, None], limit: int) -> bytes:
    """A body's first `limit` bytes (or all of a shorter one) from its chunks, joined once."""
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
    finally:
        await chunks.aclose()
    data = b"".join(parts)
    return data if len(data) <= limit else data[:limit]

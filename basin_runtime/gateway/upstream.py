# The HTTP client to the upstream, behind one small protocol, with three implementations.
#
# Rules:
# - A request body is one buffer, or pieces sent one after another (`RequestBody`): the gateway forwards a
#   large body as the client's bytes with its own fields around them, never joined into a copy (the gateway's
#   own client writes the pieces as they are; aiohttp and httpx get them joined).
# - `UpstreamClient.send(method, path, headers, body, params)` sends one request and returns an
#   `UpstreamAnswer` once its head has arrived: status, headers, and the body either whole
#   (`read(limit)`) or chunk by chunk as it arrives (`chunks()`, never buffered: SSE goes through as
#   written). `aclose()` on the answer gives its connection back (or drops it, when the body was not
#   read to its end); it is safe to call more than once. An answer may also say `is_received` (optional,
#   the gateway's own client does): its whole body has arrived, so the rest of `chunks()` comes without waiting.
# - Failures before the head: cannot connect (or any transport failure) -> `UpstreamRefusedError`;
#   no connection or bytes in time -> `UpstreamTimeoutError`. Failures while reading the body ->
#   `UpstreamBrokenError` (`is_timeout` when no bytes came within the read timeout: with both
#   clients the read timeout holds mid-body too). Cancelling `send` (the client left) releases the
#   connection.
# - Timeouts: `connect_s` to connect, `read_s` the longest wait for the next upstream bytes (so a long
#   SSE answer is never cut while tokens keep coming); `read_timeout_s` says which (None: no limit).
# - `http1.Http1UpstreamClient` ("httptools", the default for a real upstream) is the gateway's own
#   HTTP/1.1 client on asyncio protocols and httptools' parser: the least CPU per call.
# - `AiohttpUpstreamClient` makes its `aiohttp.ClientSession` in
#   `start()`, on the running loop (the app's lifespan), and closes it in `aclose()`.
#   `HttpxUpstreamClient` wraps an `httpx.AsyncClient` (the unit tests inject `httpx.MockTransport`).
#   httpx's pool costs CPU proportional to (connections x waiting requests) per request: at 200
#   concurrent calls it is roughly 10x slower than aiohttp on the same machine.
"""The upstream HTTP client protocol, and its aiohttp and httpx implementations."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from typing import Protocol

import aiohttp
import httpx

from basin_runtime.gateway.errors import UpstreamRefusedError, UpstreamTimeoutError

KEEPALIVE_S = 2.0  # idle connections dropped before uvicorn's (SGLang's server's) 5 s keep-alive closes them
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


class ClientState:
    """What a client says of itself: the upstream's base URL, and whether `aclose` was called."""

    _base_url: str
    _is_closed: bool

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def is_closed(self) -> bool:
        return self._is_closed


# --- httpx ---------------------------------------------------------------------------------------


class HttpxAnswer:
    """An `httpx.Response` opened with `stream=True`."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    @property
    def reason(self) -> str:
        return self._response.reason_phrase

    @property
    def url(self) -> str:
        return str(self._response.url)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamBrokenError(f"{type(exc).__name__}: {exc or 'no detail'}",
                                      is_timeout=isinstance(exc, httpx.TimeoutException)) from exc

    async def read(self, limit: int) -> bytes:
        return await read_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstreamClient:
    """`UpstreamClient` over an `httpx.AsyncClient` whose base URL is the upstream."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @classmethod
    def for_url(cls, base_url: str, *, connect_s: float, read_s: float) -> HttpxUpstreamClient:
        """A client of its own to `base_url`, with these timeouts and no connection cap."""
        timeout = httpx.Timeout(read_s, connect=connect_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=KEEPALIVE_S)
        return cls(httpx.AsyncClient(base_url=base_url, timeout=timeout, trust_env=False, limits=limits))

    @property
    def base_url(self) -> str:
        return str(self.client.base_url)

    @property
    def is_closed(self) -> bool:
        return self.client.is_closed

    @property
    def read_timeout_s(self) -> float | None:
        return self.client.timeout.read

    async def start(self) -> None:
        """Nothing to do: httpx opens connections on first use."""

    async def send(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                   params: str = "") -> HttpxAnswer:
        content = None if body is None else joined(body)
        request = self.client.build_request(method, path, headers=dict(headers), content=content,
                                            params=httpx.QueryParams(params))
        try:
            return HttpxAnswer(await self.client.send(request, stream=True))
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"upstream {request.url} did not answer in time "
                                       f"({type(exc).__name__}: {exc or 'no detail'})") from exc
        except httpx.TransportError as exc:
            raise UpstreamRefusedError(f"cannot reach upstream {request.url}: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self.client.aclose()


# --- aiohttp -------------------------------------------------------------------------------------


class AiohttpAnswer:
    """An `aiohttp.ClientResponse` whose body has not been read yet."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    @property
    def reason(self) -> str:
        return self._response.reason or ""

    @property
    def url(self) -> str:
        return str(self._response.url)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:  # aiohttp's ServerTimeoutError is a TimeoutError
            raise UpstreamBrokenError(f"{type(exc).__name__}: {exc or 'no detail'}",
                                      is_timeout=isinstance(exc, TimeoutError)) from exc

    async def read(self, limit: int) -> bytes:
        return await read_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # back to the pool
        else:
            self._response.close()  # unread bytes: the connection cannot be reused


class AiohttpUpstreamClient(ClientState):
    """`UpstreamClient` over an `aiohttp.ClientSession` made in `start()` (on the running loop)."""

    def __init__(self, base_url: str, *, connect_s: float, read_s: float) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_s, sock_read=read_s)
        self._session: aiohttp.ClientSession | None = None
        self._is_closed = False

    @property
    def read_timeout_s(self) -> float | None:
        return self._timeout.sock_read

    async def start(self) -> None:
        if self._session is None and not self._is_closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, trust_env=False,
                                                  auto_decompress=True)

    async def send(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                   params: str = "") -> AiohttpAnswer:
        if self._session is None:
            raise RuntimeError("AiohttpUpstreamClient.send before start() (or after aclose())")
        url = self._base_url + path + (f"?{params}" if params else "")
        try:
            response = await self._session.request(method, url, headers=dict(headers),
                                                   data=None if body is None else joined(body),
                                                   allow_redirects=False)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeoutError(f"upstream {url} did not answer in time "
                                       f"({type(exc).__name__}: {exc or 'no detail'})") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamRefusedError(f"cannot reach upstream {url}: {type(exc).__name__}: {exc}") from exc
        return AiohttpAnswer(response)

    async def aclose(self) -> None:
        self._is_closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def make_client(kind: str, base_url: str, *, connect_s: float, read_s: float,
                max_head_bytes: int | None = None) -> UpstreamClient:
    """The `kind` ("httptools", "aiohttp" or "httpx") client to `base_url` (`max_head_bytes`: the largest answer head
    the gateway's own client takes; aiohttp and httpx keep their own, smaller, limits: 8 and 16 KiB a line)."""
    if kind == "httptools":
        from basin_runtime.gateway.http1 import Http1UpstreamClient

        if max_head_bytes is None:
            return Http1UpstreamClient(base_url, connect_s=connect_s, read_s=read_s)
        return Http1UpstreamClient(base_url, connect_s=connect_s, read_s=read_s, max_head_bytes=max_head_bytes)
    if kind == "aiohttp":
        return AiohttpUpstreamClient(base_url, connect_s=connect_s, read_s=read_s)
    if kind == "httpx":
        return HttpxUpstreamClient.for_url(base_url, connect_s=connect_s, read_s=read_s)
    raise ValueError(f"unknown upstream client {kind!r}; expected httptools, aiohttp or httpx")

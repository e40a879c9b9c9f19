"""The gateway's HTTP/1.1 client to the upstream: asyncio protocols and httptools' (llhttp's) response parser.

Rules:
- It implements `upstream.UpstreamClient`. A request is one write of a head built from a string and
  the body, or of the head and the body's pieces (`RequestBody`), none of them copied when the body is
  large; an answer is parsed straight into a status, a dict of lower-case header names and a queue of
  body chunks.
- Connections: keep-alive, reused last-in first-out, closed once idle KEEPALIVE_S (before the
  upstream's own keep-alive closes them: checked whenever a connection is taken or given back), when
  the answer says `Connection: close` or was not read to its end, or when a send is cancelled. A
  request that finds its reused connection closed before any byte of the answer came back (the
  upstream closed it as it was taken) is sent once more on a new connection; nothing else is retried.
- Timeouts: `connect_s` to connect; `read_s` the longest wait for the next bytes, from sending the
  request on (the head too). Cancelling `send` (the client left) drops the connection, so the upstream
  sees the request go.
- Time (the timeouts, a connection's last bytes and idle age) is read from and waited on the injected
  `Clock` (the gateway's; `MonotonicClock` by default), never the event loop's.
- Bodies: Content-Length, chunked, or up to the connection's close; a `HEAD` answer has none. A
  `Content-Encoding` of gzip or deflate the upstream applied although asked for identity is undone
  as the chunks pass (the proxy drops the header); any other encoding is an `UpstreamBrokenError`.
  Reading pauses while HIGH_WATER_BYTES of body wait unread (flow control), and resumes as it is read.
  `chunks()` gives everything received so far in one piece (SSE events read at once go on together).
- `http` and `https` base URLs (a path prefix is kept); the Host header is the base URL's.
- An answer head (status line and headers) past `max_head_bytes` is refused as it arrives, an
  `UpstreamBadAnswerError` (502 `upstream_bad_answer`) naming the limit: httptools holds a header's bytes
  until it ends, so an upstream could otherwise make the gateway hold, and pass on, a head of any size.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from collections.abc import AsyncGenerator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from basin_runtime.clock import Clock, Deadline, MonotonicClock
from basin_runtime.gateway.errors import UpstreamBadAnswerError, UpstreamRefusedError, UpstreamTimeoutError
from basin_runtime.gateway.limits import DEFAULT_MAX_HEADER_BYTES
from basin_runtime.gateway.upstream import (
    RequestBody,
    UpstreamBrokenError,
    body_size,
    joined,
    read_upto,
)

KEEPALIVE_S = 2.0  # idle connections dropped before uvicorn's (SGLang's server's) 5 s keep-alive closes them
HIGH_WATER_BYTES = 1 << 20  # unread body bytes at which reading pauses
LOW_WATER_BYTES = 256 << 10  # ... and resumes
_COPY_BODY_BYTES = 64 << 10  # a smaller body is joined to the head (one buffer); a larger one is written beside it


class _Lost(Exception):
    """The connection closed before any byte of the answer (the request may be sent again on a new one)."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, clock: Clock,
                 max_head_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self._loop = loop
        self._clock = clock
        self._max_head_bytes = max_head_bytes
        self.transport: asyncio.Transport | None = None
        self.is_lost = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset(is_head=False)

    def _reset(self, *, is_head: bool) -> None:
        self._is_head = is_head
        self.reason = b""
        self.header_list: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0  # bytes received while the head had not ended
        self.has_head = False
        self._keep_alive = False
        self.is_complete = False
        self.got_bytes = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self._is_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.last_data = self._clock.now()

    # --- the request -------------------------------------------------------------------------------

    def send(self, head: bytes, body: RequestBody | None, *, is_head: bool) -> None:
        self._reset(is_head=is_head)
        assert self.transport is not None
        size = 0 if body is None else body_size(body)
        if body is None or size == 0:
            self.transport.write(head)
        elif size < _COPY_BODY_BYTES:
            self.transport.write(head + joined(body))
        else:
            self.transport.writelines((head, body) if isinstance(body, bytes) else (head, *body))

    async def wait(self, read_s: float | None) -> None:
        """Until something happens (bytes, the end, a failure); `TimeoutError` after `read_s` without bytes."""
        waiter = self._waiter = self._loop.create_future()
        timer = None if read_s is None else self._clock.call_at(self.last_data + read_s,
                                                                lambda: self._timed_out(waiter, read_s))
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None], read_s: float) -> None:
        if waiter.done():
            return
        if self._clock.now() >= self.last_data + read_s:  # the timer's own sum: no rounding apart from it
            waiter.set_exception(TimeoutError(f"no bytes for {read_s:g} s"))
        else:  # bytes came meanwhile: wait out the rest
            self._clock.call_at(self.last_data + read_s, lambda: self._timed_out(waiter, read_s))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take(self) -> bytes:
        """Every body byte received so far, in one piece (several HTTP chunks read at once go on together)."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered -= len(chunk)
        if self._is_paused and self.buffered <= LOW_WATER_BYTES and self.transport is not None:
            self._is_paused = False
            self.transport.resume_reading()
        return chunk

    def keeps_alive(self) -> bool:
        return self.is_complete and not self.is_lost and not self._is_head and self._keep_alive

    def close(self) -> None:
        self.is_lost = True
        if self.transport is not None:
            self.transport.close()

    # --- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_data = self._clock.now()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBrokenError(f"the upstream's answer is not valid HTTP/1.1: {exc}"))
            self.close()
            return
        if not self.has_head:
            self.head_bytes += len(data)
            if self.head_bytes > self._max_head_bytes:
                self._fail(UpstreamBadAnswerError(f"the upstream's answer head passed {self._max_head_bytes} bytes "
                                                  f"(limit `max_header_bytes`; set it with --max-header-bytes)"))
                self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; `connection_lost` settles the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        if self.is_complete or self.error is not None:
            return
        if self.has_head and not self._has_length():  # a body delimited by the connection's close
            self.is_complete = True
            self._wake()
            return
        if not self.got_bytes:
            self._fail(_Lost(f"the upstream closed the connection ({exc or 'no detail'})"))
        else:
            self._fail(UpstreamBrokenError(f"the upstream closed the connection mid-answer ({exc or 'no detail'})"))

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _has_length(self) -> bool:
        names = {name.lower() for name, _ in self.header_list}
        return b"content-length" in names or b"transfer-encoding" in names

    # --- httptools callbacks -----------------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name, value))

    def on_headers_complete(self) -> None:
        head_bytes = sum(len(name) + len(value) + 4 for name, value in self.header_list) + len(self.reason)
        if head_bytes > self._max_head_bytes:
            self._fail(UpstreamBadAnswerError(f"the upstream's answer head is over {self._max_head_bytes} bytes "
                                              f"(limit `max_header_bytes`; set it with --max-header-bytes)"))
            self.close()
            return
        self.has_head = True
        self._keep_alive = self._parser.should_keep_alive()  # read here: llhttp forgets it once the message ends
        if self._is_head:  # no body follows, whatever the headers say
            self.is_complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._is_head:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self._is_paused and self.transport is not None:
            self._is_paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_complete = True
        self._wake()


class Http1Answer:
    """An answer whose head has arrived; its body is read from the connection as it comes."""

    def __init__(self, client: Http1UpstreamClient, conn: _Connection, url: str) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._url = url
        self._status = conn._parser.get_status_code()
        headers: dict[str, str] = {}
        for name, value in conn.header_list:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self._headers = headers
        self._reason = conn.reason.decode("latin-1")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        self._decoder = None if encoding == "identity" else _decoder(encoding)

    @property
    def status_code(self) -> int:
        return self._status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def url(self) -> str:
        return self._url

    @property
    def is_received(self) -> bool:
        conn = self._conn
        return conn is not None and conn.is_complete

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        conn = self._conn
        if conn is None:
            return
        read_s = self._client.read_timeout_s
        while True:
            if conn.chunks:
                chunk = conn.take()
                if self._decoder is not None:
                    chunk = self._decode(chunk)
                    if not chunk:
                        continue
                yield chunk
            elif conn.is_complete:
                if self._decoder is not None and (tail := self._decode(b"", end=True)):
                    yield tail
                return
            elif conn.error is not None:
                error = conn.error
                raise error if isinstance(error, UpstreamBrokenError) else UpstreamBrokenError(str(error))
            else:
                try:
                    await conn.wait(read_s)
                except TimeoutError as exc:
                    raise UpstreamBrokenError(f"TimeoutError: {exc}", is_timeout=True) from exc

    def _decode(self, chunk: bytes, *, end: bool = False) -> bytes:
        assert self._decoder is not None
        if isinstance(self._decoder, UpstreamBrokenError):
            raise self._decoder
        try:
            return self._decoder.flush() if end else self._decoder.decompress(chunk)
        except zlib.error as exc:
            raise UpstreamBrokenError(f"the upstream's {self._headers.get('content-encoding')} body does not "
                                      f"decode: {exc}") from exc

    async def read(self, limit: int) -> bytes:
        return await read_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if conn.is_complete and not conn.chunks:  # read to its end: the connection is clean
            self._client.give_back(conn)
        else:
            conn.close()  # unread bytes: the connection cannot be reused


def _decoder(encoding: str) -> zlib._Decompress | UpstreamBrokenError:
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj()
    return UpstreamBrokenError(f"the upstream answered in a Content-Encoding the gateway cannot undo: {encoding!r}")


class Http1UpstreamClient:
    """`UpstreamClient` over the gateway's own HTTP/1.1 connections (see the rules)."""

    def __init__(self, base_url: str, *, connect_s: float, read_s: float,
                 max_head_bytes: int = DEFAULT_MAX_HEADER_BYTES, clock: Clock | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"the upstream URL must be http://HOST[:PORT] or https://..., got {base_url!r}")
        self._base_url = base_url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._prefix = parts.path.rstrip("/")
        self._connect_s = connect_s
        self._read_s = read_s
        self._max_head_bytes = max_head_bytes
        self._clock = clock or MonotonicClock()
        self._idle: collections.deque[_Connection] = collections.deque()  # oldest on the left, newest on the right
        self._is_closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def is_closed(self) -> bool:
        return self._is_closed

    @property
    def read_timeout_s(self) -> float | None:
        return self._read_s

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def send(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                   params: str = "") -> Http1Answer:
        if self._is_closed:
            raise RuntimeError("Http1UpstreamClient.send after aclose()")
        target = self._prefix + path + (f"?{params}" if params else "")
        url = self._base_url + path + (f"?{params}" if params else "")
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {self._host_header}\r\n"]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers.items())
        if body is not None:
            lines.append(f"content-length: {body_size(body)}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        is_head = method == "HEAD"
        for attempt in range(2):
            conn, is_reused = await self._connection(url)
            try:
                conn.send(head, body, is_head=is_head)
                while not conn.has_head:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(self._read_s)
            except _Lost as exc:
                conn.close()
                if is_reused and attempt == 0:
                    continue  # the upstream closed it as it was taken: once more, on a new connection
                raise UpstreamRefusedError(f"cannot reach upstream {url}: {exc}") from exc
            except TimeoutError as exc:
                conn.close()
                raise UpstreamTimeoutError(f"upstream {url} did not answer in time (TimeoutError: {exc})") from exc
            except UpstreamBrokenError as exc:
                conn.close()
                raise UpstreamRefusedError(f"cannot reach upstream {url}: {exc}") from exc
            except BaseException:  # cancelled (the client left): the upstream must see the request go
                conn.close()
                raise
            return Http1Answer(self, conn, url)
        raise AssertionError("unreachable")

    async def _connection(self, url: str) -> tuple[_Connection, bool]:
        loop = self._loop or asyncio.get_running_loop()
        self._expire(self._clock.now())
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the least likely to be closed by the upstream
            if not conn.is_lost:
                return conn, True
        try:
            async with Deadline(self._clock, self._connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop, self._clock, self._max_head_bytes),
                                                       self._host, self._port, ssl=self._ssl)
        except TimeoutError as exc:
            raise UpstreamTimeoutError(f"upstream {url} did not answer in time (no connection within "
                                       f"{self._connect_s:g} s)") from exc
        except OSError as exc:
            raise UpstreamRefusedError(f"cannot reach upstream {url}: {type(exc).__name__}: {exc}") from exc
        return conn, False

    def give_back(self, conn: _Connection) -> None:
        """Keep a connection whose answer was read to its end for the next request (or drop it)."""
        if self._is_closed or not conn.keeps_alive():
            conn.close()
            return
        conn.idle_since = self._clock.now()
        self._expire(conn.idle_since)
        self._idle.append(conn)

    def _expire(self, now: float) -> None:
        """Close the connections idle KEEPALIVE_S or more (the oldest are on the left)."""
        idle = self._idle
        while idle and (idle[0].is_lost or now - idle[0].idle_since >= KEEPALIVE_S):
            idle.popleft().close()

    async def aclose(self) -> None:
        self._is_closed = True
        idle, self._idle = self._idle, collections.deque()
        for conn in idle:
            conn.close()

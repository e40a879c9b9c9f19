"""uvicorn with the gateway's protocol: JSON answers for malformed requests and oversized heads.

Rules:
- What never reaches the app is answered by the protocol (`GatewayHttpProtocol`, uvicorn's httptools protocol
  with three changes), in the same JSON as every other answer (`errors.error_response`), then the
  connection is closed:
  - a request llhttp cannot parse (uvicorn's own answer is a plain-text 400): 400 `invalid_request_error`
    naming the parser's complaint;
  - a request head past `max_header_bytes` (its request line, header names and values) or with more than
    `max_headers` headers: 431 `headers_too_large`, naming the limit. The parser's callbacks count the
    URL and each header as it ends; httptools holds a header's bytes until it ends, so the reads that
    arrive while a head is open (after the read it began in) are counted too, as they come: the gateway
    holds at most the limit plus one read (256 KiB) of any head.
  A response already under way on the connection (a pipelined request) is not interleaved: the
  connection is closed without an answer to the bad request; a request llhttp refuses after its head
  (an unknown Transfer-Encoding, a bad chunk) is answered by the protocol, and whatever the app would
  have answered it is dropped. Otherwise the close lingers: the answer
  and the end of the gateway's side are sent, and what the client still sends is read and dropped for
  LINGER_S (at most LINGER_BYTES), so the client reads the answer instead of a connection reset.
- Slow clients (issue 46): a request head must arrive within `header_timeout_s` of the connection's opening
  (or of its first byte, on a kept-alive connection) and its body within `body_timeout_s` of the head's end.
  Past either, a head or body begun is answered 408 `request_timeout` in JSON (naming the limit) and the
  connection is closed as above; a connection that never sent a byte is just closed. The app's answer to a
  request whose body timed out is dropped (the protocol tells it the client left).
- Connections: at most `max_connections` open; one more closes the oldest idle one (no request under way),
  or itself if none is idle. A client (by address) keeps at most `max_idle_connections_per_client` idle
  connections: one more closes its oldest idle one. Connections that never sent a byte count as idle.
- uvicorn's WebSocket upgrade is off (`ws="none"`): an upgrade request is served as plain HTTP by the app,
  so no server-made 403 or 426 answer exists.
- `server_config` is the one place the server's options are set (the CLI and the tests use it).
- A graceful shutdown (SIGTERM, Ctrl-C: `DrainingServer`) drains the gateway with the listener still open:
  every new call, and `GET /health` (so a load balancer moves on), is answered 503 `shutting_down` with
  Retry-After while the calls in flight run to their end, for up to `drain_timeout_s` on the gateway's clock
  (`basin_runtime.clock`; the drain polls on it too). Calls still in flight
  then are cut by the gateway itself (`Gateway.cut_calls`): one whose answer has not begun gets the JSON 503,
  a streamed one the gateway's error event and `data: [DONE]`. Only then does uvicorn's own shutdown close the
  listener and the connections (its grace, CUT_GRACE_S, is for the cut calls to write their last bytes), and
  the app's lifespan ends what is still held. uvicorn closed the listener first: new connections were refused
  at TCP, and the calls it cancelled at its deadline got its plain-text 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httptools
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from basin_runtime.clock import Clock, MonotonicClock
from basin_runtime.gateway.errors import (
    BadRequestError,
    GatewayError,
    HeadersTooLargeError,
    RequestTimeoutError,
    error_response,
)
from basin_runtime.gateway.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS

DEFAULT_HEADER_TIMEOUT_S = 30.0  # a head is a few KiB: only a client that means to hold the connection is slower
DEFAULT_BODY_TIMEOUT_S = 120.0  # a 64 MiB body (the largest accepted) at ~4 Mbit/s
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_IDLE_CONNECTIONS_PER_CLIENT = 256  # a client's pool (or a load balancer's) keeps a few dozen

logger = logging.getLogger(__name__)
LINGER_S = 1.0  # a refused connection is read and dropped this long (or LINGER_BYTES) before it is closed
LINGER_BYTES = 1 << 20
CUT_GRACE_S = 2  # after the cut, how long uvicorn waits for the requests to end before it cancels them
DRAIN_POLL_S = 0.05


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing a head the protocol refuses."""


class Connections:
    """The open connections of one server, in the order they opened, and which of them are idle."""

    def __init__(self) -> None:
        self.open: dict[GatewayHttpProtocol, str] = {}  # connection -> its client's address
        self.by_client: dict[str, dict[GatewayHttpProtocol, None]] = {}

    def add(self, connection: GatewayHttpProtocol, client: str) -> None:
        self.open[connection] = client
        self.by_client.setdefault(client, {})[connection] = None

    def remove(self, connection: GatewayHttpProtocol) -> None:
        client = self.open.pop(connection, None)
        if client is not None:
            mine = self.by_client[client]
            mine.pop(connection, None)
            if not mine:
                del self.by_client[client]

    def oldest_idle(self, among: Mapping[GatewayHttpProtocol, Any],
                    but: GatewayHttpProtocol) -> GatewayHttpProtocol | None:
        """The connection of `among` opened first that has no request under way (not `but`)."""
        return next((c for c in among if c is not but and c.is_idle), None)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering malformed requests, oversized heads and slow clients in the gateway's
    JSON, with a cap on its connections."""

    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    max_headers = DEFAULT_MAX_HEADERS
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s = DEFAULT_BODY_TIMEOUT_S
    max_connections = DEFAULT_MAX_CONNECTIONS
    max_idle_connections_per_client = DEFAULT_MAX_IDLE_CONNECTIONS_PER_CLIENT
    connection_table = Connections()  # one per server: `protocol_class` makes a class per server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None  # the head's or the body's
        self._is_busy = False  # a request has begun and its answer has not ended
        self._has_bytes = False  # some bytes of a request arrived
        self._is_head_open = False  # a request head has begun and not ended
        self._has_begun = False  # a request began in the data being fed
        self._head_received = 0  # bytes of an open head after the read it began in, counted as they arrive
        self._head_bytes = 0  # the head's URL and headers (`name: value\r\n`), counted as the parser reads them
        self._num_headers = 0
        self._refusal: GatewayError | None = None
        self._is_refused = False  # answered and lingering before the close
        self._lingered_bytes = 0

    @property
    def is_idle(self) -> bool:
        """No request under way on this connection."""
        return not self._is_busy and not self._is_head_open

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        table = self.connection_table
        client = self.client[0] if self.client else ""
        table.add(self, client)
        self._start_deadline(self.header_timeout_s, "header_timeout_s", "no request head arrived")
        if len(table.open) > self.max_connections:
            victim = table.oldest_idle(table.open, self) or self
            logger.warning("%d connections are open (max_connections): closing %s", len(table.open),
                           "the oldest idle one" if victim is not self else "the new one, none is idle")
            victim.transport.close()
        mine = table.by_client.get(client, {})
        if len(mine) > self.max_idle_connections_per_client and sum(c.is_idle for c in mine) > \
                self.max_idle_connections_per_client:
            oldest = table.oldest_idle(mine, self)
            if oldest is not None:
                logger.info("client %s holds more than %d idle connections (max_idle_connections_per_client): "
                            "closing its oldest", client, self.max_idle_connections_per_client)
                oldest.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.connection_table.remove(self)
        super().connection_lost(exc)

    def _start_deadline(self, seconds: float, limit: str, what: str) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, self._timed_out, seconds, limit, what)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self, seconds: float, limit: str, what: str) -> None:
        self._deadline = None
        if not self._has_bytes and not self._is_busy:  # nothing to answer: a connection that never sent a byte
            self.transport.close()
            return
        logger.info("closing a slow connection from %s: %s within %g s", self.client, what, seconds)
        self._refuse(RequestTimeoutError(f"{what} within {seconds:g} s", limit, seconds))

    def on_response_complete(self) -> None:
        self._is_busy = False
        super().on_response_complete()

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._is_refused:  # read and dropped while the connection lingers
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        was_open, self._has_begun = self._is_head_open, False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # never: WebSockets are off (`server_config`)
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            if self._refusal is None:
                self._refusal = BadRequestError(f"the request is not valid HTTP/1.1: {exc}")
                logger.info("refused a request that is not valid HTTP/1.1: %s", exc)
            self._refuse(self._refusal)
            return
        if was_open and self._is_head_open and not self._has_begun:  # all of `data` went into a head still open
            self._head_received += len(data)
            if self._head_received > self.max_header_bytes:
                self._refuse(self._too_large(f"the request head passed {self.max_header_bytes} bytes while it was "
                                             "being read"))

    def on_message_begin(self) -> None:
        self._is_head_open, self._has_begun = True, True
        self._is_busy = self._has_bytes = True
        self._head_received, self._head_bytes, self._num_headers = 0, 0, 0
        if self._deadline is None:  # a kept-alive connection's next request: its head has its own deadline
            self._start_deadline(self.header_timeout_s, "header_timeout_s", "the request head did not arrive")
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.max_headers:
            self._refusal = HeadersTooLargeError(f"the request has more than {self.max_headers} headers",
                                                 "max_headers", self.max_headers)
            raise _HeadRefused
        self._count(len(name) + len(value) + 4)  # `name: value\r\n`
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._is_head_open = False
        self._start_deadline(self.body_timeout_s, "body_timeout_s", "the request body did not arrive")
        super().on_headers_complete()

    def _count(self, num_bytes: int) -> None:
        self._head_bytes += num_bytes
        if self._head_bytes > self.max_header_bytes:
            self._refusal = self._too_large(f"the request head (its request line and headers) is over "
                                            f"{self.max_header_bytes} bytes")
            raise _HeadRefused

    def _too_large(self, message: str) -> HeadersTooLargeError:
        return HeadersTooLargeError(message, "max_header_bytes", self.max_header_bytes)

    def _refuse(self, error: GatewayError) -> None:
        """Answer `error` in JSON and close the connection after a lingering close (just close it if a response is
        under way): closing with the client's bytes unread would reset the connection, and a reset can discard the
        answer before the client reads it."""
        if self.transport.is_closing() or self._is_refused:
            return
        self._is_refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # an answer is under way: it cannot be followed by another
                self.transport.close()
                return
            cycle.disconnected = True  # the parser failed after the head: the app's answer to it is dropped
            cycle.message_event.set()
        self.transport.write(_raw_answer(error))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer, then our end: the client reads both and closes
        self.loop.call_later(LINGER_S, self.transport.close)


def _raw_answer(error: GatewayError) -> bytes:
    """The whole HTTP/1.1 answer `error_response(error)` stands for, closing the connection."""
    response = error_response(error)
    head = [STATUS_LINE[response.status_code]]
    head += [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
    head.append(b"connection: close\r\n\r\n")
    return b"".join(head) + bytes(response.body)


@dataclass(frozen=True)
class ConnectionLimits:
    """What the server's protocol holds each connection to (see the rules)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_idle_connections_per_client: int = DEFAULT_MAX_IDLE_CONNECTIONS_PER_CLIENT


def protocol_class(limits: ConnectionLimits) -> type[GatewayHttpProtocol]:
    """`GatewayHttpProtocol` with these limits and a table of its own connections (uvicorn makes one protocol object
    per connection from a class)."""
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,),
                {**dataclasses.asdict(limits), "connection_table": Connections()})


def server_config(app: ASGIApp, *, host: str, port: int, keep_alive_s: float,
                  limits: ConnectionLimits | None = None) -> uvicorn.Config:
    """The uvicorn configuration the gateway serves with (see the rules)."""
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                          proxy_headers=False, http=protocol_class(limits or ConnectionLimits()), ws="none",
                          timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # (typed int; a float works)
                          timeout_graceful_shutdown=CUT_GRACE_S)


class Drainable(Protocol):
    """What the server drains at shutdown (`gateway.Gateway`)."""

    async def drain(self) -> None: ...

    @property
    def num_active_calls(self) -> int: ...

    def cut_calls(self) -> int: ...


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the gateway with its listener open before its own shutdown (see the rules)."""

    def __init__(self, config: uvicorn.Config, gateway: Drainable, *, drain_timeout_s: float,
                 clock: Clock | None = None) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._drain_timeout_s = drain_timeout_s
        self._clock = clock or MonotonicClock()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        clock = self._clock
        deadline = clock.now() + self._drain_timeout_s
        try:
            await self._gateway.drain()
        except Exception:  # the shutdown itself must go on
            logger.exception("draining the gateway failed")
        while self._gateway.num_active_calls and clock.now() < deadline and not self.force_exit:
            await clock.sleep(DRAIN_POLL_S)
        if self._gateway.num_active_calls:
            logger.warning("drain_timeout_s (%g s) passed: cutting %d calls still in flight", self._drain_timeout_s,
                           self._gateway.cut_calls())
            cut_by = clock.now() + CUT_GRACE_S / 2
            while self._gateway.num_active_calls and clock.now() < cut_by:
                await clock.sleep(DRAIN_POLL_S)
        await super().shutdown(sockets)

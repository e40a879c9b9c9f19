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
- uvicorn's WebSocket upgrade is off (`ws="none"`): an upgrade request is served as plain HTTP by the app,
  so no server-made 403 or 426 answer exists.
- `server_config` is the one place the server's options are set (the CLI and the tests use it).
- A graceful shutdown (SIGTERM, Ctrl-C: `DrainingServer`) drains the gateway with the listener still open:
  every new call, and `GET /health` (so a load balancer moves on), is answered 503 `shutting_down` with
  Retry-After while the calls in flight run to their end, for up to `drain_timeout_s`. Calls still in flight
  then are cut by the gateway itself (`Gateway.cut_calls`): one whose answer has not begun gets the JSON 503,
  a streamed one the gateway's error event and `data: [DONE]`. Only then does uvicorn's own shutdown close the
  listener and the connections (its grace, CUT_GRACE_S, is for the cut calls to write their last bytes), and
  the app's lifespan ends what is still held. uvicorn closed the listener first: new connections were refused
  at TCP, and the calls it cancelled at its deadline got its plain-text 500.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol

import httptools
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from basin_runtime.gateway.errors import BadRequestError, GatewayError, HeadersTooLargeError, error_response
from basin_runtime.gateway.limits import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADERS

logger = logging.getLogger(__name__)
LINGER_S = 1.0  # a refused connection is read and dropped this long (or LINGER_BYTES) before it is closed
LINGER_BYTES = 1 << 20
CUT_GRACE_S = 2  # after the cut, how long uvicorn waits for the requests to end before it cancels them
DRAIN_POLL_S = 0.05


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing a head the protocol refuses."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering malformed requests and oversized heads in the gateway's JSON."""

    max_header_bytes = DEFAULT_MAX_HEADER_BYTES
    max_headers = DEFAULT_MAX_HEADERS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._is_head_open = False  # a request head has begun and not ended
        self._has_begun = False  # a request began in the data being fed
        self._head_received = 0  # bytes of an open head after the read it began in, counted as they arrive
        self._head_bytes = 0  # the head's URL and headers (`name: value\r\n`), counted as the parser reads them
        self._num_headers = 0
        self._refusal: GatewayError | None = None
        self._is_refused = False  # answered and lingering before the close
        self._lingered_bytes = 0

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
        self._head_received, self._head_bytes, self._num_headers = 0, 0, 0
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


def protocol_class(max_header_bytes: int, max_headers: int) -> type[GatewayHttpProtocol]:
    """`GatewayHttpProtocol` with these limits (uvicorn makes one protocol object per connection from a class)."""
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,),
                {"max_header_bytes": max_header_bytes, "max_headers": max_headers})


def server_config(app: ASGIApp, *, host: str, port: int, keep_alive_s: float,
                  max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
                  max_headers: int = DEFAULT_MAX_HEADERS) -> uvicorn.Config:
    """The uvicorn configuration the gateway serves with (see the rules)."""
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                          proxy_headers=False, http=protocol_class(max_header_bytes, max_headers), ws="none",
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

    def __init__(self, config: uvicorn.Config, gateway: Drainable, *, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_timeout_s
        try:
            await self._gateway.drain()
        except Exception:  # the shutdown itself must go on
            logger.exception("draining the gateway failed")
        while self._gateway.num_active_calls and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._gateway.num_active_calls:
            logger.warning("drain_timeout_s (%g s) passed: cutting %d calls still in flight", self._drain_timeout_s,
                           self._gateway.cut_calls())
            cut_by = loop.time() + CUT_GRACE_S / 2
            while self._gateway.num_active_calls and loop.time() < cut_by:
                await asyncio.sleep(DRAIN_POLL_S)
        await super().shutdown(sockets)

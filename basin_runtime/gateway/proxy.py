"""Forwarding to the upstream (the SGLang router, or one server), streaming the answer back.

Rules:
- The upstream client is an injected `UpstreamClient` (`upstream.py`; `http1.py` in production) whose
  base URL is the upstream; its timeouts are the gateway's. Nothing else in the gateway talks to the
  upstream.
- Request headers: the client's end-to-end headers go through, `Authorization` included; hop-by-hop
  headers, `Host` and `Content-Length` do not, nor a header whose name is not an HTTP token or whose
  value is not printable ASCII (logged at debug level); the gateway asks for `Accept-Encoding: identity`
  and passes answers on decoded.
- An SSE answer, or one without a small `Content-Length`, streams through as it arrives, event by event
  (an unfinished event is held until its blank line), never buffered whole; a non-SSE answer with a
  `Content-Length` up to `WHOLE_BODY_BYTES` is read whole and sent in one piece (a failure while reading
  it is then a 502).
- Until the answer has been passed on, the client is watched (`ClientWatch`): if it leaves, the upstream
  request is cancelled.
- Before the head: cannot connect -> `UpstreamRefusedError`; timeout -> `UpstreamTimeoutError`; 5xx ->
  `UpstreamStatusError` quoting the upstream's body; 1xx or 3xx -> `UpstreamBadAnswerError` (502); a 4xx
  is read whole (up to `REFUSAL_BODY_BYTES`) and passed on with its status, as written when it is a JSON
  error object with a string `type`, else as the gateway's `upstream_rejected`. A 2xx read whole that
  says it is JSON and does not parse -> `UpstreamBadAnswerError`.
- `on_end(CallEnd)` is called exactly once per forwarded call (body sent, client gone, or upstream
  failed), with the upstream's status, headers and the call's usage. `on_first_byte()` is called
  at most once, for a 2xx answer, when its first bytes are passed on (or its body read whole): the caller
  times it on its own clock.
- Usage (`signals.py`): read from a JSON answer (up to `USAGE_BODY_BYTES`) or from the last SSE event
  carrying `usage` or `meta_info` (`sse.py`; an event over `EVENT_BYTES` passes unparsed). When the
  gateway itself asked for usage (`drop_usage_chunk`), the usage-only chunk is not passed on.
- An error event the upstream writes inside a 2xx SSE answer is passed on as written, and the call ends
  `upstream_error`. A 2xx SSE answer the upstream does not finish (the connection breaks, the body ends
  without `[DONE]`, no bytes or only SSE comments within the read timeout, measured on the injected
  `Clock`) gets the gateway's own error event and `data: [DONE]`, and ends `upstream_error`; so does one
  cut at a shutdown's drain deadline (`shutting_down`). A non-SSE answer cut after its head (the upstream
  broke off or went silent past `upstream_timeout_s`, ended a body that claims JSON and is not, or the
  shutdown's drain deadline cut it) is never completed: the app returns without the answer's end, and
  the server closes the connection without it (chunked: no last chunk), so the client reads an error,
  never a 200 whose body is framed whole; the call ends `upstream_error` (`gateway_error` for the
  drain's cut).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from basin_runtime.clock import Clock, MonotonicClock
from basin_runtime.disconnect import ClientWatch
from basin_runtime.gateway.errors import (
    ClientGoneError,
    ShuttingDownError,
    UpstreamBadAnswerError,
    UpstreamError,
    UpstreamRefusedError,
    UpstreamRejectedError,
    UpstreamStatusError,
    UpstreamStreamError,
    UpstreamTimeoutError,
    error_event,
)
from basin_runtime.gateway.sessions import CallOutcome
from basin_runtime.gateway.signals import Usage, parse_json, usage_of
from basin_runtime.gateway.sse import SseEvents, SseFramer
from basin_runtime.gateway.upstream import (
    RequestBody,
    UpstreamAnswer,
    UpstreamBrokenError,
    UpstreamClient,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallEnd:
    """How a forwarded call ended."""

    outcome: CallOutcome
    status_code: int | None = None
    upstream_headers: Mapping[str, str] = field(default_factory=dict)
    usage: Usage | None = None


EndHook = Callable[[CallEnd], Awaitable[None]]
FirstByteHook = Callable[[], None]  # a 2xx answer's first bytes were passed on (or its body read whole)
Answer = Response  # what the gateway hands its edge: an ASGI answer, whole or streamed (its headers may be added to)
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)
NOT_SENT = HOP_BY_HOP | {"accept-encoding", "expect"}  # the gateway asks for identity; the body is already here
# Not passed back: hop-by-hop, what the gateway's own server sets, and the encoding undone here.
NOT_RETURNED = HOP_BY_HOP | {"date", "server", "content-encoding"}
ERROR_BODY_BYTES = 4096
REFUSAL_BODY_BYTES = 64 << 10  # a 4xx body up to this is read whole and judged (SGLang's are a few hundred bytes)
WHOLE_BODY_BYTES = 1 << 20  # a non-SSE answer with a Content-Length up to this is read whole, then sent
USAGE_BODY_BYTES = 4 << 20  # a longer JSON answer is passed on but its usage is not read
EVENT_BYTES = 1 << 20  # a longer SSE event is passed on as it arrives but not parsed (usage events are small)
DONE_EVENT = b"data: [DONE]\n\n"
QUOTED_BYTES = 200  # of a bad answer or a dropped unfinished event, quoted in the error


async def _no_end(end: CallEnd) -> None:
    """The end hook of calls nobody accounts for (pass-through endpoints)."""


class Upstream:
    """Sends requests to the upstream and streams its answers back."""

    def __init__(self, client: UpstreamClient, clock: Clock | None = None) -> None:
        self.client = client
        self.clock = clock or MonotonicClock()  # a streamed answer's stall check (the client times its own reads)

    async def start(self) -> None:
        """Get the client ready (on the running loop: the app's lifespan)."""
        await self.client.start()

    async def aclose(self) -> None:
        """Close the client."""
        await self.client.aclose()

    async def forward(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                      receive: Receive, on_end: EndHook = _no_end, params: str = "", *,
                      drop_usage_chunk: bool = False, on_first_byte: FirstByteHook | None = None) -> Response:
        """Send one request upstream and return its answer as a streaming response.

        `on_first_byte` hears when a 2xx answer's first bytes are passed on: a streamed answer's first event (its
        first token), a whole answer's body (an upper bound of its first token)."""
        watch = ClientWatch(receive)  # closed here, unless a streamed answer takes it over (and closes it)
        try:
            return await self._answer(watch, method, path, headers, body, on_end, params, drop_usage_chunk,
                                      on_first_byte)
        finally:
            if not watch.is_taken:
                watch.close()

    async def _answer(self, watch: ClientWatch, method: str, path: str, headers: Mapping[str, str],
                      body: RequestBody | None, on_end: EndHook, params: str, drop_usage_chunk: bool,
                      on_first_byte: FirstByteHook | None) -> Response:
        try:
            response = await watch.race(self.client.send(method, path, _request_headers(headers), body, params),
                                        ClientGoneError)
        except ClientGoneError:
            await on_end(CallEnd("client_gone"))
            raise
        except (UpstreamTimeoutError, UpstreamRefusedError, UpstreamBadAnswerError):
            await on_end(CallEnd("upstream_error"))
            raise
        if response.status_code >= 500:
            text = await _read_start(response)
            await on_end(CallEnd("upstream_error", response.status_code, response.headers))
            raise UpstreamStatusError(response.status_code, text)
        if not _is_ok(response.status_code):
            return await _refusal(response, on_end)
        length = 0 if method == "HEAD" else _whole_length(response)  # a HEAD answer has no body, whatever it says
        first_byte = on_first_byte if _is_ok(response.status_code) else None
        if length is None:
            watch.is_taken = True
            return UpstreamResponse(response, on_end, drop_usage_chunk=drop_usage_chunk,
                                    read_timeout_s=self.client.read_timeout_s,
                                    on_first_byte=first_byte,
                                    watch=watch, clock=self.clock)
        try:
            answer = await response.read(length) if length else b""
            if first_byte is not None:
                first_byte()
            usage = _usage_of_json(response, answer) if method != "HEAD" else None
        except (UpstreamBrokenError, UpstreamBadAnswerError) as exc:
            await on_end(CallEnd("upstream_error", response.status_code, response.headers))
            if isinstance(exc, UpstreamBadAnswerError):
                raise
            raise _mid_answer_error(response.url, exc, self.client.read_timeout_s) from exc
        finally:
            await response.aclose()
        return WholeUpstreamResponse(answer, response.status_code, response.headers, on_end, usage)


async def _refusal(response: UpstreamAnswer, on_end: EndHook) -> Response:
    """A 4xx passed on as written if its body is JSON with a `type`, else as the gateway's JSON; a 1xx or 3xx
    refused (see the rules). The call ends here unless the answer is passed on (then when it has been sent)."""
    status = response.status_code
    try:
        body = await response.read(REFUSAL_BODY_BYTES + 1)
    except UpstreamBrokenError as exc:
        await response.aclose()
        await on_end(CallEnd("upstream_error", status, response.headers))
        raise _mid_answer_error(response.url, exc, None) from exc
    await response.aclose()
    if status < 400:
        await on_end(CallEnd("upstream_error", status, response.headers))
        raise UpstreamBadAnswerError(f"upstream {response.url} answered {status} {response.reason}, which the gateway "
                                     f"neither follows nor passes on")
    if len(body) <= REFUSAL_BODY_BYTES and _has_type(body):
        return WholeUpstreamResponse(body, status, response.headers, on_end, None)
    await on_end(CallEnd("rejected", status, response.headers))
    text = body[:ERROR_BODY_BYTES].decode("utf-8", errors="replace").strip() or response.reason
    raise UpstreamRejectedError(status, text)


def _has_type(body: bytes) -> bool:
    """True if `body` is a JSON object with a string `type`, at its top or in its `error` object."""
    try:
        answer = parse_json(body)
    except ValueError:
        return False
    if not isinstance(answer, dict):
        return False
    error = answer.get("error")
    return isinstance(answer.get("type"), str) or (isinstance(error, dict) and isinstance(error.get("type"), str))


def _answered(status_code: int) -> CallOutcome:
    """A call answered in full: `completed`, or `rejected` when the upstream refused it (4xx: a bad
    parameter, a rate limit), which must not count as served work nor leave context to lend."""
    return "rejected" if 400 <= status_code < 500 else "completed"


def _is_ok(status_code: int) -> bool:
    return 200 <= status_code < 300


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


def _usage_of_json(response: UpstreamAnswer, body: bytes) -> Usage | None:
    """The usage in a whole JSON answer; `UpstreamBadAnswerError` if a 2xx answer claims JSON and is not."""
    try:
        return usage_of(parse_json(body))
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if _is_ok(response.status_code) and (media_type == "application/json" or media_type.endswith("+json")):
            raise UpstreamBadAnswerError(f"upstream {response.url} answered {response.status_code} with a body "
                                         f"that is not JSON: {body[:QUOTED_BYTES]!r}") from None
        return None


def _mid_answer_error(url: str, exc: UpstreamBrokenError, read_timeout_s: float | None) -> UpstreamError:
    """The gateway's error for an upstream that failed after its answer began."""
    if exc.is_timeout:
        return UpstreamTimeoutError(f"upstream {url} sent nothing for {read_timeout_s or 0:g} s mid-answer "
                                    f"(upstream_timeout_s): {exc}")
    return UpstreamStreamError(f"upstream {url} broke off mid-answer: {exc}")


class WholeUpstreamResponse(Response):
    """An upstream answer read whole, sent in one piece; ends the call exactly once."""

    def __init__(self, body: bytes, status_code: int, upstream_headers: Mapping[str, str], on_end: EndHook,
                 usage: Usage | None) -> None:
        self._upstream_headers = upstream_headers
        self._on_end = on_end
        self._usage = usage
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

    def __init__(self, upstream: UpstreamAnswer, on_end: EndHook, *, drop_usage_chunk: bool = False,
                 read_timeout_s: float | None = None, on_first_byte: FirstByteHook | None = None,
                 watch: ClientWatch | None = None, clock: Clock | None = None) -> None:
        self._upstream = upstream
        self._clock = clock or MonotonicClock()
        self._watch = watch  # the client's watcher since the request was sent (else one is made when sending)
        self._on_end = on_end
        self._on_first_byte = on_first_byte  # called at the first bytes passed on, then dropped
        self._is_complete = False
        self._usage: Usage | None = None
        self._events = SseEvents(drop_usage_chunk)
        self._failure: UpstreamError | None = None  # how the upstream failed mid-answer, in the gateway's words
        self._read_timeout_s = read_timeout_s
        is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self._is_sse = is_sse
        self._has_started = False
        self._held: bytes | None = None  # a chunk sent with the next one (see `_send_all`)
        self._chunks = self._relay_sse() if is_sse else self._relay()
        super().__init__(self._chunks, status_code=upstream.status_code, headers=_response_headers(upstream.headers))

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        body = bytearray()
        async for chunk in self._upstream.chunks():  # a break raises: a plain body cannot carry an event
            if len(body) <= USAGE_BODY_BYTES:
                body += chunk
            self._first_bytes_passed()
            yield chunk
        if len(body) <= USAGE_BODY_BYTES:
            try:
                self._usage = _usage_of_json(self._upstream, bytes(body))
            except UpstreamBadAnswerError as exc:
                self._failure = exc
        self._is_complete = True

    async def _relay_sse(self) -> AsyncGenerator[bytes, None]:
        framer, events = SseFramer(EVENT_BYTES), self._events
        chunks = self._upstream.chunks()
        last_progress_s = self._clock.now()
        try:
            async for chunk in chunks:
                passed = events.pass_on(framer.feed(chunk))
                if passed:
                    self._first_bytes_passed()
                    yield passed
                if events.made_progress or framer.held_bytes or framer.is_passing:
                    events.made_progress, last_progress_s = False, self._clock.now()
                elif self._is_stalled(last_progress_s):
                    self._failure = UpstreamTimeoutError(
                        f"upstream {self._upstream.url} sent nothing but SSE comments for {self._read_timeout_s:g} s "
                        f"mid-answer (upstream_timeout_s)")
                    break
        except UpstreamBrokenError as exc:
            if events.saw_done:  # everything the client needs has been passed on
                logger.info("upstream %s broke off after [DONE]: %s", self._upstream.url, exc)
            else:
                self._failure = _mid_answer_error(self._upstream.url, exc, self._read_timeout_s)
        finally:
            await chunks.aclose()
        ending = self._end_of_stream(framer)
        if ending:
            yield ending
        self._usage = events.usage()
        self._is_complete = True

    async def _send_all(self, send: Send) -> None:
        """The answer's head, each chunk as it comes, then its end (Starlette's streaming without its task group:
        the client is watched by the call's `ClientWatch`, as for the head). Once the upstream's whole body has
        arrived, the relay's next steps need no waiting, so each chunk is held until the next one is in hand: the
        last (`[DONE]`, mostly) goes out with the answer's end in one write, and nothing is ever delayed."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._has_started = True
        async for chunk in self._chunks:
            if self._held is not None:
                await send({"type": "http.response.body", "body": self._held, "more_body": True})
            self._held = chunk if getattr(self._upstream, "is_received", False) else None  # optional: upstream.py
            if self._held is None:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        held, self._held = self._held, None
        if self._failure is not None and not self._is_sse:  # cut short: the client must not read it as whole
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
            logger.warning("a non-streamed answer cut after its head, not completed: %s", self._failure)
            return
        await send({"type": "http.response.body", "body": held or b"", "more_body": False})

    def _first_bytes_passed(self) -> None:
        if self._on_first_byte is not None:
            hook, self._on_first_byte = self._on_first_byte, None
            hook()

    def _is_stalled(self, last_progress_s: float) -> bool:
        return self._read_timeout_s is not None and self._clock.now() - last_progress_s > self._read_timeout_s

    def _end_of_stream(self, framer: SseFramer) -> bytes:
        """What follows the upstream's last bytes: a refusal's (4xx) or `[DONE]`'s unfinished end as written, the
        `[DONE]` a stream that reported its own error left out, or the error event of an answer the upstream
        did not finish (then `[DONE]`). An unfinished event is dropped, as an SSE client would drop it."""
        events, rest = self._events, framer.rest()
        if self._failure is None and not _is_ok(self.status_code):
            return rest
        if rest and events.is_done(rest):  # `data: [DONE]` without its blank line: the answer is whole
            events.saw_done = True
        unfinished = b"" if events.saw_done else rest.strip(b"\r\n")
        if self._failure is None and not events.saw_done and events.error is None:
            dropped = f"; its unfinished last event was dropped: {unfinished[:QUOTED_BYTES]!r}" if unfinished else ""
            self._failure = UpstreamStreamError(f"upstream {self._upstream.url} ended its stream without "
                                                f"`data: [DONE]`{dropped}")
        if self._failure is not None:  # an oversized event cut mid-way is ended first (the client reads it broken)
            return (b"\n\n" if framer.is_passing else b"") + error_event(self._failure) + DONE_EVENT
        return (b"" if unfinished else rest) + (b"" if events.saw_done else DONE_EVENT)

    def _outcome(self) -> CallOutcome:
        if not self._is_complete:
            return "client_gone"
        if self._failure is not None:  # the gateway told the client why, in the stream
            logger.warning("upstream failure mid-answer: %s", self._failure)
            return "upstream_error"
        if self._events.error is not None and _is_ok(self.status_code):  # the upstream failed and said so
            logger.warning("upstream %s reported a failure mid-answer: %s", self._upstream.url, self._events.error)
            return "upstream_error"
        return _answered(self.status_code)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outcome: CallOutcome = "client_gone"
        try:
            if self._watch is None:
                self._watch = ClientWatch(receive)
            await self._watch.race(self._send_all(send), ClientGoneError)
            outcome = self._outcome()
        except (ClientGoneError, ClientDisconnect, OSError):
            outcome = "client_gone"
        except UpstreamBrokenError as exc:  # a plain body cut mid-way: the client sees a cut body
            outcome = "upstream_error"
            logger.warning("upstream %s failed mid-answer: %s: %s", self._upstream.url, type(exc).__name__, exc)
        except asyncio.CancelledError:  # cut at a shutdown's drain deadline: a stream says so and ends cleanly
            outcome = "gateway_error"
            if self._is_sse and self._has_started:
                ending = (self._held or b"") + error_event(ShuttingDownError(
                    "the gateway is shutting down and this call did not finish within its drain (drain_timeout_s); "
                    "send it again to its replacement", 0)) + DONE_EVENT
                with anyio.CancelScope(shield=True):
                    await send({"type": "http.response.body", "body": ending, "more_body": False})
            raise
        finally:
            if self._watch is not None:
                self._watch.close()
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
                await self._upstream.aclose()
                await self._on_end(CallEnd(outcome, self.status_code, self._upstream.headers, self._usage))


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

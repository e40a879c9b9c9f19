"""Input limits: body size while reading, bodies in flight, JSON nesting depth and values, session ids.

The gateway's input limits: how large a request body (alone, and all large ones at once), how many JSON
values, messages, tools and content parts it may hold, how deeply nested its JSON, how long and of which
characters a session id may be; the request head's limits are the server's (`server.py`).

Rules:
- Each limit is a `GatewayConfig` option (`max_body_bytes`, `max_json_depth`,
  `max_session_id_chars`); a request over one is refused with a `LimitError` (4xx JSON naming the
  limit, its value and the option that sets it) before anything is counted or forwarded.
- Body size (413 `request_too_large`): a declared Content-Length over the limit is refused before
  a byte is read; otherwise the body is counted as it arrives and refused the moment it would pass
  the limit, so the gateway never holds more than the limit. A body whose size is not the one its
  Content-Length declared, or a Content-Length that is not a number, is a 400; a client that
  leaves while sending is `ClientGoneError`.
- Bodies in flight (503 `too_many_large_bodies`, Retry-After 1 s): every inference body of
  LARGE_BODY_BYTES or more holds the bytes received of it (never its declared size: a client that
  declares 64 MiB and sends a byte a second holds a byte a second, issue 46; the server's
  `body_timeout_s` bounds how long it may) in one `BodyBudget` until its call has been forwarded (a
  call waiting for admission keeps holding it: its body is
  in memory); one that would take the budget past `max_body_bytes_in_flight` is refused before, or
  as soon as, it passes. With each body's handling bounded at ~4x its size, the bodies' memory is
  bounded at ~4x the limit. Smaller bodies are not counted (the hot path pays no bookkeeping).
- Item counts (413 `too_many_items`): `max_json_items` values in a body, counted before it is parsed,
  and `max_messages`, `max_tools`, `max_content_parts` in a chat call (`calls.py`).
- JSON depth (400 `json_too_deep`): the parsed body is measured level by level, without recursion;
  the top-level object is depth 1. The limit stays far below Python's recursion limit (at most
  `MAX_JSON_DEPTH_CEILING`), so everything later that recurses over the body (re-serialising,
  token counting) is safe.
- Session ids (400): at most `max_session_id_chars` characters (`session_id_too_long`). An id from
  the session header must be printable ASCII, since it is echoed in the answer's header; an id
  from the `user` field may hold any Unicode text (OpenAI allows it) but no control characters;
  a `user` id that is not printable ASCII is kept but not echoed. No id is or holds a `.` or `..`
  segment between slashes: clients drop those from the URL that ends the session.
"""

from __future__ import annotations

import contextlib
import gc
import re
import threading
from collections.abc import AsyncIterable, Iterator
from dataclasses import dataclass
from typing import Any

from basin_runtime.gateway.errors import (
    BadRequestError,
    BodiesInFlightError,
    BodyTooLargeError,
    NestingTooDeepError,
    SessionIdTooLongError,
)

# 64 MiB: a 300k-token agent conversation with tool output is a few MB of JSON; images sent as
# base64 make bodies larger, and OpenAI accepts up to 50 MB of images per request, so every body
# OpenAI would take fits, while one client cannot make the gateway hold gigabytes.
DEFAULT_MAX_BODY_BYTES = 64 << 20
# Real tool JSON schemas nest a few dozen levels at most (each nested object schema adds two:
# `properties` and the property); the body itself adds about five (tools, tool, function, parameters).
DEFAULT_MAX_JSON_DEPTH = 128
MAX_JSON_DEPTH_CEILING = 512  # Python's recursion limit is 1000; re-serialising recurses per level
DEFAULT_MAX_SESSION_ID_CHARS = 256  # ids are kept per session, logged and echoed in a response header
# A request head: browsers and SDKs send a few KiB (a long bearer token, cookies); nginx takes 8 KiB lines and
# 32 KiB in all by default, Node.js 16 KiB. Every header but the hop-by-hop ones is forwarded upstream.
DEFAULT_MAX_HEADER_BYTES = 64 << 10
DEFAULT_MAX_HEADERS = 100
# JSON values a body may hold (counted before it is parsed): a 262k-token prompt sent as token ids is 262k values
# and a 300k-token agent conversation a few thousand; parsing 500k values of the costliest shape (nested objects)
# holds the GIL ~50 ms (the collector paused), and their objects take ~100 bytes each.
DEFAULT_MAX_JSON_ITEMS = 500_000
# A context window of 262k tokens holds a few thousand messages; OpenAI takes 128 tools per request.
DEFAULT_MAX_MESSAGES = 20_000
DEFAULT_MAX_TOOLS = 512
DEFAULT_MAX_CONTENT_PARTS = 10_000  # in all of a body's messages
# Bodies of LARGE_BODY_BYTES or more being read and handled at once, in bytes: four of the largest body accepted.
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 4 * DEFAULT_MAX_BODY_BYTES
LARGE_BODY_BYTES = 1 << 20
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_DIGITS = re.compile(r"[0-9]+")
_HUGE_FLOAT = float(2**63)


@dataclass(frozen=True)
class Limits:
    """The gateway's input limits (see the module rules)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_session_id_chars: int = DEFAULT_MAX_SESSION_ID_CHARS
    max_json_items: int = DEFAULT_MAX_JSON_ITEMS
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_content_parts: int = DEFAULT_MAX_CONTENT_PARTS
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT


class BodyBudget:
    """The bytes of large bodies (LARGE_BODY_BYTES or more) being read and handled, at most `max_bytes` (see the
    rules). On the event loop only."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0

    def hold(self) -> BodyHold:
        """A hold for one request's body, given back with `BodyHold.release`."""
        return BodyHold(self)


class BodyHold:
    """What one request's body holds of a `BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.held_bytes = 0

    def grow_to(self, num_bytes: int) -> None:
        """Hold `num_bytes` in all once they reach LARGE_BODY_BYTES; `BodiesInFlightError` (nothing more held) if the
        budget cannot take them."""
        more = num_bytes - self.held_bytes
        if num_bytes < LARGE_BODY_BYTES or more <= 0:
            return
        budget = self._budget
        if budget.held_bytes + more > budget.max_bytes:
            raise BodiesInFlightError(f"large request bodies being read and handled already hold {budget.held_bytes} "
                                      f"bytes; this one's {num_bytes} would pass the limit (retry in a moment)",
                                      "max_body_bytes_in_flight", budget.max_bytes)
        budget.held_bytes += more
        self.held_bytes = num_bytes

    def release(self) -> None:
        """Give every byte held back (once the request's body is no longer needed)."""
        self._budget.held_bytes -= self.held_bytes
        self.held_bytes = 0


async def read_body(body: AsyncIterable[bytes], content_length: str | None, max_bytes: int,
                    hold: BodyHold | None = None) -> bytes:
    """The request body from its chunks (the edge's: `ClientGoneError` if the client leaves), refused
    (`BodyTooLargeError`) as soon as it is known to pass `max_bytes`, and (with `hold`) counted in its budget as its
    bytes arrive (`BodiesInFlightError` when they cannot be)."""
    declared = _content_length(content_length, max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in body:
        if size + len(chunk) > max_bytes:
            raise BodyTooLargeError(f"the request body passed {max_bytes} bytes while it was being read",
                                    "max_body_bytes", max_bytes)
        size += len(chunk)
        if hold is not None:
            hold.grow_to(size)
        chunks.append(chunk)
    if declared is not None and size != declared:
        raise BadRequestError(f"the request body is {size} bytes but its Content-Length says {declared}")
    return b"".join(chunks)


def _content_length(value: str | None, max_bytes: int) -> int | None:
    """The declared body size; refused when it is not a number or is over `max_bytes`."""
    if value is None:
        return None
    digits = value.strip(" \t")
    if _DIGITS.fullmatch(digits) is None:
        raise BadRequestError(f"the Content-Length header must be a whole number of bytes, got {value[:40]!r}")
    digits = digits.lstrip("0") or "0"
    if len(digits) > len(str(max_bytes)) or int(digits) > max_bytes:  # never parses a 4300-digit number
        size = f"{digits} bytes" if len(digits) <= 20 else f"a {len(digits)}-digit number of bytes"
        raise BodyTooLargeError(f"the request body is {size} (its Content-Length), more than the {max_bytes} accepted",
                                "max_body_bytes", max_bytes)
    return int(digits)


class _Collector:
    """How many parses hold the cyclic collector paused, and whether it was on before the first."""

    lock = threading.Lock()
    holds = 0
    was_enabled = True


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a large body is parsed (threads may overlap: the last one out
    turns it back on, if it was on). A parse makes only acyclic objects, and a collection triggered every 700 of
    them made parsing half a million tool schemas take 2.5 s instead of 0.34 s, all of it holding the GIL."""
    with _Collector.lock:
        if _Collector.holds == 0:
            _Collector.was_enabled = gc.isenabled()
            gc.disable()
        _Collector.holds += 1
    try:
        yield
    finally:
        with _Collector.lock:
            _Collector.holds -= 1
            if _Collector.holds == 0 and _Collector.was_enabled:
                gc.enable()


def check_depth(body: object, max_depth: int) -> bool:
    """Refuse (`NestingTooDeepError`) JSON nested deeper than `max_depth` containers; no recursion.

    True if it holds a float of magnitude at least 2**63 (`calls.py` reads such a body again: orjson
    reads an integer past 64 bits as a float), found in the same pass.
    """
    level: list[dict[str, Any] | list[Any]] = [body] if isinstance(body, (dict, list)) else []
    depth = 0
    has_huge_float = False
    while level:
        depth += 1
        if depth > max_depth:
            raise NestingTooDeepError(f"`{_deep_path(body, max_depth)}` is nested more than {max_depth} levels deep",
                                      "max_json_depth", max_depth)
        deeper: list[dict[str, Any] | list[Any]] = []
        for container in level:
            for child in container.values() if isinstance(container, dict) else container:
                if isinstance(child, (dict, list)):
                    deeper.append(child)
                elif type(child) is float and not -_HUGE_FLOAT < child < _HUGE_FLOAT:
                    has_huge_float = True
        level = deeper
    return has_huge_float


def _deep_path(body: object, max_depth: int) -> str:
    """Where the first container past `max_depth` sits, as `a.b[2]` (only called on failure)."""
    stack: list[tuple[str, object, int]] = [("", body, 1)]
    while stack:
        path, value, depth = stack.pop()
        if depth > max_depth:
            return path or "(the body)"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            if isinstance(child, (dict, list)):
                child_path = f"{path}[{key}]" if isinstance(value, list) else (f"{path}.{key}" if path else str(key))
                stack.append((child_path, child, depth + 1))
    return "(the body)"


def checked_session_id(session_id: str, where: str, max_chars: int, *, is_header: bool) -> str:
    """`session_id` if it is short enough and of allowed characters; else a 400 naming `where` it came from."""
    if len(session_id) > max_chars:
        raise SessionIdTooLongError(f"the session id in {where} is {len(session_id)} characters long; at most "
                                    f"{max_chars} are accepted", "max_session_id_chars", max_chars)
    if is_header and not (session_id.isascii() and session_id.isprintable()):
        bad = next(k for k, c in enumerate(session_id) if not (c.isascii() and c.isprintable()))
        raise BadRequestError(f"the session id in {where} must be printable ASCII (it is echoed in the answer's "
                              f"header); character {bad} is {session_id[bad]!r}")
    control = _CONTROL.search(session_id)
    if control is not None:
        raise BadRequestError(f"the session id in {where} holds a control character {control.group()!r} at "
                              f"character {control.start()}")
    if any(segment in (".", "..") for segment in session_id.split("/")):
        raise BadRequestError(f"the session id in {where} is or holds a `.` or `..` path segment, which HTTP "
                              f"clients drop from the URL that ends the session (/basin/sessions/ID/end)")
    return session_id

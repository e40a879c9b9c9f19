r"""SSE framing and reading: whole events out of a byte stream, linear in its length, holding a bounded
amount, and what the relay learns from them.

Rules:
- An event ends at a blank line; a line ends in CRLF, LF or CR (the SSE spec), so `\n\n`, `\r\n\r\n`,
  `\r\r` and their mixtures all end one. An event is given out with its line breaks, byte for byte
  as the upstream wrote it: what is passed on is exactly what arrived, only re-chunked by event.
- Each byte is scanned a bounded number of times: a new chunk is searched from at most 3 bytes
  before it (the longest separator, `\r\n\r\n`, is 4), so framing is linear in the stream's length
  whatever its chunking. A chunk that is exactly one whole LF event with nothing held (what SGLang
  and smg send) is recognised by two searches over it and given out as it came, uncopied.
- At most `max_event_bytes` of an unfinished event are held back. An event that grows past it is
  given out in pieces as its bytes arrive (`Frame.is_whole` False: to pass on, never to parse)
  until its blank line; then framing goes on as before.
- `rest()` at the end of the stream gives the unfinished event still held (the spec says a client
  drops it); `is_passing` says an unfinished event is being given out in pieces instead.
- `event_data` reads an event's `data` lines as the spec does (joined by LF, one leading space
  dropped); `is_comment` is true for an event of comment lines (`:`) only, like a keep-alive.
- `SseEvents` reads the whole events as they pass, for the relay (`proxy.py`): `data: [DONE]`, the
  first error event (`data: {"error": ...}`), the last event carrying usage (kept aside whole, so
  at most one event's bytes), whether anything but comments came, and which event not to pass on
  (the usage-only chunk, when the gateway itself asked for usage). Pieces of an oversized event
  pass unread.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from basin_runtime.gateway.signals import Usage, parse_json, usage_of

SEPARATOR = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")  # a line break, then an empty line's break
LOOKBACK_BYTES = 3  # a separator that starts in the bytes already scanned starts at most this far back
USAGE_EVENT = re.compile(rb'"usage"\s*:\s*\{|"meta_info"\s*:')
ERROR_KEY = b'"error"'  # in an SSE event: maybe an error event (a JSON string holds it only as \"error\")
DONE_DATA = b"[DONE]"
ERROR_MESSAGE_CHARS = 4096  # of an upstream's error event, kept for the log


class Frame(NamedTuple):
    """Bytes to pass on: a whole event (with its blank line), or a piece of an oversized one."""

    data: bytes
    is_whole: bool


class SseFramer:
    """Splits an SSE byte stream into whole events; holds at most about `max_event_bytes` of one."""

    def __init__(self, max_event_bytes: int) -> None:
        if max_event_bytes <= LOOKBACK_BYTES:
            raise ValueError(f"max_event_bytes must be > {LOOKBACK_BYTES}, got {max_event_bytes}")
        self.max_event_bytes = max_event_bytes
        self._held = bytearray()  # the unfinished event, not given out yet
        self._scan_from = 0  # where in `_held` the next separator search starts
        self._tail = b""  # while passing: the last bytes given out (a separator may start in them)
        self.is_passing = False  # an oversized event is being given out in pieces

    @property
    def held_bytes(self) -> int:
        """Bytes of an unfinished event held back now."""
        return len(self._held)

    def feed(self, chunk: bytes) -> list[Frame]:
        """The frames `chunk` completes, in stream order."""
        if (not self._held and not self.is_passing and chunk.endswith(b"\n\n") and chunk.find(b"\n\n") == len(chunk) - 2
                and b"\r" not in chunk):
            return [Frame(chunk, True)]  # exactly one whole LF event (how SGLang and smg send them): as it came
        frames: list[Frame] = []
        if self.is_passing:
            chunk = self._pass(chunk, frames)
        if chunk:
            self._frame(chunk, frames)
        return frames

    def rest(self) -> bytes:
        """At the end of the stream: the unfinished event held back (empty if none); framing is then reset."""
        rest = bytes(self._held)
        self._held.clear()
        self._scan_from = 0
        return rest

    def _pass(self, chunk: bytes, frames: list[Frame]) -> bytes:
        """Give out `chunk` as pieces of the oversized event up to its end; return what follows it."""
        window = self._tail + chunk
        end = _first_end(window)
        if end < 0:
            frames.append(Frame(chunk, False))
            self._tail = window[-LOOKBACK_BYTES:]
            return b""
        cut = end - len(self._tail)  # > 0: a separator wholly in the tail was found before
        frames.append(Frame(chunk[:cut], False))
        self.is_passing, self._tail = False, b""
        return chunk[cut:]

    def _frame(self, chunk: bytes, frames: list[Frame]) -> None:
        held = self._held
        if held:
            held += chunk
            buffer: bytes | bytearray = held
            scan = self._scan_from
        else:
            buffer, scan = chunk, 0
        start = 0
        for end in _event_ends(buffer, scan):
            frames.append(Frame(bytes(buffer[start:end]), True))
            start = end
        if buffer is held:
            del held[:start]
        elif start < len(chunk):
            held += chunk[start:]
        if held:
            self._scan_from = max(0, len(held) - LOOKBACK_BYTES)
            if len(held) > self.max_event_bytes:
                self._start_passing(frames)

    def _start_passing(self, frames: list[Frame]) -> None:
        """Give out the held, oversized event as a first piece; its next bytes follow as they come."""
        piece = bytes(self._held)
        self._held.clear()
        self._scan_from = 0
        self._tail = piece[-LOOKBACK_BYTES:]
        self.is_passing = True
        frames.append(Frame(piece, False))


def _event_ends(buffer: bytes | bytearray, scan: int) -> list[int]:
    """Where each event in `buffer` from `scan` on ends (just past its blank line)."""
    if buffer.find(b"\r", scan) < 0:  # LF only (SGLang and smg write that): a blank line is exactly `\n\n`
        ends = []
        while (k := buffer.find(b"\n\n", scan)) >= 0:
            scan = k + 2
            ends.append(scan)
        return ends
    return [match.end() for match in SEPARATOR.finditer(buffer, scan)]  # ~5x slower per byte than `find`


def _first_end(buffer: bytes) -> int:
    """Where the first event in `buffer` ends (just past its blank line); -1 if none does."""
    if buffer.find(b"\r") < 0:
        k = buffer.find(b"\n\n")
        return -1 if k < 0 else k + 2
    match = SEPARATOR.search(buffer)
    return -1 if match is None else match.end()


def event_data(event: bytes) -> bytes | None:
    """The event's data: its `data` field values joined by LF; None if it has no `data` field."""
    parts = []
    for line in event.splitlines():  # bytes.splitlines breaks at LF, CR and CRLF: the SSE line endings
        name, _, value = line.partition(b":")
        if name == b"data":
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


def is_comment(event: bytes) -> bool:
    """True for an event made of comment lines only (`: ping`): a keep-alive, no progress."""
    return event.startswith(b":") and all(not line or line.startswith(b":") for line in event.splitlines())


class SseEvents:
    """What the relay learns from an SSE answer's events as they pass: `[DONE]`, the first error
    event, the last usage event, and whether anything but keep-alive comments came."""

    def __init__(self, drop_usage_chunk: bool) -> None:
        self.drop_usage_chunk = drop_usage_chunk
        self.saw_done = False
        self.error: str | None = None  # the message of the first error event
        self.made_progress = False  # since the relay last cleared it: an event other than a comment
        self._last_usage_event: bytes | None = None
        self._last_usage_json: object = None  # its JSON, when `_keep` already read it

    def pass_on(self, frames: list[Frame]) -> bytes:
        """The bytes of `frames` to send on (the usage-only chunk the client did not ask for left out)."""
        if len(frames) == 1:
            frame = frames[0]
            return frame.data if not frame.is_whole or self._keep(frame.data) else b""
        return b"".join([frame.data for frame in frames if not frame.is_whole or self._keep(frame.data)])

    def usage(self) -> Usage | None:
        """The usage the last usage event reported."""
        if self._last_usage_event is None:
            return None
        return usage_of(self._last_usage_json if self._last_usage_json is not None
                        else _event_json(self._last_usage_event))

    def is_done(self, event: bytes) -> bool:
        """True for the `data: [DONE]` event."""
        return DONE_DATA in event and event_data(event) == DONE_DATA

    def _keep(self, event: bytes) -> bool:
        """Note what `event` says; False if it is not to be passed on."""
        if event.startswith(b":") and is_comment(event):
            return True
        self.made_progress = True
        if self.is_done(event):
            self.saw_done = True
            return True
        if self.error is None and ERROR_KEY in event:
            self.error = _error_of_event(event)
        if USAGE_EVENT.search(event) is not None:
            self._last_usage_event, self._last_usage_json = event, None
            if self.drop_usage_chunk:  # read now to decide, and kept: `usage()` needs it if it is the last
                self._last_usage_json = chunk = _event_json(event)
                if _is_usage_only(chunk):
                    return False
        return True


def _event_json(event: bytes) -> object:
    """The JSON of one SSE event's data, or None if it is not JSON."""
    data = event_data(event)
    try:
        return None if data is None else parse_json(data)
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def _error_of_event(event: bytes) -> str | None:
    """The message of an SSE error event (`data: {"error": {...}}`), else None."""
    chunk = _event_json(event)
    error = chunk.get("error") if isinstance(chunk, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:ERROR_MESSAGE_CHARS]
    return error[:ERROR_MESSAGE_CHARS] if isinstance(error, str) and error else None


def _is_usage_only(chunk: object) -> bool:
    """True for the final chunk `include_usage` adds (as JSON): usage and an empty `choices` list."""
    return isinstance(chunk, dict) and chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)

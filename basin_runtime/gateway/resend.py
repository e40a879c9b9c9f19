"""Recognise the unchanged prefix of a resent conversation and read only the rest.

Rules:
- An agent resends its whole conversation on every call, grown by a turn or two. When a chat call's
  body begins with the session's last body's bytes up to the end of that body's last message, those
  messages are the same messages in the same place: identical bytes put a JSON parser in the same
  state with the same values. So only the rest is read: the new message objects after the array's
  last one, the array's end and the top-level fields after it. The gateway then parses, validates,
  hashes and counts a few kilobytes instead of the whole conversation (a 300k-token one is 1.5 MB).
- The `Call` this gives is the one the full parse gives (same fields, same top-level order, the same
  checks on every new message and field) except that `messages` and `body["messages"]` hold only the
  new messages: `Call.resent` carries the counts of the others (`memo.MemoCounts`) and this body's
  own prefix for the next call. Such a body is never re-serialised: a call whose forwarding would
  rewrite a field the client sent (its own `priority` or `rid`, or a streamed call's `stream_options`
  without `include_usage`) is read in full.
- Anything out of the ordinary falls back to reading the whole body, which names any error exactly as
  before: not a message object after a comma, a tail orjson refuses, another `messages` key, nesting
  past the depth limit, a float orjson cannot keep exact, a shape error in a new message or field.
- The prefix of a body read in full is found by one forward scan of its top level (strings skipped
  with memchr, ~2.5 ms for 1.5 MB, in the worker thread the full read runs in): the top-level
  `messages` array's last element's end and the fields before the array. A body with a repeated
  top-level key (in any spelling) gets no prefix, so the array found is the one the parser kept.
- Only bodies of RESEND_MIN_BYTES or more get a prefix: below that the full read is cheap. A prefix
  holds its body (a reference, no copy); `PrefixBudget` bounds the bytes all sessions' prefixes hold
  (a body past it is read in full next time).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from basin_runtime.gateway.calls import (
    GATEWAY_FIELDS,
    Call,
    check_counts,
    check_items,
    check_message,
    common_shape,
    content_parts,
    list_of_objects,
)
from basin_runtime.gateway.errors import BadRequestError, NestingTooDeepError
from basin_runtime.gateway.json_scan import (
    BACKSLASH,
    CLOSE_LIST,
    CLOSE_OBJECT,
    COLON,
    COMMA,
    OPEN_LIST,
    OPEN_OBJECT,
    QUOTE,
    WS,
    container_end,
    last_non_ws,
    string_end,
    value_end,
)
from basin_runtime.gateway.limits import Limits, check_depth
from basin_runtime.gateway.memo import BodyPrefix, MemoCounts, Resent

RESEND_MIN_BYTES = 64 << 10  # smaller bodies are read in full: cheaper than keeping their bytes
DEFAULT_MAX_PREFIX_BYTES = 256 << 20


class PrefixBudget:
    """The bytes held by the prefixes still referenced anywhere, bounded by `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_PREFIX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._held: weakref.WeakSet[BodyPrefix] = weakref.WeakSet()
        self._lock = threading.Lock()  # large calls are counted in worker threads, small ones on the loop

    @property
    def held_bytes(self) -> int:
        """Bytes of the bodies the live prefixes hold."""
        with self._lock:
            return self._sum()

    def _sum(self) -> int:
        return sum(len(p.raw) for p in list(self._held))

    def keep(self, prefix: BodyPrefix | None) -> BodyPrefix | None:
        """`prefix` if it fits beside the others, else None (its session's next call is read in full)."""
        if prefix is None:
            return None
        with self._lock:
            if prefix in self._held:
                return prefix
            if self._sum() + len(prefix.raw) > self.max_bytes:
                return None
            self._held.add(prefix)
        return prefix


def prefix_of(call: Call) -> BodyPrefix | None:
    """The prefix of a chat call read in full (see the rules), or None."""
    raw, body = call.raw, call.body
    if call.kind != "chat" or call.resent is not None or len(raw) < RESEND_MIN_BYTES or call.messages is None:
        return None
    try:
        found = _scan_top_level(raw, len(body))
    except IndexError:  # ran off the end: not the document the parser read; no prefix
        return None
    if found is None:
        return None
    end, head_keys = found
    messages = call.messages
    return BodyPrefix(raw, end, {k: body[k] for k in head_keys}, len(messages),
                      any(m.get("role") == "assistant" for m in messages),
                      any(m.get("role") == "system" for m in messages), content_parts(messages))


def read_resent(raw: bytes, base: MemoCounts, limits: Limits) -> Call | None:
    """The call of a chat body that repeats `base.prefix` (see the rules), or None to read it in full."""
    prefix = base.prefix
    if prefix is None or len(raw) <= prefix.end or not raw.startswith(memoryview(prefix.raw)[:prefix.end]):
        return None
    try:
        return _read_tail(raw, base, prefix, limits)
    except (IndexError, orjson.JSONDecodeError, BadRequestError, NestingTooDeepError):
        return None  # the full read says what is wrong, in its own words (an item limit too: `LimitError`)


def _read_tail(raw: bytes, base: MemoCounts, prefix: BodyPrefix, limits: Limits) -> Call | None:
    max_json_depth = limits.max_json_depth
    check_items(raw, limits.max_json_items, prefix.end)  # only what follows the prefix is parsed
    view = memoryview(raw)
    new: list[dict[str, Any]] = []
    end = i = prefix.end
    while True:
        i = WS.match(raw, i).end()  # type: ignore[union-attr]  # matches the empty string at worst
        if raw[i] == CLOSE_LIST:
            break
        if raw[i] != COMMA:
            return None
        i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
        if raw[i] != OPEN_OBJECT:
            return None
        j = container_end(raw, i)
        if j < 0:
            return None
        new.append(orjson.loads(view[i:j]))
        end = i = j
    i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
    if raw[i] == CLOSE_OBJECT:
        if WS.match(raw, i + 1).end() != len(raw):  # type: ignore[union-attr]
            return None
        tail: dict[str, Any] = {}
    elif raw[i] == COMMA:
        tail = orjson.loads(b"{" + raw[i + 1:])
        if not isinstance(tail, dict) or "messages" in tail or check_depth(tail, max_json_depth):
            return None
    else:
        return None
    if any(check_depth(m, max_json_depth - 2) for m in new):  # a message sits two levels down
        return None
    body = {**prefix.head, "messages": new, **tail}
    if not _forwards_unchanged(body):
        return None
    common_shape(body)
    for k, message in enumerate(new):
        check_message(prefix.num_messages + k, message)
    tools = list_of_objects(body, "tools")
    num_parts = prefix.num_parts + content_parts(new)
    check_counts(prefix.num_messages + len(new), len(tools or ()), num_parts, limits)
    own = BodyPrefix(raw, end, prefix.head, prefix.num_messages + len(new),
                     prefix.has_assistant or any(m.get("role") == "assistant" for m in new),
                     prefix.has_system or any(m.get("role") == "system" for m in new), num_parts)
    user = body.get("user") or None
    sent = {k: body[k] for k in GATEWAY_FIELDS if k in body}
    return Call("chat", body, new, tools, (), 0, False, user, raw, sent, resent=Resent(base, own))


def _forwards_unchanged(body: Mapping[str, Any]) -> bool:
    """True if forwarding changes no field the client sent (so the body is spliced, never re-serialised)."""
    if "priority" in body or "rid" in body:
        return False
    options = body.get("stream_options")
    return not (body.get("stream") is True and options is not None
                and not (isinstance(options, dict) and options.get("include_usage") is True))


def _scan_top_level(raw: bytes, num_fields: int) -> tuple[int, Sequence[str]] | None:
    """(end of the last message, the keys before `messages`) of a JSON object body, or None."""
    i = WS.match(raw).end()  # type: ignore[union-attr]
    if raw[i] != OPEN_OBJECT:
        return None
    i += 1
    keys: list[str] = []
    end = head = -1
    while True:
        i = WS.match(raw, i).end()  # type: ignore[union-attr]
        if raw[i] != QUOTE:
            return None
        j = string_end(raw, i)
        key = orjson.loads(raw[i:j]) if BACKSLASH in raw[i:j] else raw[i + 1:j - 1].decode("utf-8")
        keys.append(key)
        i = WS.match(raw, j).end()  # type: ignore[union-attr]
        if raw[i] != COLON:
            return None
        i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
        j = value_end(raw, i)
        if j < 0:
            return None
        if key == "messages":
            if raw[i] != OPEN_LIST:
                return None
            last = last_non_ws(raw, j - 2)  # j - 1 is the closing bracket
            if raw[last] != CLOSE_OBJECT:
                return None
            end, head = last + 1, len(keys) - 1
        i = WS.match(raw, j).end()  # type: ignore[union-attr]
        if raw[i] == CLOSE_OBJECT:
            break
        if raw[i] != COMMA:
            return None
        i += 1
    if end < 0 or len(set(keys)) != len(keys) or len(keys) != num_fields:
        return None
    return end, keys[:head]

"""Parse and validate the body of an inference call.

Rules:
- The body must be UTF-8 JSON text (RFC 8259: no NaN or Infinity, no number too large for a
  float or past Python's 4300-digit integers, no lone UTF-16 surrogate) holding an object nested
  at most `max_json_depth` levels (`limits.py`). Anything else is a 400 naming what is wrong.
- Before it is parsed, a body is refused (413 `too_many_items`) if it holds more than `max_json_items`
  values (`json_scan`: a bound from its commas and brackets first, counted exactly only past it), so
  no parse builds millions of objects: parsing holds the GIL, a worker thread does not help.
- orjson reads a body under STDLIB_PARSE_BYTES (several times faster than the standard library on
  the hot path, and it refuses invalid UTF-8, NaN, infinities and lone surrogates itself); a body it
  refuses, or one holding a float of magnitude 2**63 or more (orjson reads an integer past 64 bits as
  a float), is read again by the standard library's parser, which names the error or keeps the
  integer exact. A larger body is read by the standard library alone, with the cyclic collector
  paused (`limits.collector_paused`): as fast on large text, and at most twice the body's size in
  memory while it parses, where orjson reserves ~13 times it (its reader sizes a value pool by the
  input's length: 780 MB for one 60 MB message).
- A chat call holds at most `max_messages` messages, `max_tools` tools and `max_content_parts` content
  parts in all its messages (413 `too_many_items`, naming the limit).
- The shape of what the gateway itself reads is checked here, once, so later code can trust it
  (SGLang validates the rest); a wrong one is a 400 naming the field:
    chat: a non-empty `messages` list of objects with a string `role`; a message's `content` is
      absent, null, a string or a list of content parts (objects with a string `type`; a `text`
      part has a string `text`); its `tool_calls` absent, null or a list of objects whose
      `function`, if given, is an object; `tools` absent, null or a list of objects.
    `/v1/completions` needs `prompt`; `/generate` needs `text` or `input_ids`: a string, a list of
      strings, a list of token ids or a list of such lists.
    every endpoint: `stream` absent, null or true/false; `stream_options` absent, null or an
      object whose `include_usage` is absent, null or true/false; `user` absent, null or a string.
- A chat call whose messages already hold an assistant turn is a continuation: plainly not the
  first call of its session. Raw-prompt calls (`/v1/completions`, `/generate`) never are.
- A list of prompts is a batch; the task text of a raw-prompt call is its (first) text prompt.
- A chat call of a known session that resends its last body's conversation (a byte prefix) may be
  read by `resend.py` instead: only the new messages and fields, with the same checks.
- The forwarded body (`Call.encode`) is the client's own bytes with the top-level fields the
  gateway set spliced in before the closing brace; a field the client sent itself and the gateway
  set (every copy of its own `priority` or `rid`, whatever their values; `stream_options` without
  `include_usage`) is cut out of the bytes first (`json_scan.without_members`), never by
  re-serialising the body: a large body costs one copy and no encoder holding the GIL. The gateway
  sets no body field but `GATEWAY_FIELDS`.
- `session_id` is the gateway's only with `engine_session_cache` (`tag_session`: the session's routing key,
  every copy the client sent cut out); otherwise a client's own `session_id` is forwarded untouched.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from basin_runtime.gateway.errors import BadRequestError, NestingTooDeepError, TooManyItemsError
from basin_runtime.gateway.json_scan import (
    CLOSE_OBJECT,
    array_items,
    count_values,
    last_non_ws,
    object_pieces,
    top_level_members,
    values_bound,
)
from basin_runtime.gateway.limits import (
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_JSON_ITEMS,
    Limits,
    check_depth,
    collector_paused,
)
from basin_runtime.gateway.memo import Resent
from basin_runtime.messages import Message

CallKind = Literal["chat", "completion", "generate"]
UPSTREAM_PATHS: dict[CallKind, str] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "generate": "/generate",
}
SESSION_TAG = "session_id"  # SGLang's session radix cache tag (engine_session_cache)
GATEWAY_FIELDS = ("priority", "rid", "stream_options", SESSION_TAG)  # the top-level fields the gateway may set
# Every copy the client sent of these is cut out, whatever its value: JSON parsers keep the last of duplicated keys,
# smg may keep another, so a copy equal to the gateway's value must not keep the others in the bytes (issue 46).
IDENTITY_FIELDS = frozenset({"priority", "rid"})
TAGGED_IDENTITY_FIELDS = IDENTITY_FIELDS | {SESSION_TAG}  # ... and `session_id` once the gateway tags the call
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a valid UTF-8 text holds a surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")
STDLIB_PARSE_BYTES = 1 << 20  # a body this large is parsed by the standard library (memory: see the rules)
PIECEWISE_PARSE_BYTES = 1 << 20  # ... member by member (and an array this large item by item)
_LIMITS = Limits()


@dataclass(frozen=True)
class Call:
    """A parsed inference call."""

    kind: CallKind
    body: dict[str, Any]
    messages: Sequence[Message] | None  # chat calls
    tools: Sequence[Mapping[str, Any]] | None  # chat calls
    texts: tuple[str, ...]  # raw-prompt calls: the text prompts
    token_ids_count: int  # raw-prompt calls: prompt tokens sent as ids
    is_batch: bool
    user: str | None
    raw: bytes = b""  # the body as the client sent it
    sent: Mapping[str, Any] = field(default_factory=dict)  # the client's own values of GATEWAY_FIELDS
    resent: Resent | None = None  # read after its session's last body's prefix: `messages` holds the new ones
    is_session_tagged: bool = False  # `session_id` is the gateway's (`tag_session`), every client copy cut out

    @property
    def read_bytes(self) -> int:
        """The bytes of the body the gateway reads (parses, hashes, counts): past the prefix of a resent call."""
        if self.resent is None or self.resent.base.prefix is None:
            return len(self.raw)
        return len(self.raw) - self.resent.base.prefix.end

    @property
    def path(self) -> str:
        """The upstream path this call goes to."""
        return UPSTREAM_PATHS[self.kind]

    @property
    def num_bytes(self) -> int:
        """The size of the body as sent."""
        return len(self.raw)

    @property
    def is_stream(self) -> bool:
        """True if the client asked for a streamed (SSE) answer."""
        return self.body.get("stream") is True

    @property
    def is_continuation(self) -> bool:
        """True if the conversation already holds an assistant turn."""
        if self.resent is not None:
            return self.resent.prefix.has_assistant
        return self.messages is not None and any(m.get("role") == "assistant" for m in self.messages)

    def encode(self) -> bytes:
        """The body to forward in one buffer (`encode_pieces` joined)."""
        pieces = self.encode_pieces()
        return pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)

    def encode_pieces(self) -> tuple[bytes | memoryview, ...]:
        """The body to forward, as pieces sent one after another: the client's bytes (views, never copied), less the
        gateway's fields it sent that the gateway changed, then the gateway's values of them (see the rules)."""
        identity = TAGGED_IDENTITY_FIELDS if self.is_session_tagged else IDENTITY_FIELDS
        changed = [k for k in GATEWAY_FIELDS if k in self.body and (k in identity or not (
            k in self.sent and _same(self.body[k], self.sent[k])))]
        replaced = [k for k in self.sent if k not in self.body or k in changed]
        if not self.raw:
            return (json.dumps(self.body, ensure_ascii=False).encode("utf-8"),)
        if not changed and not replaced:
            return (self.raw,)
        fields = b",".join(_member(k, self.body[k]) for k in changed)  # the gateway's values
        if not replaced:
            end = last_non_ws(self.raw, len(self.raw) - 1)
            assert self.raw[end] == CLOSE_OBJECT, "a parsed body is a JSON object"
            comma = b"," if len(self.body) > len(changed) else b""
            return memoryview(self.raw)[:end], comma, fields, b"}"
        if self.resent is not None:  # `resend.read_resent` reads such a body in full: a bug if reached
            raise AssertionError("a resent call's body holds only its new messages; it cannot drop a field")
        members = top_level_members(self.raw)
        if members is None:  # not the object the parser read: a bug if reached
            raise AssertionError("a parsed body's top level does not scan as one object")
        return object_pieces(self.raw, [m for m in members if m[0] not in replaced], fields)


def tag_session(call: Call, tag: str) -> Call:
    """The call tagged for the engines' session radix cache: `tag` as its top-level `session_id` (any the client
    sent is cut out of the forwarded bytes, as its own `priority` and `rid` are)."""
    call.body[SESSION_TAG] = tag
    return dataclasses.replace(call, is_session_tagged=True)


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and a == b)


def _member(key: str, value: object) -> bytes:
    """`"key":value` in compact JSON (orjson; the standard library for an integer past 64 bits in a client's
    `stream_options`, which orjson does not write)."""
    try:
        return orjson.dumps(key) + b":" + orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps({key: value}, ensure_ascii=False, separators=(",", ":"))[1:-1].encode("utf-8")


def parse_call(kind: CallKind, raw: bytes, limits: Limits = _LIMITS) -> Call:
    """Parse one call's body; raises `BadRequestError` (or a `LimitError`) naming what is wrong."""
    body = read_json_object(raw, limits.max_json_depth, limits.max_json_items)
    common_shape(body)
    user = body.get("user") or None
    sent = {k: body[k] for k in GATEWAY_FIELDS if k in body}
    if kind == "chat":
        messages = _messages(body)
        tools = list_of_objects(body, "tools")
        check_counts(len(messages), len(tools or ()), content_parts(messages), limits)
        return Call(kind, body, messages, tools, (), 0, False, user, raw, sent)
    name = "prompt" if kind == "completion" else ("text" if "text" in body else "input_ids")
    if name not in body:
        wanted = "`prompt`" if kind == "completion" else "`text` or `input_ids`"
        raise BadRequestError(f"the request has no {wanted}")
    texts, ids_count, is_batch = _prompt(name, body[name])
    return Call(kind, body, None, None, texts, ids_count, is_batch, user, raw, sent)


def read_json_object(raw: bytes, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
                     max_json_items: int = DEFAULT_MAX_JSON_ITEMS) -> dict[str, Any]:
    """A request body as a JSON object (the rules' first points); `BadRequestError` or a `LimitError` naming what is
    wrong."""
    check_items(raw, max_json_items)
    if len(raw) >= STDLIB_PARSE_BYTES:
        return _read_json_object_slowly(raw, max_json_depth)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and not check_depth(body, max_json_depth):
        return body
    return _read_json_object_slowly(raw, max_json_depth)


def check_items(raw: bytes, max_json_items: int, start: int = 0) -> None:
    """Refuse (`TooManyItemsError`) a JSON text (`raw[start:]`) of more than `max_json_items` values, before it is
    parsed: a cheap bound first, the exact count (`json_scan.count_values`) only when the bound passes the limit."""
    if (len(raw) - start) // 2 + 1 <= max_json_items:  # every value but the last takes two bytes at least (`0,`)
        return
    if values_bound(raw, start) <= max_json_items or count_values(raw, max_json_items, start) <= max_json_items:
        return
    raise TooManyItemsError(f"the request body holds more than {max_json_items} JSON values (counted before it is "
                            f"parsed)", "max_json_items", max_json_items)


def check_counts(num_messages: int, num_tools: int, num_parts: int, limits: Limits) -> None:
    """Refuse (`TooManyItemsError`) a chat call over one of the item limits, naming it."""
    for count, what, limit in ((num_messages, "messages", "max_messages"), (num_tools, "tools", "max_tools"),
                               (num_parts, "content parts in its messages", "max_content_parts")):
        value = getattr(limits, limit)
        if count > value:
            raise TooManyItemsError(f"the request has {count} {what}; at most {value} are accepted", limit, value)


def content_parts(messages: Sequence[Message]) -> int:
    """The content parts in all of `messages` (a string content counts none)."""
    return sum(len(content) for m in messages if isinstance(content := m.get("content"), list))


def _read_json_object_slowly(raw: bytes, max_json_depth: int) -> dict[str, Any]:
    """`read_json_object` with the standard library's parser: the exact error, integers of any size, and at most
    twice the body's size in memory while it parses (orjson holds ~13 times a large body's size). A large body is
    read member by member, and an array member item by item (`_read_in_pieces`), so the GIL is held for one item's
    parse at a time, not the whole body's."""
    pieces = _read_in_pieces(raw) if len(raw) >= PIECEWISE_PARSE_BYTES else None
    body = _read_whole(raw, max_json_depth) if pieces is None else pieces
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, not {_kind(body)}")
    check_depth(body, max_json_depth)
    # The gateway forwards the body as UTF-8 (and logs parts of it): it must be valid Unicode. An escaped pair (an
    # emoji) is fine; a lone half is not.
    if b"\\u" in raw and _SURROGATE_ESCAPE.search(raw) is not None:
        path = _surrogate_path(body)
        if path is not None:
            raise BadRequestError(f"`{path}` holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff without its "
                                  "pair), which is not valid Unicode text")
    return body


def _read_whole(raw: bytes, max_json_depth: int) -> object:
    """`raw` parsed in one piece by the standard library; `BadRequestError` naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"the request body is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    try:
        with collector_paused():
            return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError as exc:  # a last resort: the depth limit below is far under Python's recursion limit
        raise NestingTooDeepError("the request body is nested too deeply to read", "max_json_depth",
                                  max_json_depth) from exc
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, or an integer past 4300 digits
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc


def _read_in_pieces(raw: bytes) -> dict[str, Any] | None:
    """A JSON object body parsed member by member, the items of a large array member one by one (the same values as
    one parse of the whole: identical bytes, the same parser); None if anything is off (the whole parse then says
    what)."""
    members = top_level_members(raw)
    if members is None:
        return None
    body: dict[str, Any] = {}
    try:
        with collector_paused():
            for key, _, start, end in members:
                items = array_items(raw, start, end) if end - start >= PIECEWISE_PARSE_BYTES else None
                body[key] = _load(raw, start, end) if items is None else [_load(raw, i, j) for i, j in items]
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return body


def _load(raw: bytes, start: int, end: int) -> object:
    return json.loads(str(memoryview(raw)[start:end], "utf-8"), parse_constant=_no_constant,
                      parse_float=_finite_float)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is too large")
    return value


def _surrogate_path(body: object) -> str | None:
    """Where the first string (or key) that is not encodable as UTF-8 sits, as `a.b[2]`; None if every one is (found
    in one pass without paths: an escaped emoji, a surrogate pair, is common and fine)."""
    stack: list[object] = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                break
        elif isinstance(value, dict):
            if not all(_encodes(str(key)) for key in value):
                break
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    else:
        return None
    return _path_of_surrogate(body)


def _path_of_surrogate(body: object) -> str:
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path or "(the body)"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                key_path = f"{path}.{key}" if path else str(key)
                if not _encodes(str(key)):
                    return f"{path or '(the body)'} key {key!r}"
                stack.append((key_path, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{k}]", item) for k, item in reversed(list(enumerate(value))))
    return "(the body)"


def _encodes(text: str) -> bool:
    """True unless `text` holds a lone surrogate (a pair is decoded into one character: only a lone half is left)."""
    return text.isascii() or _SURROGATE.search(text) is None


def _kind(value: object) -> str:
    """A JSON value's type in words: `a string`, `a number`, `true`, `null`, `an object`, ..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return "a number"
    names: dict[type, str] = {str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _optional(container: Mapping[str, Any], key: str, expected: type, words: str, where: str = "") -> None:
    value = container.get(key)
    if value is not None and not isinstance(value, expected):
        raise BadRequestError(f"`{where}{key}` must be {words} or null, got {_kind(value)}")


def common_shape(body: Mapping[str, Any]) -> None:
    _optional(body, "stream", bool, "true or false")
    _optional(body, "stream_options", dict, "an object")
    _optional(body.get("stream_options") or {}, "include_usage", bool, "true or false", "stream_options.")
    _optional(body, "user", str, "a string")


def list_of_objects(body: Mapping[str, Any], key: str, where: str = "") -> list[dict[str, Any]] | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadRequestError(f"`{where}{key}` must be a list of objects or null, got {_kind(value)}")
    for k, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadRequestError(f"`{where}{key}[{k}]` must be an object, got {_kind(item)}")
    return value


def _messages(body: Mapping[str, Any]) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("the request has no `messages` (a non-empty list is required)")
    for k, message in enumerate(messages):
        check_message(k, message)
    return messages


def check_message(k: int, message: object) -> None:
    """The shape of `messages[k]` (the rules); `BadRequestError` naming the field."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequestError(f"messages[{k}] must be an object with a string `role`")
    _content(f"messages[{k}].content", message.get("content"))
    for j, call in enumerate(list_of_objects(message, "tool_calls", f"messages[{k}].") or ()):
        if "function" in call and not isinstance(call["function"], dict):
            raise BadRequestError(f"`messages[{k}].tool_calls[{j}].function` must be an object (with `name` "
                                  f"and `arguments`), got {_kind(call['function'])}")


def _content(where: str, content: object) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequestError(f"`{where}` must be a string, a list of content parts or null, got {_kind(content)}")
    for k, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            got = "an object without one" if isinstance(part, dict) else _kind(part)
            raise BadRequestError(f"`{where}[{k}]` must be a content part (an object with a string `type`), got {got}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            got = _kind(part.get("text"))
            raise BadRequestError(f"`{where}[{k}].text` must be a string in a `text` part, got {got}")


def _prompt(name: str, value: object) -> tuple[tuple[str, ...], int, bool]:
    """(text prompts, number of token ids, is batch) of a `prompt`/`text`/`input_ids` value."""
    if isinstance(value, str):
        return (value,), 0, False
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return tuple(value), 0, True
        if all(_is_token_id(v) for v in value):
            return (), len(value), False
        if all(isinstance(v, list) and all(_is_token_id(i) for i in v) for v in value):
            return (), sum(len(v) for v in value), True
    raise BadRequestError(f"`{name}` must be a string, a list of strings or token ids, or a list of lists of "
                          f"token ids, got {_kind(value) if value != [] else 'an empty list'}")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

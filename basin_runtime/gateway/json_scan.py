"""Scanning JSON bytes: value ends, top-level members, and value counts.

Reading JSON bytes without parsing them: where a value ends, the members of the top-level object, and how many
values a body holds.

Rules:
- Strings are skipped with memchr (`bytes.find` of the next quote, an even run of backslashes before it
  escaping itself), so a long string costs one C call, not a Python step per byte; everything else is found
  with one regex search per structural character.
- Functions take the bytes of a document the caller has parsed (or is about to refuse): they never raise on
  malformed input but answer -1 / None, and the caller falls back to the parser's own verdict.
- `count_values` counts JSON values (objects, arrays, strings, numbers, literals; not the keys of members)
  exactly, stopping as soon as the count passes its limit; `values_bound` is a cheaper upper bound (every
  comma and opening bracket, inside strings too) read in slices, so neither holds the GIL for long.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import orjson

WS = re.compile(rb"[ \t\n\r]*")  # JSON whitespace
_STRUCT = re.compile(rb'["{}\[\]]')
_COUNTED = re.compile(rb'["{\[,]')
_SCALAR_END = re.compile(rb"[^,}\] \t\n\r]*")
QUOTE, BACKSLASH, OPEN_OBJECT, OPEN_LIST, CLOSE_OBJECT, CLOSE_LIST, COMMA, COLON = b'"\\{[}],:'
_SLICE_BYTES = 1 << 20  # `values_bound` counts this much per C call


def string_end(raw: bytes, i: int) -> int:
    """The index just after the string whose opening quote is at `i` (-1 if it does not end)."""
    j = i + 1
    while True:
        j = raw.find(b'"', j)
        if j < 0:
            return -1
        k = j
        while raw[k - 1] == BACKSLASH:
            k -= 1
        if (j - k) % 2 == 0:  # an even run of backslashes escapes itself, not the quote
            return j + 1
        j += 1


def container_end(raw: bytes, i: int) -> int:
    """The index just after the object or list opening at `i` (-1 if it does not end); strings skipped."""
    depth = 0
    search = _STRUCT.search
    while True:
        match = search(raw, i)
        if match is None:
            return -1
        i = match.start()
        char = raw[i]
        if char == QUOTE:
            i = string_end(raw, i)
            if i < 0:
                return -1
            continue
        depth += 1 if char in (OPEN_OBJECT, OPEN_LIST) else -1
        i += 1
        if depth == 0:
            return i


def value_end(raw: bytes, i: int) -> int:
    """The index just after the JSON value starting at `i` (-1 if it does not end)."""
    first = raw[i]
    if first == QUOTE:
        return string_end(raw, i)
    if first in (OPEN_OBJECT, OPEN_LIST):
        return container_end(raw, i)
    return _SCALAR_END.match(raw, i).end()  # type: ignore[union-attr]


def last_non_ws(raw: bytes, i: int) -> int:
    """The index of the last non-whitespace byte at or before `i`."""
    while raw[i] in b" \t\n\r":
        i -= 1
    return i


Member = tuple[str, int, int, int]  # key, start of its quote, start of its value, end of its value


def top_level_members(raw: bytes) -> list[Member] | None:
    """(key, start of its quote, start of its value, end of its value) of each member of a JSON object body, in
    order; None if the bytes are not one object followed by nothing but whitespace (or a key does not decode)."""
    try:
        i = WS.match(raw).end()  # type: ignore[union-attr]
        if raw[i] != OPEN_OBJECT:
            return None
        i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
        members: list[Member] = []
        if raw[i] == CLOSE_OBJECT:
            return members if WS.match(raw, i + 1).end() == len(raw) else None  # type: ignore[union-attr]
        while True:
            if raw[i] != QUOTE:
                return None
            start, j = i, string_end(raw, i)
            if j < 0:
                return None
            key = orjson.loads(raw[i:j]) if BACKSLASH in raw[i:j] else raw[i + 1:j - 1].decode("utf-8")
            i = WS.match(raw, j).end()  # type: ignore[union-attr]
            if raw[i] != COLON:
                return None
            i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
            j = value_end(raw, i)
            if j < 0:
                return None
            members.append((key, start, i, j))
            i = WS.match(raw, j).end()  # type: ignore[union-attr]
            if raw[i] == CLOSE_OBJECT:
                return members if WS.match(raw, i + 1).end() == len(raw) else None  # type: ignore[union-attr]
            if raw[i] != COMMA:
                return None
            i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
    except (IndexError, UnicodeDecodeError, orjson.JSONDecodeError):
        return None


def object_pieces(raw: bytes, members: Sequence[Member], extra: bytes) -> tuple[bytes | memoryview, ...]:
    """An object of `members` (of `raw`'s `top_level_members`, as their bytes: views, not copies) then the members
    in `extra` (`"key":value,...`), as pieces sent one after another."""
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = [b"{"]
    for k, (_, start, _, end) in enumerate(members):
        if k:
            pieces.append(b",")
        pieces.append(view[start:end])
    if extra:
        pieces += [b"," if members else b"", extra]
    pieces.append(b"}")
    return tuple(pieces)


def array_items(raw: bytes, start: int, end: int) -> list[tuple[int, int]] | None:
    """(start, end) of each item of the JSON array `raw[start:end]`, in order; None if it is not one array."""
    try:
        if raw[start] != OPEN_LIST:
            return None
        i = WS.match(raw, start + 1).end()  # type: ignore[union-attr]
        items: list[tuple[int, int]] = []
        if raw[i] == CLOSE_LIST:
            return items if i + 1 == end else None
        while True:
            j = value_end(raw, i)
            if j < 0 or j == i:
                return None
            items.append((i, j))
            i = WS.match(raw, j).end()  # type: ignore[union-attr]
            if raw[i] == CLOSE_LIST:
                return items if i + 1 == end else None
            if raw[i] != COMMA:
                return None
            i = WS.match(raw, i + 1).end()  # type: ignore[union-attr]
    except IndexError:
        return None


def values_bound(raw: bytes, start: int = 0) -> int:
    """An upper bound of the values in the JSON text `raw[start:]`: 1 + its commas and opening brackets, strings
    included."""
    total = 1
    for low in range(start, len(raw), _SLICE_BYTES):  # a slice per C call, so no call holds the GIL for long
        high = low + _SLICE_BYTES
        total += raw.count(b",", low, high) + raw.count(b"{", low, high) + raw.count(b"[", low, high)
    return total


def count_values(raw: bytes, limit: int, start: int = 0) -> int:
    """The number of values in the JSON text `raw[start:]` (see the rules), or a number past `limit` as soon as the
    count passes it. Malformed text is counted as far as it goes (the parser then says what is wrong)."""
    count = 1
    i = start
    search = _COUNTED.search
    while True:
        match = search(raw, i)
        if match is None:
            return count
        i = match.start()
        char = raw[i]
        if char == QUOTE:
            i = string_end(raw, i)
            if i < 0:
                return count
            continue
        i += 1
        if char == COMMA:
            count += 1
        else:  # an opening bracket: its first value, unless it is empty
            j = WS.match(raw, i).end()  # type: ignore[union-attr]
            if j < len(raw) and raw[j] not in (CLOSE_OBJECT, CLOSE_LIST):
                count += 1
        if count > limit:
            return count

"""The request targets the gateway passes through, checked on the client's bytes.

Rules:
- The target is judged on the bytes the client sent (`raw_path`, `query_string`), not on the server's decoded
  path (uvicorn decodes percent escapes with replacement characters, so `%ff` and a real U+FFFD look alike).
- It must be printable ASCII without spaces (RFC 3986 characters), every `%` must start an escape of two hex
  digits, and the path percent-decoded must be UTF-8 text without control characters: else a 400 naming the
  path (quoted, cut short).
- Decoded, no segment may be empty, `.` or `..`, and it may hold no backslash; no encoded slash (`%2f`) either:
  so `/v1/models/../../workers` and its encodings cannot reach the router's internals (404 `not_found`).
- What goes upstream is the target as the client encoded it (its escapes kept), so the upstream decodes the
  same text the gateway checked.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_to_bytes

from basin_runtime.gateway.errors import BadRequestError, PathNotForwardedError

_TARGET = re.compile(rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")  # RFC 3986 pchar, '/', '?'
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
QUOTED_CHARS = 120


def forwarded_target(raw_path: bytes, query: bytes) -> tuple[str, str]:
    """(path, query) to send upstream for a pass-through request, both as the client encoded them; a
    `BadRequestError` or `PathNotForwardedError` naming the path otherwise (see the rules)."""
    shown = raw_path[:QUOTED_CHARS].decode("latin-1")
    for part, what in ((raw_path, "path"), (query, "query")):
        if _TARGET.fullmatch(part) is None:
            raise BadRequestError(f"the request {what} {shown if what == 'path' else part[:QUOTED_CHARS]!r} holds "
                                  f"a byte that is not allowed in a URL (printable ASCII without spaces, `%` only "
                                  f"before two hex digits)")
    try:
        path = unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"the request path {shown!r} is not UTF-8 text once percent-decoded (byte "
                              f"{exc.start}: {exc.reason})") from exc
    if (control := _CONTROL.search(path)) is not None:
        raise BadRequestError(f"the request path {shown!r} holds the control character {control.group()!r} once "
                              f"percent-decoded")
    if any(s in ("", ".", "..") for s in path.split("/")[1:]) or "\\" in path or b"%2f" in raw_path.lower():
        raise PathNotForwardedError(f"{path[:QUOTED_CHARS]!r} is not a path the gateway forwards")
    return raw_path.decode("ascii"), query.decode("ascii")

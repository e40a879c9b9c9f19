"""`Inbound`: one call as the edge hands it to the gateway, plain data and stdlib callables.

Rules:
- The edge (`app.py`, `edge.py`) reads the request; nothing below it sees a web framework's request.
  What it hands down: the headers the gateway reads (the first value of each, as the request carries
  them), every header in order (forwarded upstream), the body's chunks as they arrive, and the ASGI
  `receive` whose next message, once the body is read, is the client's disconnect
  (`basin_runtime/disconnect.py`).
- The body's chunks raise `ClientGoneError` if the client leaves while sending them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass

from basin_runtime.disconnect import Receive


@dataclass(frozen=True)
class CallHeaders:
    """The headers of one call the gateway reads, and all of them (lower-cased names, in order) to forward."""

    session_id: str  # the session header's value ("" without one)
    workload: str | None  # the workload header's value (None without one, or empty)
    authorization: str | None  # the client's API key header, as sent
    content_length: str | None  # as declared (`limits.read_body` checks it)
    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Inbound:
    """One inference call from the edge: its headers, its body's chunks, and the watch on its client."""

    headers: CallHeaders
    body: AsyncIterable[bytes]
    receive: Receive  # after the body: the client's disconnect

"""The edge: a Starlette request read into the plain data the gateway below it takes (`inbound.py`).

Rules:
- Only the edge modules (`app.py`, `admin.py`, `server.py`, this one; `errors.error_response` and
  `proxy.py`, which write the answers) import Starlette; `gateway.py`, `waiting.py` and the rest below
  take an `Inbound`.
- A header the gateway reads is its first value in the request, exactly as Starlette's `Headers.get`
  reads it; every header goes down in order, for forwarding.
- A client that leaves while sending its body is `ClientGoneError` (Starlette says `ClientDisconnect`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import ClientDisconnect, Request

from basin_runtime.gateway.errors import ClientGoneError
from basin_runtime.gateway.inbound import CallHeaders, Inbound


def inbound(request: Request, session_header: str, workload_header: str) -> Inbound:
    """The call `request` carries, as the gateway takes it."""
    headers = request.headers
    return Inbound(CallHeaders(session_id=headers.get(session_header, ""),
                               workload=headers.get(workload_header) or None,
                               authorization=headers.get("authorization"),
                               content_length=headers.get("content-length"),
                               items=tuple(headers.items())),
                   body_chunks(request), request.receive)


async def body_chunks(request: Request) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive; `ClientGoneError` if the client leaves while sending them."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect as exc:
        raise ClientGoneError("the client went away while sending its request body") from exc

"""The gateway's side of recovery at tool boundaries (`basin_runtime/policy/recovery.py`): a held session's calls wait.

Rules:
- `Held` (a collapse is under way): the session stays live; its entry gets a `recovery_hold` future. Its next
  call (the one at its tool boundary; one in flight goes on) waits on it before it is forwarded, and with
  `engine_session_cache` the session is closed on the engines once, when that call is held, so its KV is
  unreferenced (evictable first) while it waits; the call that goes on after the hold reopens the tag
  (SGLang's `open_radix_session` drops the tombstone).
- `Resumed`: the future resolves "admitted" and the call is forwarded; its wait is the hold's.
- A held session that is shed (its hold ran out while capacity was short), ended or handed over: the future
  resolves with that verdict, and the waiting call gets the same answer a queued call would (`Shed`: 503
  with Retry-After; ended: 409), never silence.
- The client leaving a held call does not end its session: the hold is the policy's, and it ends by the
  policy's clock (bounded), not the client's.
- Pure bookkeeping on `SessionEntry`; no HTTP here (the waiting room raises the gateway's errors).
"""

from __future__ import annotations

import asyncio

from basin_runtime.disconnect import Receive, race_client
from basin_runtime.gateway.errors import ClientGoneError
from basin_runtime.gateway.sessions import SessionEntry, Verdict


def hold(entry: SessionEntry) -> None:
    """The policy holds the session: its next call waits (a hold already pending stays as it is)."""
    if entry.recovery_hold is None or entry.recovery_hold.done():
        entry.recovery_hold = asyncio.get_running_loop().create_future()
        entry.is_engine_session_closed = False


def end_hold(entry: SessionEntry, verdict: Verdict) -> None:
    """The hold is over with `verdict` ("admitted": resumed); a call waiting on it goes on with that answer."""
    pending = entry.recovery_hold
    if pending is not None and not pending.done():
        pending.set_result(verdict)


def is_held(entry: SessionEntry) -> bool:
    """True while the session's calls must wait for the end of its hold."""
    return entry.recovery_hold is not None and not entry.recovery_hold.done()


async def wait_held(entry: SessionEntry, receive: Receive) -> Verdict:
    """Hold a call until the session's hold is over; its verdict (`ClientGoneError` if the client leaves)."""
    pending = entry.recovery_hold
    assert pending is not None
    return await race_client(asyncio.shield(pending), receive, ClientGoneError)

# Waiting on something while watching the client for a disconnect.
#
# Rules:
# - Only after the request body has been read: the next ASGI message is then `http.disconnect`,
#   sent when the client goes away (or, in-process, once the response is complete).
# - What is awaited is cancelled (and waited for) when the client goes first or the caller is
#   cancelled; the watcher never outlives the call. A result ready together with a disconnect wins.
"""Await something unless the client disconnects first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from basin_runtime.gateway.errors import ClientGoneError

T = TypeVar("T")


async def until_disconnect(receive: Receive) -> None:
    """Return when the client has disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_client(awaitable: Awaitable[T], receive: Receive) -> T:
    """The result of `awaitable`, or `ClientGoneError` (with `awaitable` cancelled) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            await _cancel(task)
    if task.cancelled():
        raise ClientGoneError("the client disconnected")
    return task.result()


async def _cancel(task: asyncio.Future[T]) -> None:
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # mark it retrieved: the client is gone, nobody will read it

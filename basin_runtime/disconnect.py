# Waiting on something while watching an ASGI client for a disconnect: the gateway's and the
# emulator's one implementation.
#
# Rules:
# - Only after the request body has been read: the next ASGI message is then `http.disconnect`,
#   sent when the client goes away (or, in-process, once the response is complete).
# - What is awaited is cancelled (and waited for) when the client goes first or the caller is
#   cancelled; its exception, if it raised one while being cancelled, is retrieved (nobody will read
#   it), so asyncio never logs "exception was never retrieved": the client is gone, `gone()` is what
#   the caller gets. The watcher never outlives the call. A result (or error) ready together with a
#   disconnect wins.
# - The client leaving raises `gone()`: each server names its own error (the gateway maps it to 499).
# - `ClientWatch` is the same race for several awaits in turn (the gateway: the upstream's answer head,
#   then streaming its body) with one watcher for all of them; its owner closes it when the call ends.
# - Stdlib only: the ASGI `receive` callable is typed here, not imported from a web framework.
"""`race_client`: await something unless the ASGI client disconnects first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client disconnected before the answer was ready."""


async def until_disconnect(receive: Receive) -> None:
    """Return when the client has disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_client(awaitable: Awaitable[T], receive: Receive,
                      gone: Callable[[], BaseException] = ClientDisconnected) -> T:
    """The result of `awaitable`, or `gone()` raised (with `awaitable` cancelled) if the client leaves."""
    watch = ClientWatch(receive)
    try:
        return await watch.race(awaitable, gone)
    finally:
        watch.close()


class ClientWatch:
    """One watcher of an ASGI client, raced against one await after another (see the rules)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._watcher: asyncio.Future[None] | None = None  # started by the first race
        self.is_taken = False  # another owner (a streamed answer) will close it

    async def race(self, awaitable: Awaitable[T], gone: Callable[[], BaseException] = ClientDisconnected) -> T:
        """The result of `awaitable`, or `gone()` raised (with `awaitable` cancelled) if the client has left."""
        task = asyncio.ensure_future(awaitable)
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(until_disconnect(self._receive))
        both: set[asyncio.Future[Any]] = {task, self._watcher}
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            is_first = task.done()
        finally:
            if not task.done():
                await _cancel(task)
        if not is_first:
            raise gone()
        return task.result()

    def close(self) -> None:
        """Stop watching (the call has ended)."""
        if self._watcher is not None:
            self._watcher.cancel()


async def _cancel(task: asyncio.Future[T]) -> None:
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # mark it retrieved: the client is gone, nobody will read it

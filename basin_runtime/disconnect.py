"""`race_client`: await something unless the ASGI client disconnects first.

Waiting on something while watching an ASGI client for a disconnect: the gateway's and the
emulator's one implementation.

Rules:
- Only after the request body has been read: the next ASGI message is then `http.disconnect`,
  sent when the client goes away (or, in-process, once the response is complete).
- What is awaited is cancelled (and waited for) when the client goes first or the caller is
  cancelled; its exception, if it raised one while being cancelled, is retrieved (nobody will read
  it), so asyncio never logs "exception was never retrieved": the client is gone, `gone()` is what
  the caller gets. The watcher never outlives the call. A result (or error) ready together with a
  disconnect wins.
- The client leaving raises `gone()`: each server names its own error (the gateway maps it to 499).
- `ClientWatch` is the same race for several awaits in turn (the gateway: the upstream's answer head,
  then streaming its body) with one watcher for all of them; its owner closes it when the call ends.
- The awaited work runs in the caller's own task (no task and no `asyncio.wait` per race: the hot path
  races twice per call): when the client leaves, the watcher cancels the future the caller's task is
  suspended on (CPython's `Task._fut_waiter`), so the cancellation reaches exactly the innermost await,
  and a result already delivered is not lost (the task resumes with it: the result wins). A cancel
  someone else asked for (`Task.cancelling()`) stays a cancel.
- Stdlib only: the ASGI `receive` callable is typed here, not imported from a web framework.
"""

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
        self._racer: asyncio.Task[Any] | None = None  # the task awaiting in `race`, while it does
        self._has_left = False
        self._is_interrupted = False  # the watcher cancelled what the racer awaited
        self.is_taken = False  # another owner (a streamed answer) will close it

    async def race(self, awaitable: Awaitable[T], gone: Callable[[], BaseException] = ClientDisconnected) -> T:
        """The result of `awaitable`, or `gone()` raised (with `awaitable` cancelled) if the client has left."""
        racer = asyncio.current_task()
        if racer is None:
            raise RuntimeError("ClientWatch.race outside a task")
        if self._has_left:
            _discard(awaitable)
            raise gone()
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        self._racer, self._is_interrupted = racer, False
        try:
            result = await awaitable
        except BaseException:
            if self._is_interrupted and not racer.cancelling():  # ours, not a cancel someone else asked for
                raise gone() from None
            raise
        finally:
            self._racer = None
        if self._is_interrupted:  # the awaitable swallowed the cancel: the client is gone all the same
            raise gone()
        return result

    def close(self) -> None:
        """Stop watching (the call has ended)."""
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        await until_disconnect(self._receive)
        self._has_left = True
        self._interrupt()

    def _interrupt(self) -> None:
        """Cancel what the racer awaits: the future its task waits on, so a result already there wins (the
        task then resumes with it); while it runs or holds a result, try again on the loop's next turn."""
        racer = self._racer
        if racer is None or racer.done():
            return
        waiter = getattr(racer, "_fut_waiter", None)  # what a suspended task awaits (CPython's Task)
        if waiter is not None and waiter.cancel():
            self._is_interrupted = True
            return
        asyncio.get_running_loop().call_soon(self._interrupt)


def _discard(awaitable: Awaitable[Any]) -> None:
    """Drop an awaitable that will not be awaited (a coroutine closed, a future cancelled), without a warning."""
    if asyncio.iscoroutine(awaitable):
        awaitable.close()
    elif isinstance(awaitable, asyncio.Future):
        awaitable.cancel()

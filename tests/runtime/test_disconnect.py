"""`race_client`, the one wait-unless-the-client-leaves of the gateway and the emulator."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import MutableMapping
from typing import Any

import pytest

from basin_emulate.errors import ClientGoneError as EmulatorClientGone
from basin_runtime.disconnect import ClientDisconnected, ClientWatch, race_client
from basin_runtime.gateway.errors import ClientGoneError as GatewayClientGone

pytestmark = pytest.mark.asyncio


def _receive(disconnect: asyncio.Event) -> Any:
    async def receive() -> MutableMapping[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}
    return receive


async def _never() -> str:
    await asyncio.sleep(3600)
    return "late"


async def _fails_when_cancelled() -> str:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        raise RuntimeError("cleanup failed while cancelled") from None
    return "late"


@pytest.mark.parametrize("gone", [ClientDisconnected, GatewayClientGone, EmulatorClientGone])
async def test_the_client_leaving_cancels_the_work_and_raises_the_callers_error(gone: type[Exception]) -> None:
    disconnect = asyncio.Event()
    work = asyncio.ensure_future(_never())
    asyncio.get_running_loop().call_later(0.01, disconnect.set)
    with pytest.raises(gone):
        await race_client(work, _receive(disconnect), gone)
    assert work.cancelled()
    assert issubclass(gone, ClientDisconnected)


async def test_a_result_wins_and_the_watcher_does_not_outlive_the_call() -> None:
    disconnect = asyncio.Event()
    before = len(asyncio.all_tasks())

    async def quick() -> str:
        return "answer"

    assert await race_client(quick(), _receive(disconnect)) == "answer"
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before


async def test_an_exception_raised_while_cancelled_is_retrieved_not_logged() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    disconnect = asyncio.Event()
    work = asyncio.ensure_future(_fails_when_cancelled())
    await asyncio.sleep(0)  # the work is running
    loop.call_soon(disconnect.set)
    with pytest.raises(ClientDisconnected):
        await race_client(work, _receive(disconnect))
    assert work.done() and not work.cancelled()  # it ended with its own error, which nobody else reads
    del work
    gc.collect()
    await asyncio.sleep(0)
    assert reported == []


async def test_a_result_delivered_when_the_client_leaves_is_not_lost() -> None:
    """The disconnect arrives on the same loop turn the work's result does: the caller gets the result."""
    loop = asyncio.get_running_loop()
    disconnect = asyncio.Event()
    result: asyncio.Future[str] = loop.create_future()

    def both_at_once() -> None:
        disconnect.set()  # the watcher wakes first on the next turn ...
        result.set_result("answer")  # ... with the caller's task already due to resume with its result

    watch = ClientWatch(_receive(disconnect))
    loop.call_later(0.01, both_at_once)
    try:
        assert await watch.race(result) == "answer"
        with pytest.raises(ClientDisconnected):  # the next await of the call sees the client gone
            await watch.race(_never())
    finally:
        watch.close()


async def test_a_cancel_someone_else_asked_for_stays_a_cancel() -> None:
    disconnect, waiting = asyncio.Event(), asyncio.Event()
    watch = ClientWatch(_receive(disconnect))

    async def work() -> str:
        waiting.set()  # the call is inside `race`, and goes on to its wait in this same step
        return await _never()

    async def call() -> str:
        try:
            return await watch.race(work())
        finally:
            watch.close()

    task = asyncio.ensure_future(call())
    await waiting.wait()
    task.cancel()
    disconnect.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_work_running_when_the_client_leaves_is_cancelled_at_its_next_await() -> None:
    disconnect = asyncio.Event()
    steps: list[str] = []

    async def busy() -> str:
        disconnect.set()
        for k in range(3):  # never suspended on a future: `sleep(0)` yields a bare turn
            await asyncio.sleep(0)
            steps.append(f"turn {k}")
        await asyncio.sleep(3600)  # the first real wait: cancelled here
        return "late"

    with pytest.raises(ClientDisconnected):
        await race_client(busy(), _receive(disconnect))
    assert steps == ["turn 0", "turn 1", "turn 2"]


async def test_a_race_after_the_client_left_raises_at_once_and_drops_the_work_cleanly(
        recwarn: pytest.WarningsRecorder) -> None:
    disconnect = asyncio.Event()
    disconnect.set()
    watch = ClientWatch(_receive(disconnect))
    with pytest.raises(ClientDisconnected):
        await watch.race(_never())
    with pytest.raises(ClientDisconnected):
        await watch.race(_never())  # not awaited: closed, so no "never awaited" warning
    watch.close()
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]

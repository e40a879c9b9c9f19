"""`race_client`, the one wait-unless-the-client-leaves of the gateway and the emulator."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import MutableMapping
from typing import Any

import pytest

from basin_emulate.errors import ClientGoneError as EmulatorClientGone
from basin_runtime.disconnect import ClientDisconnected, race_client
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

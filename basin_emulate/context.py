# What both roles share: the configuration, the model clock with its lag window, the prompt counter,
# the queue order, the metrics, and waiting on work while watching the client.
#
# Rules:
# - `race_client` is only called once the request body has been read: the next ASGI message is then
#   `http.disconnect`, sent when the client goes away. The work is cancelled (and waited for) when the
#   client goes first; its own cancellation handlers give back what the request held.
# - `prompt_of` turns a call into the cache's view of its prompt (identity.py); a message the chat
#   template cannot render is a bad request.
"""The per-server context shared by the prefill and decode roles."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import Receive

from basin_emulate.calls import Call
from basin_emulate.clock import ModelClock
from basin_emulate.config import EmulatorConfig
from basin_emulate.errors import BadRequestError, ClientGoneError
from basin_emulate.identity import Prompt, PromptCounter
from basin_emulate.metrics import EmulatorMetrics
from basin_emulate.ordering import QueueOrder
from basin_runtime.tokenizer import TokenizerError

T = TypeVar("T")


@dataclass(frozen=True)
class ServerContext:
    """One emulated server's shared parts."""

    config: EmulatorConfig
    clock: ModelClock
    counter: PromptCounter
    order: QueueOrder
    metrics: EmulatorMetrics

    def latency_s(self, start_s: float, end_s: float) -> float:
        """Wall seconds between two model times."""
        return self.clock.wall_s(end_s - start_s)


async def prompt_of(counter: PromptCounter, call: Call) -> Prompt:
    """The cache's view of the call's prompt."""
    if call.messages is not None:
        try:
            return await counter.chat(call.messages, call.tools)
        except (TokenizerError, TypeError) as exc:
            raise BadRequestError(f"messages: {exc}") from exc
    if call.text is not None:
        return await counter.text(call.text)
    assert call.input_ids is not None
    return counter.ids(call.input_ids)


async def race_client(awaitable: Awaitable[T], receive: Receive) -> T:
    """The result of `awaitable`, or `ClientGoneError` (with `awaitable` cancelled) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGoneError("the client disconnected")
    return task.result()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass

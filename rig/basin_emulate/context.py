"""What both roles share: the configuration, the model clock with its lag window, the prompt counter,
the queue order, the metrics, and waiting on work while watching the client.

Rules:
- Waiting on work while watching the client is `basin_runtime.disconnect.race_client` (shared with
  the gateway), raising `ClientGoneError`; the work's own cancellation handlers give back what the
  request held.
- `prompt_of` turns a call into the cache's view of its prompt (identity.py); a message the chat
  template cannot render is a bad request.
"""

from __future__ import annotations

from dataclasses import dataclass

from basin_emulate.calls import Call
from basin_emulate.clock import ModelClock
from basin_emulate.config import EmulatorConfig
from basin_emulate.errors import BadRequestError
from basin_emulate.identity import Prompt, PromptCounter
from basin_emulate.metrics import EmulatorMetrics
from basin_emulate.ordering import QueueOrder
from basin_runtime.tokenizer import TokenizerError


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

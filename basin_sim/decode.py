# One decode instance: KV memory reservation (SGLang PD's pre-allocation) and a running batch whose
# steps are aggregated between events.
#
# Rules:
# - A request reserves prompt + max(completion, decode_reserve_tokens) tokens BEFORE its prefill starts
#   (SGLang's decode pre-allocates, then prefill runs, then the KV is transferred). Requests wait in the
#   pre-allocation queue in (priority, seq) order; the head blocks the queue (no backfilling), as in
#   SGLang's `pop_preallocated`. The reservation is freed when the request leaves the running batch.
# - The running batch runs steps back to back while it is not empty. A request emits one token per
#   step: it leaves after `completion_tokens` steps. The step time depends on the batch size and the KV
#   read (prompts plus tokens emitted so far); it is recomputed at every join or leave and held constant
#   in between (an "epoch"; the KV grows by B tokens per step inside one, which the model ignores).
# - Time advances in epochs, not steps: the instance keeps a continuous step counter S(t) and a counter
#   G(t) of steps shorter than the step SLO. A request's steps and good steps are the differences of
#   those counters between its join and its leave, so per-token latency is recorded for every step
#   without storing any step. A request may join mid-step (error < 1 step per call).
# - Lending: `lent_tokens` of idle memory may hold finished calls' KV for the prefix cache (the engine
#   keeps the ledger). Lent memory counts against the capacity; the engine reclaims it first whenever
#   the queue head does not fit (`head_shortfall_tokens`).
# Invariants: 0 <= reserved_tokens + lent_tokens <= capacity_tokens; queued_tokens == sum of queued reservations;
# sum_prompt_tokens and sum_start_steps cover exactly the running requests.
"""A decode instance: pre-allocation of KV memory and an event-aggregated running batch."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from basin_sim.profile import Profile

_EPSILON_S = 1e-9


@dataclass(slots=True, eq=False)
class DecodeSlot:
    """One request as decode sees it."""

    priority: float
    prompt_tokens: int
    completion_tokens: int
    reservation_tokens: int
    start_step: float = 0.0
    end_step: float = 0.0
    start_good: float = 0.0
    steps: float = 0.0  # set when it leaves
    good_steps: float = 0.0
    is_cancelled: bool = False
    request_id: int = -1  # the engine's id for the request


class DecodeInstance:
    """KV reservation, pre-allocation queue and running batch of one decode instance."""

    def __init__(self, index: int, profile: Profile, capacity_tokens: int, step_slo_s: float) -> None:
        self.index = index
        self.profile = profile
        self.capacity_tokens = capacity_tokens
        self.step_slo_s = step_slo_s
        self.reserved_tokens = 0
        self.lent_tokens = 0
        self.queued_tokens = 0
        self._queue: list[tuple[float, int, DecodeSlot]] = []
        self._seq = 0
        self._running: dict[int, DecodeSlot] = {}
        self._ends: list[tuple[float, int, DecodeSlot]] = []
        self._epoch_s = 0.0
        self._steps = 0.0  # S at the epoch start
        self._good = 0.0  # G at the epoch start
        self._step_s = 0.0
        self._sum_prompt_tokens = 0
        self._sum_start_steps = 0.0
        self.version = 0  # changes whenever the next completion time may have changed

    # --- reservation ---------------------------------------------------------------------------

    @property
    def committed_tokens(self) -> int:
        """Reserved plus queued tokens: what a router balances on."""
        return self.reserved_tokens + self.queued_tokens

    @property
    def num_queued(self) -> int:
        """Requests waiting for a reservation (cancelled ones included until they reach the head)."""
        return len(self._queue)

    def enqueue(self, slot: DecodeSlot) -> None:
        """Queue a request for its reservation."""
        self._seq += 1
        heapq.heappush(self._queue, (slot.priority, self._seq, slot))
        self.queued_tokens += slot.reservation_tokens

    def cancel_queued(self, slot: DecodeSlot) -> None:
        """Withdraw a queued request (it is skipped when it reaches the head)."""
        slot.is_cancelled = True
        self.queued_tokens -= slot.reservation_tokens

    def pop_reserved(self) -> list[DecodeSlot]:
        """Reserve memory for queue heads while they fit; return them in order."""
        granted: list[DecodeSlot] = []
        while self._queue:
            slot = self._queue[0][2]
            if slot.is_cancelled:
                heapq.heappop(self._queue)
                continue
            if self.reserved_tokens + self.lent_tokens + slot.reservation_tokens > self.capacity_tokens:
                break
            heapq.heappop(self._queue)
            self.queued_tokens -= slot.reservation_tokens
            self.reserved_tokens += slot.reservation_tokens
            granted.append(slot)
        return granted

    def head_shortfall_tokens(self) -> int:
        """Tokens the queue head lacks now (0: no head, or it fits)."""
        while self._queue and self._queue[0][2].is_cancelled:
            heapq.heappop(self._queue)
        if not self._queue:
            return 0
        need = self.reserved_tokens + self.lent_tokens + self._queue[0][2].reservation_tokens
        return max(0, need - self.capacity_tokens)

    def idle_tokens(self) -> int:
        """Memory neither reserved nor lent."""
        return self.capacity_tokens - self.reserved_tokens - self.lent_tokens

    def free(self, slot: DecodeSlot) -> None:
        """Give back a reservation (the request finished, or was aborted before decoding)."""
        self.reserved_tokens -= slot.reservation_tokens
        assert self.reserved_tokens >= 0

    # --- running batch -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Requests decoding now."""
        return len(self._running)

    def kv_tokens(self) -> float:
        """Context tokens the running batch reads per step, at the last epoch start."""
        return self._sum_prompt_tokens + len(self._running) * self._steps - self._sum_start_steps

    def join(self, slot: DecodeSlot, now: float) -> None:
        """A request's KV arrived: it decodes from the next step on."""
        self._advance(now)
        slot.start_step, slot.start_good = self._steps, self._good
        slot.end_step = self._steps + slot.completion_tokens
        self._running[id(slot)] = slot
        self._sum_prompt_tokens += slot.prompt_tokens
        self._sum_start_steps += slot.start_step
        self._seq += 1
        heapq.heappush(self._ends, (slot.end_step, self._seq, slot))
        self._new_epoch(now)

    def leave(self, slot: DecodeSlot, now: float) -> None:
        """Take a request out of the running batch (finished or killed) and free its memory."""
        self._advance(now)
        del self._running[id(slot)]
        slot.steps = self._steps - slot.start_step
        slot.good_steps = self._good - slot.start_good
        self._sum_prompt_tokens -= slot.prompt_tokens
        self._sum_start_steps -= slot.start_step
        self.free(slot)
        self._new_epoch(now)

    def next_completion_s(self) -> float | None:
        """When the next running request emits its last token, or None if none runs."""
        while self._ends and id(self._ends[0][2]) not in self._running:
            heapq.heappop(self._ends)
        if not self._ends:
            return None
        return self._epoch_s + max(0.0, self._ends[0][0] - self._steps) * self._step_s

    def pop_finished(self, now: float, on_leave: Callable[[DecodeSlot], None]) -> None:
        """Remove every request whose last step ends by `now`, each at its own end time, calling `on_leave`."""
        while (when := self.next_completion_s()) is not None and when <= now + _EPSILON_S:
            slot = heapq.heappop(self._ends)[2]
            self.leave(slot, when)
            on_leave(slot)

    def _advance(self, now: float) -> None:
        if self._running and self._step_s > 0:
            steps = (now - self._epoch_s) / self._step_s
            self._steps += steps
            if self._step_s < self.step_slo_s:
                self._good += steps
        self._epoch_s = now

    def _new_epoch(self, now: float) -> None:
        self._epoch_s = now
        batch = len(self._running)
        self._step_s = self.profile.decode_step_s(batch, self.kv_tokens()) if batch else 0.0
        self.version += 1

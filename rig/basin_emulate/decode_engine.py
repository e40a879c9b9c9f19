"""The decode half in real time: basin_sim's DecodeInstance (pre-allocation queue, running batch with
aggregated steps) driven by the model clock, with the tokens each request has emitted so far.

Rules:
- A request queues for its pre-allocation in the instance's queue, ordered like the prefill queue
  (ordering.py), and is admitted by SGLang's rule (basin_sim/decode.py: prompt + 512 of headroom per
  active request, prompt + min(max_new_tokens, 4096) when the batch is small); decode memory then
  grows with every token and the instance retracts requests when it runs out (a retracted request's
  tokens stop until it resumes). A request that cannot fit even an empty instance is refused
  (`RequestTooLargeError`): it would block the queue head forever.
- Memory is handed out as the simulator hands it out (`DecodeInstance.grant`: kept KV, the instance's
  `reclaim`, goes first when the head lacks room). Granted, a request waits for its KV (the caller
  fetches it from the prefill side), then `join`s the batch. Its first token came with the KV
  (prefill computed it); the other n - 1 are decode steps, so its slot runs n - 1 steps and leaves
  (freeing its reservation) after the last one.
- Tokens out at model time t: 1 + floor(tokens the instance decoded for it by t)
  (`DecodeInstance.emitted_tokens`, which knows its stints between retractions).
- One timer drives the batch: at the instance's next event (`DecodeInstance.next_event_s`: a
  completion, or memory running out), or earlier at the next flush while a streaming request decodes.
  A flush wakes every streaming request whose token count grew; flushes are at least `flush_wall_s`
  of wall time apart (tokens due in between go out in one chunk, as with SGLang's --stream-interval > 1).
- Withdrawal (client gone, KV never came) gives back what the request holds wherever it is
  (`DecodeInstance.withdraw`): its queue place, its reservation, or its batch seat (leaving at the
  wall's model time now).

Invariant: `_tickets` holds exactly the requests that are queued, granted or decoding.
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, field

from basin_emulate.clock import ModelClock
from basin_emulate.errors import RequestTooLargeError
from basin_runtime.clock import Timer
from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.goodput import STEP_SLO_S
from basin_sim.profile import Profile

MIN_FLUSH_WALL_S = 0.005
_STEP_EPSILON = 1e-9


class DecodeStage(enum.Enum):
    """Where a decode request is."""

    PREALLOC = "prealloc"  # waiting for its memory reservation
    TRANSFER = "transfer"  # reserved, waiting for its KV
    DECODING = "decoding"
    DONE = "done"


@dataclass(eq=False)
class DecodeTicket:
    """One request inside the emulated decode."""

    slot: DecodeSlot
    total_tokens: int  # completion tokens, the first (prefill's) included
    is_streaming: bool
    arrival_s: float
    granted: asyncio.Future[float]  # model time of the reservation
    finished: asyncio.Future[float]  # model time of its last token
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    stage: DecodeStage = DecodeStage.PREALLOC
    join_s: float = 0.0
    emitted: int = 0  # tokens out as of the last flush (streaming requests only)


class DecodeEngine:
    """One decode instance of the profile, in real time."""

    def __init__(self, profile: Profile, clock: ModelClock, capacity_tokens: int,
                 flush_wall_s: float = MIN_FLUSH_WALL_S) -> None:
        self.profile = profile
        self.clock = clock
        self.capacity_tokens = capacity_tokens
        self.flush_wall_s = flush_wall_s
        self.instance = DecodeInstance(0, profile, capacity_tokens, STEP_SLO_S)
        self.generated_tokens = 0
        self._tickets: dict[int, DecodeTicket] = {}
        self._next_id = 0
        self._timer: Timer | None = None

    def count(self, stage: DecodeStage) -> int:
        """Requests at `stage` now."""
        return sum(1 for ticket in self._tickets.values() if ticket.stage == stage)

    @property
    def is_idle(self) -> bool:
        """True when no request is inside."""
        return not self._tickets

    def submit(self, prompt_tokens: int, max_new_tokens: int | None, total_tokens: int, priority_key: float,
               is_streaming: bool, arrival_s: float) -> DecodeTicket:
        """Queue a request (arrived at model time `arrival_s`) for its pre-allocation."""
        slot = DecodeSlot(priority_key, prompt_tokens, max(0, total_tokens - 1), max_new_tokens)
        if not self.instance.can_ever_fit(slot):
            need = prompt_tokens + max(self.instance.reserved_decode_tokens,
                                       slot.estimate_new_tokens(self.instance.clip_max_new_tokens))
            raise RequestTooLargeError(
                f"the request needs {need} tokens of KV ({prompt_tokens} prompt + its completion estimate), "
                f"more than this decode server's pool (max_total_num_tokens={self.capacity_tokens})")
        self._next_id += 1
        slot.request_id = self._next_id
        loop = asyncio.get_running_loop()
        ticket = DecodeTicket(slot, total_tokens, is_streaming, arrival_s, loop.create_future(), loop.create_future())
        self._tickets[slot.request_id] = ticket
        self.instance.enqueue(slot)
        self._grant()
        return ticket

    async def wait_granted(self, ticket: DecodeTicket) -> float:
        """Until the request's memory is reserved; the model time it was."""
        return await asyncio.shield(ticket.granted)

    def join(self, ticket: DecodeTicket, at_s: float) -> None:
        """The request's KV arrived at model time `at_s` (>= every event so far): it decodes from now on."""
        self.instance.join(ticket.slot, at_s)
        ticket.stage, ticket.join_s, ticket.emitted = DecodeStage.DECODING, at_s, 1
        ticket.progress.set()
        self._reschedule()

    async def wait_finished(self, ticket: DecodeTicket) -> float:
        """Until the request's last token; its model time."""
        return await asyncio.shield(ticket.finished)

    def tokens_out(self, ticket: DecodeTicket, now_s: float) -> int:
        """Tokens the request has emitted by model time `now_s`."""
        if ticket.stage == DecodeStage.DONE:
            return ticket.total_tokens if ticket.finished.done() else ticket.emitted
        if ticket.stage != DecodeStage.DECODING:
            return 0
        steps = math.floor(self.instance.emitted_tokens(ticket.slot, now_s) + _STEP_EPSILON)
        return min(ticket.total_tokens, 1 + max(0, steps))

    def withdraw(self, ticket: DecodeTicket) -> None:
        """Give back what an unfinished request holds (no-op once it is done)."""
        stage, slot = ticket.stage, ticket.slot
        if stage == DecodeStage.DONE:
            return
        ticket.stage = DecodeStage.DONE
        del self._tickets[slot.request_id]
        is_decoding = stage == DecodeStage.DECODING
        self.instance.withdraw(slot, self.clock.catch_up() if is_decoding else self.clock.now_s)
        if is_decoding:
            self._reschedule()
        if stage != DecodeStage.PREALLOC:  # a reservation or a seat came free
            self._grant()

    # --- the batch -------------------------------------------------------------------------------------

    def _grant(self) -> None:
        """Hand out memory as the simulator does (`DecodeInstance.grant`): kept KV (the decode radix cache,
        `instance.reclaim`) goes first when the head lacks room."""
        self.instance.grant(self.clock.now_s, self._granted)

    def _granted(self, slot: DecodeSlot) -> None:
        ticket = self._tickets[slot.request_id]
        ticket.stage = DecodeStage.TRANSFER
        ticket.granted.set_result(self.clock.now_s)

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        when = self.instance.next_event_s()
        if when is None:
            return
        if any(t.is_streaming and t.stage == DecodeStage.DECODING for t in self._tickets.values()):
            flush_s = self.clock.now_s + max(self.instance.step_s, self.flush_wall_s * self.clock.time_scale)
            when = min(when, flush_s)
        self._timer = self.clock.call_at(when, self._on_tick)

    def _on_tick(self) -> None:
        self._timer = None
        now = self.clock.now_s
        self.instance.pop_finished(now, self._on_leave)
        for ticket in self._tickets.values():
            if ticket.is_streaming and ticket.stage == DecodeStage.DECODING:
                out = self.tokens_out(ticket, now)
                if out > ticket.emitted:
                    ticket.emitted = out
                    ticket.progress.set()
        self._grant()
        self._reschedule()

    def _on_leave(self, slot: DecodeSlot) -> None:
        """A request emitted its last token (pop_finished has just taken it out at its own end time)."""
        when = self.instance.epoch_s
        ticket = self._tickets.pop(slot.request_id)
        ticket.stage, ticket.emitted = DecodeStage.DONE, ticket.total_tokens
        self.generated_tokens += ticket.total_tokens
        ticket.finished.set_result(when)
        ticket.progress.set()

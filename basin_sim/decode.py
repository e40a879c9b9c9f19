"""One decode instance of SGLang's PD disaggregation: the pre-allocation queue, KV memory that grows
with every decoded token, retraction when it runs out, and a running batch whose steps are
aggregated between events. Read from sglang 0.5.23 (design.md names the functions).

Rules (pre-allocation):
- A request is pre-allocated BEFORE its prefill may start. Pre-allocation takes its prompt's KV
  (`prompt_tokens`); it then holds them while prefill runs and the KV is transferred, and while it
  decodes it grows by one token per step. Nothing else is reserved per request.
- Admission of the queue head: with running batch R, active requests A (pre-allocated or running),
  retractable = sum over R of (prompt + emitted) and est(r) = min(max_new_tokens, CLIP) (agents rarely
  set max_tokens: then est = CLIP = SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, 4096):
    allocatable = free - max(RESERVED x |A|, max over R of (prompt + est) - retractable)
                  - sum over retracted requests of (prompt + emitted + RESERVED)
    required    = max(prompt + RESERVED, prompt + est - retractable)
  RESERVED = --num-reserved-decode-tokens (512); free = capacity - lent - allocated. The head fits
  when required <= allocatable. So a lone request needs prompt + 4096; in a busy batch, prompt + 512
  plus 512 of headroom for every active request.
- Order: the queue is sorted by priority (SGLang sorts it with --enable-priority-scheduling; without
  it, it is FIFO, which is the order the engine's default priority, the call's send time, gives);
  ties in arrival order. The first head that does not fit stops the pass (no backfilling). While any
  retracted request waits, nothing new is pre-allocated.
- `grant` hands memory out: retracted requests resume, then queue heads are pre-allocated; while the
  next one lacks room and memory is lent, the shortfall is reclaimed (`reclaim`) and the pass goes on.
  `withdraw` takes a request out wherever it is (queued, pre-allocated, running or retracted). The
  simulator's request path and the emulator both use these two.

Rules (retraction):
- Before each step the batch needs one new token of KV per running request (page size 1). When free
  memory is short of that, lent memory is reclaimed first (`reclaim`: decode wins), then SGLang
  retracts running requests, at least one, until the step fits, keeping at least one.
  Order (--retraction-policy length, the default): fewest emitted tokens first, ties the longest
  prompt first; `priority`: the least urgent (largest priority value here) first, then by length.
- A retracted request's KV is backed up to host and freed on the device; it waits in the retracted
  queue (FIFO) and resumes, before any new pre-allocation, once prompt + emitted + RESERVED fits in
  free - RESERVED x |A| (no single-request term, retracted ones not counted); it then rejoins the
  batch where it stopped. The host-to-device restore is not timed. The token after a resume comes
  late: it counts as one extra step, above the step SLO.
- If one request alone is left and the step still does not fit, SGLang aborts it; here it runs on
  over capacity instead (admission's single-request term makes this need a completion > 4096 and
  every other token of the instance pre-allocated) and `overruns` counts it.

Rules (steps):
- The running batch runs steps back to back while it is not empty. A request leaves after
  `completion_tokens` steps. The step time depends on the batch size and the KV read (prompts plus
  tokens emitted so far); it is recomputed at every join, leave or retraction and held constant in
  between (an "epoch"; the KV grows by B tokens per step inside one, which the step time ignores
  but memory does not).
- Time advances in epochs, not steps: the instance keeps a continuous step counter S(t) and a counter
  G(t) of steps shorter than the step SLO. A request's steps and good steps are the differences of
  those counters over its stints in the batch, so per-token latency is recorded for every step
  without storing any step. A request may join mid-step (error < 1 step per call).
- `next_event_s` is the earlier of the next completion and the step at which memory runs out.
- Lending: `lent_tokens` of idle memory may hold finished calls' KV (kv_tiers.py keeps the ledger and
  sets `lent_tokens`); lent memory counts against free memory.

Invariants (`check`): allocated_waiting_tokens == sum of prompts of pre-allocated, not running
slots; queued_tokens == sum of prompts of queued, not cancelled, slots; the running sums cover
exactly the running slots; a slot is in at most one of queue / pre-allocated / running / retracted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from basin_sim.profile import Profile

NUM_RESERVED_DECODE_TOKENS = 512  # --num-reserved-decode-tokens (arg_groups/fields/disagg.py)
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION (environ.py)
RetractionPolicy = Literal["length", "priority"]
_EPSILON_S = 1e-9
_INF = float("inf")


@dataclass(slots=True, eq=False)
class DecodeSlot:
    """One request as decode sees it."""

    priority: float
    prompt_tokens: int
    completion_tokens: int  # steps it decodes
    max_new_tokens: int | None = None  # what the request asked for (None: not set, SGLang's clip applies)
    request_id: int = -1  # the caller's id for the request
    is_cancelled: bool = False
    is_allocated: bool = False  # pre-allocated, not running yet
    is_running: bool = False
    is_retracted: bool = False
    emitted: float = 0.0  # tokens decoded before the current stint
    stint_start_step: float = 0.0
    stint_start_good: float = 0.0
    end_step: float = 0.0
    steps: float = 0.0  # over all stints, set as each ends
    good_steps: float = 0.0
    retractions: int = 0

    def estimate_new_tokens(self, clip: int) -> int:
        """SGLang's estimate of the completion: min(max_new_tokens, clip)."""
        return clip if self.max_new_tokens is None else min(self.max_new_tokens, clip)


class DecodeInstance:
    """Pre-allocation queue, growing KV memory, retraction and running batch of one decode instance."""

    def __init__(self, index: int, profile: Profile, capacity_tokens: int, step_slo_s: float, *,
                 reserved_decode_tokens: int = NUM_RESERVED_DECODE_TOKENS,
                 clip_max_new_tokens: int = CLIP_MAX_NEW_TOKENS,
                 retraction_policy: RetractionPolicy = "length") -> None:
        self.index = index
        self.profile = profile
        self.capacity_tokens = capacity_tokens
        self.step_slo_s = step_slo_s
        self.reserved_decode_tokens = reserved_decode_tokens
        self.clip_max_new_tokens = clip_max_new_tokens
        self.retraction_policy = retraction_policy
        self._lent_tokens = 0
        self.queued_tokens = 0
        self.allocated_waiting_tokens = 0
        self.num_allocated_waiting = 0
        self.num_retractions = 0
        self.overruns = 0
        self.reclaim: Callable[[int], None] | None = None  # frees lent memory (the engine's ledger), then syncs
        self._queue: list[tuple[float, int, DecodeSlot]] = []
        self._seq = 0
        self._retracted: list[DecodeSlot] = []
        self._retracted_need = 0  # sum of prompt + emitted + RESERVED over retracted slots
        self._running: dict[int, DecodeSlot] = {}
        self._ends: list[tuple[float, int, DecodeSlot]] = []
        self._peaks: list[tuple[int, int, DecodeSlot]] = []  # (-(prompt + est), seq, slot), lazy max-heap
        self._epoch_s = 0.0
        self._steps = 0.0  # S at the epoch start
        self._good = 0.0  # G at the epoch start
        self._step_s = 0.0
        self._sum_base = 0.0  # sum over running of prompt + emitted - stint_start_step: KV = base + B x S
        self._full_step = _INF  # S at which the next step no longer fits
        self.version = 0  # changes whenever the next event time may have changed

    # --- memory --------------------------------------------------------------------------------

    @property
    def lent_tokens(self) -> int:
        """Idle memory lent to the prefix cache (set by the engine from its ledger)."""
        return self._lent_tokens

    @lent_tokens.setter
    def lent_tokens(self, tokens: int) -> None:
        if tokens != self._lent_tokens:
            self._lent_tokens = tokens
            self._full_step = self._compute_full_step()
            self.version += 1

    @property
    def num_queued(self) -> int:
        """Requests waiting for memory: the pre-allocation queue (cancelled ones until they reach the head)
        and the retracted ones."""
        return len(self._queue) + len(self._retracted)

    @property
    def num_retracted(self) -> int:
        """Retracted requests waiting to resume."""
        return len(self._retracted)

    @property
    def num_active(self) -> int:
        """Pre-allocated plus running requests (SGLang's active count, which each holds RESERVED for)."""
        return self.num_allocated_waiting + len(self._running)

    def kv_tokens(self) -> float:
        """Context tokens the running batch holds (and reads per step), at the last epoch start."""
        return self._sum_base + len(self._running) * self._steps

    def used_tokens(self, now: float | None = None) -> float:
        """Device KV in use: pre-allocated prompts plus the running batch's KV (at `now`, else the epoch start)."""
        kv = self.kv_tokens()
        if now is not None and self._running and self._step_s > 0:
            kv += len(self._running) * max(0.0, now - self._epoch_s) / self._step_s
        return self.allocated_waiting_tokens + kv

    def free_tokens(self, now: float | None = None) -> float:
        """Memory neither used nor lent."""
        return self.capacity_tokens - self.lent_tokens - self.used_tokens(now)

    def idle_tokens(self, now: float | None = None) -> int:
        """Memory a lender may use: free, less the RESERVED headroom SGLang keeps for every active request."""
        return max(0, int(self.free_tokens(now)) - self.reserved_decode_tokens * self.num_active)

    def can_ever_fit(self, slot: DecodeSlot) -> bool:
        """Whether the request fits an empty instance (a head that never fits would block the queue forever)."""
        need = slot.prompt_tokens + max(self.reserved_decode_tokens, slot.estimate_new_tokens(self.clip_max_new_tokens))
        return need <= self.capacity_tokens

    # --- pre-allocation ------------------------------------------------------------------------

    def enqueue(self, slot: DecodeSlot) -> None:
        """Queue a request for its pre-allocation."""
        self._seq += 1
        heapq.heappush(self._queue, (slot.priority, self._seq, slot))
        self.queued_tokens += slot.prompt_tokens

    def cancel_queued(self, slot: DecodeSlot) -> None:
        """Withdraw a queued request (it is skipped when it reaches the head)."""
        slot.is_cancelled = True
        self.queued_tokens -= slot.prompt_tokens

    def pop_reserved(self, now: float) -> list[DecodeSlot]:
        """Resume retracted requests, then pre-allocate queue heads while they fit; return the new ones.

        Resumed requests rejoin the running batch (the version changes); new ones wait for their KV.
        """
        self._advance(now)
        if self._retracted and self._resume(now):
            return []
        granted: list[DecodeSlot] = []
        while (slot := self._head()) is not None and self._shortfall(slot) <= 0:
            heapq.heappop(self._queue)
            self.queued_tokens -= slot.prompt_tokens
            self._allocate(slot)
            granted.append(slot)
        if granted:
            self._new_epoch(now)  # pre-allocated prompts moved the point where memory runs out
        return granted

    def grant(self, now: float, on_granted: Callable[[DecodeSlot], None]) -> None:
        """Hand out memory: resume retracted requests, pre-allocate queue heads (each told to `on_granted` at
        once); while the next one lacks room and memory is lent, reclaim the shortfall (`reclaim`) and go on."""
        while True:
            for slot in self.pop_reserved(now):
                on_granted(slot)
            shortfall = self.head_shortfall_tokens(now)
            if shortfall == 0 or self.reclaim is None or self.lent_tokens == 0:
                return
            self.reclaim(shortfall)  # decode wins: lent KV goes first

    def head_shortfall_tokens(self, now: float) -> int:
        """Tokens the next request to get memory (a retracted one first) lacks now (0: none waits, or it fits)."""
        self._advance(now)
        if self._retracted:
            return max(0, math.ceil(self._resume_need(self._retracted[0]) - self._resume_allocatable()))
        slot = self._head()
        return 0 if slot is None else max(0, self._shortfall(slot))

    def free(self, slot: DecodeSlot) -> None:
        """Give back a pre-allocation that never ran (the request was aborted, or its prefill dropped)."""
        assert slot.is_allocated, "free() of a slot that is not pre-allocated"
        slot.is_allocated = False
        self.allocated_waiting_tokens -= slot.prompt_tokens
        self.num_allocated_waiting -= 1
        self.version += 1
        self._full_step = self._compute_full_step()

    def withdraw(self, slot: DecodeSlot, now: float) -> None:
        """Take out a request that will not finish, wherever it is: queued, pre-allocated, running or retracted."""
        if slot.is_running or slot.is_retracted:
            self.leave(slot, now)
        elif slot.is_allocated:
            self.free(slot)
        else:
            self.cancel_queued(slot)

    def _head(self) -> DecodeSlot | None:
        while self._queue and self._queue[0][2].is_cancelled:
            heapq.heappop(self._queue)
        return self._queue[0][2] if self._queue else None

    def _shortfall(self, slot: DecodeSlot) -> int:
        """required - allocatable for a new request (SGLang's pop_preallocated test, at the last advance)."""
        retractable = self.kv_tokens()
        est = slot.estimate_new_tokens(self.clip_max_new_tokens)
        required = max(slot.prompt_tokens + self.reserved_decode_tokens, slot.prompt_tokens + est - retractable)
        single = self._max_running_peak() - retractable if self._running else 0.0
        allocatable = (self.free_tokens() - max(self.reserved_decode_tokens * self.num_active, single)
                       - self._retracted_need)
        return math.ceil(required - allocatable)

    def _max_running_peak(self) -> int:
        """max over the running batch of prompt + est (SGLang's single-request term)."""
        while self._peaks and not self._peaks[0][2].is_running:
            heapq.heappop(self._peaks)
        return -self._peaks[0][0] if self._peaks else 0

    def _allocate(self, slot: DecodeSlot) -> None:
        slot.is_allocated = True
        self.allocated_waiting_tokens += slot.prompt_tokens
        self.num_allocated_waiting += 1

    def _resume_need(self, slot: DecodeSlot) -> int:
        return slot.prompt_tokens + int(slot.emitted) + self.reserved_decode_tokens

    def _resume_allocatable(self) -> float:
        return self.free_tokens() - self.reserved_decode_tokens * self.num_active

    def _resume(self, now: float) -> bool:
        """Resume retracted requests in order while they fit; True if some are still waiting."""
        resumed = False
        while self._retracted and self._resume_need(self._retracted[0]) <= self._resume_allocatable():
            slot = self._retracted.pop(0)
            self._retracted_need -= self._resume_need(slot)
            slot.is_retracted = False
            slot.steps += 1  # the token after the resume came late: one step over the SLO
            self._start_stint(slot)
            resumed = True
        if resumed:
            self._new_epoch(now)
        return bool(self._retracted)

    # --- running batch -------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Requests decoding now."""
        return len(self._running)

    def join(self, slot: DecodeSlot, now: float) -> None:
        """A pre-allocated request's KV arrived: it decodes from the next step on."""
        assert slot.is_allocated, "join() of a slot that is not pre-allocated"
        self._advance(now)
        slot.is_allocated = False
        self.allocated_waiting_tokens -= slot.prompt_tokens
        self.num_allocated_waiting -= 1
        self._start_stint(slot)
        self._new_epoch(now)

    def leave(self, slot: DecodeSlot, now: float) -> None:
        """Take a request out (finished or aborted; running or retracted) and free its memory."""
        if slot.is_retracted:
            self._retracted.remove(slot)
            self._retracted_need -= self._resume_need(slot)
            slot.is_retracted = False
            self.version += 1
            return
        self._advance(now)
        self._end_stint(slot)
        self._new_epoch(now)

    @property
    def epoch_s(self) -> float:
        """When the current epoch started: inside `on_leave`, the leaving request's end time."""
        return self._epoch_s

    @property
    def step_s(self) -> float:
        """The current step time (0 when nothing runs)."""
        return self._step_s

    def emitted_tokens(self, slot: DecodeSlot, now: float) -> float:
        """Tokens the request has decoded by `now` (continuous; its stints so far)."""
        if not slot.is_running:
            return slot.emitted
        return slot.emitted + self._steps_at(now) - slot.stint_start_step

    def next_event_s(self) -> float | None:
        """When the next running request emits its last token or memory runs out, or None if none runs."""
        while self._ends and not self._ends[0][2].is_running:
            heapq.heappop(self._ends)
        if not self._ends:
            return None
        step = min(self._ends[0][0], self._full_step)
        return self._epoch_s + max(0.0, step - self._steps) * self._step_s

    def pop_finished(self, now: float, on_leave: Callable[[DecodeSlot], None]) -> None:
        """Handle every event due by `now` in time order: completions (calling `on_leave`) and retractions."""
        while (when := self.next_event_s()) is not None and when <= now + _EPSILON_S:
            self._advance(when)
            if self._ends[0][0] <= self._steps + 1e-9 or self._ends[0][0] <= self._full_step:
                slot = heapq.heappop(self._ends)[2]
                self._end_stint(slot)
                self._new_epoch(when)
                on_leave(slot)
            else:
                self._out_of_memory(when)

    def _out_of_memory(self, now: float) -> None:
        """The next step does not fit: reclaim lent memory, then retract (SGLang's retract_decode)."""
        batch = len(self._running)
        if self.reclaim is not None and self.lent_tokens > 0:
            self.reclaim(max(1, math.ceil(2 * batch - self.free_tokens())))
        if self.free_tokens() >= 2 * batch:  # the reclaim made room (at the event itself free ~ batch)
            self._new_epoch(now)
            return
        order = sorted(self._running.values(), key=self._keep_key, reverse=True)  # most worth keeping first
        retracted = 0
        while len(order) > 1 and (retracted == 0 or self.free_tokens() < len(order)):
            slot = order.pop()
            self._end_stint(slot)
            slot.is_retracted = True
            slot.retractions += 1
            self._retracted.append(slot)
            self._retracted_need += self._resume_need(slot)
            retracted += 1
        self.num_retractions += retracted
        if self.free_tokens() < len(order):
            self.overruns += 1
        self._new_epoch(now)

    def _keep_key(self, slot: DecodeSlot) -> tuple[float, ...]:
        """SGLang's retraction order key: larger is kept longer (length: more emitted, then shorter prompt)."""
        length = (self.emitted_tokens(slot, self._epoch_s), -slot.prompt_tokens)
        if self.retraction_policy == "priority":
            return (-slot.priority, *length)
        return length

    def _start_stint(self, slot: DecodeSlot) -> None:
        slot.is_running = True
        slot.stint_start_step, slot.stint_start_good = self._steps, self._good
        slot.end_step = self._steps + max(0.0, slot.completion_tokens - slot.emitted)
        self._running[id(slot)] = slot
        self._sum_base += slot.prompt_tokens + slot.emitted - slot.stint_start_step
        self._seq += 1
        heapq.heappush(self._ends, (slot.end_step, self._seq, slot))
        peak = slot.prompt_tokens + slot.estimate_new_tokens(self.clip_max_new_tokens)
        heapq.heappush(self._peaks, (-peak, self._seq, slot))

    def _end_stint(self, slot: DecodeSlot) -> None:
        """Take a running slot out of the batch (the caller advanced to now and starts a new epoch)."""
        del self._running[id(slot)]
        slot.is_running = False
        stint = self._steps - slot.stint_start_step
        slot.steps += stint
        slot.good_steps += self._good - slot.stint_start_good
        self._sum_base -= slot.prompt_tokens + slot.emitted - slot.stint_start_step
        slot.emitted += stint
        if not self._running:
            self._sum_base = 0.0  # no drift from the running sums once the batch is empty
        if len(self._peaks) > 2 * len(self._running) + 64:
            self._peaks = [entry for entry in self._peaks if entry[2].is_running]
            heapq.heapify(self._peaks)

    def _steps_at(self, now: float) -> float:
        if self._running and self._step_s > 0:
            return self._steps + (now - self._epoch_s) / self._step_s
        return self._steps

    def _advance(self, now: float) -> None:
        if now <= self._epoch_s:
            return
        if self._running and self._step_s > 0:
            steps = (now - self._epoch_s) / self._step_s
            self._steps += steps
            if self._step_s < self.step_slo_s:
                self._good += steps
        self._epoch_s = now

    def _compute_full_step(self) -> float:
        """S at which free memory drops below one token per running request (the next step's need)."""
        batch = len(self._running)
        if batch <= 1:  # a lone request is never retracted (see the rules)
            return _INF
        free = self.free_tokens()
        return self._steps + max(0.0, (free - batch) / batch)

    def _new_epoch(self, now: float) -> None:
        self._epoch_s = max(self._epoch_s, now)
        batch = len(self._running)
        self._step_s = self.profile.decode_step_s(batch, self.kv_tokens()) if batch else 0.0
        self._full_step = self._compute_full_step()
        self.version += 1

    # --- checks --------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants at the top of this module (tests call it between steps)."""
        queued = [s for _, _, s in self._queue if not s.is_cancelled]
        assert self.queued_tokens == sum(s.prompt_tokens for s in queued)
        running = list(self._running.values())
        assert all(s.is_running and not s.is_allocated and not s.is_retracted for s in running)
        base = sum(s.prompt_tokens + s.emitted - s.stint_start_step for s in running)
        assert abs(self._sum_base - base) <= 1e-6 * max(1.0, abs(base))
        assert all(s.is_retracted and not s.is_running for s in self._retracted)
        assert self._retracted_need == sum(self._resume_need(s) for s in self._retracted)
        assert self.num_allocated_waiting >= 0 and self.allocated_waiting_tokens >= 0

"""The prefill half in real time: basin_sim's PrefillInstance and its RadixCache, driven by the model clock.

The same instance steps as the simulator's request path (request_flow.py): enqueue, start_batch,
finish_batch, the transfer, release; timed by the model clock instead of the event loop.

Rules:
- A request is a PrefillJob on its cache chain. RadixCache pins a chain for one request at a time,
  so at most one job per chain is inside the instance; a second request on a busy chain waits in
  arrival order ("parked") until the first's KV has left, and is then queued with its own priority.
- Whenever the instance is idle, `start_batch(now)` forms a batch (chunked prefill, cache admission);
  a timer at its `ends_s` finishes it; each completed job moves its KV to decode for
  `profile.transfer_s(tokens moved)`, then its chain is released (unpinned) and its outcome delivered.
- A request larger than the whole cache can never be admitted: `RequestTooLargeError` up front.
- Withdrawal (client gone, bootstrap failed): a parked or queued job leaves at once; a started one
  is cancelled in the instance and its chain released when its batch or transfer ends (as the
  simulator drops it). Either way its chain's next parked request gets its turn.
- Storage (HiCache's L3 tier): a request may come with `storage_end`, the prompt position its storage
  prefetch reached (the caller waited for it); when its hit is decided, what lies past its device +
  host hit up to there is loaded with the batch and not computed (`basin_sim.storage.Prefetches`).
- Decode radix cache: a request may come with `decode_prefix_tokens` (SGLang's decode_prefix_len: what
  the decode instance already holds of it); only the rest of its KV is transferred. Prefill computes the
  same either way.
- Session radix cache (`session_refs`, session_refs.py): a request may carry its `session_id` tag; with
  `takes_references` (mode true) its normal finish (its KV reached decode, not withdrawn) registers the
  tag's reference on its chain, else (mode faithful: SGLang's PD prefill sets no finish reason before
  `cache_finished_req`) its chain is released as usual. `close_session` drops the tag's references
  (counted in either mode).
- `flush` empties the cache (SGLang's /flush_cache), only while no request is inside; it also forgets the
  session tags and their tombstones, as SGLang's cache reset does.

Invariants: `_tickets` holds exactly the jobs inside the instance (queued, batched, in transfer);
`_busy` is the set of their chains.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass
from functools import partial

from basin_emulate.clock import ModelClock
from basin_emulate.errors import RequestTooLargeError
from basin_emulate.session_refs import SessionRefs
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.profile import Profile
from basin_sim.radix_cache import RadixCache
from basin_sim.storage import Prefetches


class PrefillStage(enum.Enum):
    """Where a prefill request is."""

    PARKED = "parked"  # its chain is busy with an earlier request
    QUEUED = "queued"
    PREFILLING = "prefilling"
    TRANSFER = "transfer"
    DONE = "done"


@dataclass(frozen=True)
class PrefillOutcome:
    """What prefill did for one request (model times in seconds)."""

    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    computed_tokens: int
    arrival_s: float
    prefill_done_s: float
    transfer_done_s: float
    storage_hit_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the cache (device, host and storage), as SGLang reports them."""
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


@dataclass(eq=False)
class PrefillTicket:
    """One request inside the emulated prefill."""

    job: PrefillJob
    arrival_s: float
    outcome: asyncio.Future[PrefillOutcome]
    stage: PrefillStage = PrefillStage.PARKED
    prefill_done_s: float = 0.0
    is_withdrawn: bool = False


@dataclass
class PrefillTotals:
    """Cumulative token counts of admitted requests, and the hit rate of the last batch."""

    computed_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    last_batch_hit_rate: float = 0.0
    chain_waits: int = 0  # requests that waited for their chain's earlier request


class PrefillEngine:
    """One prefill instance of the profile, in real time."""

    def __init__(self, profile: Profile, clock: ModelClock, capacity_tokens: int, host_capacity_tokens: int = 0, *,
                 session_cache: bool = False, takes_references: bool = False):
        if takes_references and not session_cache:
            raise ValueError("takes_references needs session_cache")
        self.profile = profile
        self.clock = clock
        self.capacity_tokens = capacity_tokens
        self.host_capacity_tokens = host_capacity_tokens
        self.takes_references = takes_references
        self.instance = PrefillInstance(0, profile, self._new_cache())
        self.session_refs = SessionRefs(self.cache) if session_cache else None
        self._tags: dict[int, tuple[str, int]] = {}  # request -> its session_id tag and the tag's generation
        self._prefetches = Prefetches()  # request -> where its storage prefetch reached (the caller waited for it)
        self._decode_prefix: dict[int, int] = {}  # request -> tokens decode already holds (only the rest moves)
        self.instance.storage_hit = self._prefetches.hit
        self.totals = PrefillTotals()
        self._tickets: dict[int, PrefillTicket] = {}
        self._parked: dict[str, deque[PrefillTicket]] = {}
        self._busy: set[str] = set()
        self._next_id = 0
        self.num_transferring = 0

    @property
    def cache(self) -> RadixCache:
        """The prefix cache."""
        return self.instance.cache

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        batch = self.instance.batch
        return 0 if batch is None else len(batch.parts)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a batch or parked behind their chain's earlier request."""
        parked = sum(len(q) for q in self._parked.values())
        queued = sum(1 for t in self._tickets.values() if t.stage == PrefillStage.QUEUED and not t.is_withdrawn)
        return parked + queued

    @property
    def is_idle(self) -> bool:
        """True when no request is inside (nor waiting for its chain)."""
        return not self._tickets and not self._parked

    async def prefill(self, chain_key: str, group_key: str, group_tokens: int, prompt_tokens: int,
                      priority_key: float, arrival_s: float, storage_end: int = 0,
                      decode_prefix_tokens: int = 0, session_id: str | None = None) -> PrefillOutcome:
        """Prefill one prompt on its chain (arrived at model time `arrival_s`, at most `clock.now_s`) and move
        its KV out; withdrawn if cancelled."""
        if prompt_tokens > self.capacity_tokens:
            raise RequestTooLargeError(f"the prompt has {prompt_tokens} tokens, more than this prefill server's "
                                       f"KV pool (max_total_num_tokens={self.capacity_tokens})")
        self._next_id += 1
        job = PrefillJob(priority_key, self._next_id, chain_key, group_key, group_tokens, prompt_tokens)
        if storage_end > 0:
            self._prefetches.reached(job.request_id, storage_end)
        if decode_prefix_tokens > 0:
            self._decode_prefix[job.request_id] = decode_prefix_tokens
        if session_id is not None and self.session_refs is not None:
            generation = self.session_refs.open(session_id)
            if self.takes_references:
                self._tags[job.request_id] = session_id, generation
        ticket = PrefillTicket(job, arrival_s, asyncio.get_running_loop().create_future())
        if chain_key in self._busy:
            self._parked.setdefault(chain_key, deque()).append(ticket)
            self.totals.chain_waits += 1
        else:
            self._enqueue(ticket)
        try:
            return await asyncio.shield(ticket.outcome)
        except asyncio.CancelledError:
            self._withdraw(ticket)
            raise
        finally:
            self._prefetches.forget(job.request_id)
            self._decode_prefix.pop(job.request_id, None)
            self._tags.pop(job.request_id, None)

    def cached_tokens(self, chain_key: str, group_key: str) -> int:
        """Tokens of a chain the device and host hold now (what a storage lookup starts after)."""
        return self.cache.lookup(chain_key, group_key).tokens

    def flush(self) -> bool:
        """Empty the prefix cache if no request is inside; True if it was flushed."""
        if not self.is_idle:
            return False
        self.instance.cache = self._new_cache()
        if self.session_refs is not None:
            self.session_refs.reset(self.cache)
        return True

    def close_session(self, session_id: str) -> int:
        """SGLang's /close_session: the tag's references dropped (KV kept); chains dereferenced."""
        return 0 if self.session_refs is None else self.session_refs.close(session_id)

    def _new_cache(self) -> RadixCache:
        return RadixCache(self.capacity_tokens, self.host_capacity_tokens, session_refs=self.takes_references)

    # --- the instance --------------------------------------------------------------------------------

    def _enqueue(self, ticket: PrefillTicket) -> None:
        ticket.stage = PrefillStage.QUEUED
        self._busy.add(ticket.job.session_key)
        self._tickets[ticket.job.request_id] = ticket
        self.instance.enqueue(ticket.job)
        self._kick()

    def _kick(self) -> None:
        if self.instance.batch is not None:
            return
        batch = self.instance.start_batch(self.clock.now_s)
        if batch is None:
            return
        for job in batch.started:
            self._tickets[job.request_id].stage = PrefillStage.PREFILLING
            self.totals.device_hit_tokens += job.device_hit_tokens
            self.totals.host_hit_tokens += job.host_hit_tokens
            self.totals.storage_hit_tokens += job.storage_hit_tokens
            self.totals.computed_tokens += job.remaining_tokens
        if batch.started:
            hits = sum(job.device_hit_tokens + job.host_hit_tokens + job.storage_hit_tokens for job in batch.started)
            self.totals.last_batch_hit_rate = hits / sum(job.prompt_tokens for job in batch.started)
        self.clock.call_at(batch.ends_s, self._on_batch_done)

    def _on_batch_done(self) -> None:
        now = self.clock.now_s
        for job in self.instance.finish_batch():
            ticket = self._tickets[job.request_id]
            if job.is_cancelled:
                self._release(ticket)
                continue
            ticket.stage, ticket.prefill_done_s = PrefillStage.TRANSFER, now
            self.num_transferring += 1
            moved = job.prompt_tokens - min(self._decode_prefix.get(job.request_id, 0), job.prompt_tokens - 1)
            self.clock.call_at(now + self.profile.transfer_s(moved), partial(self._on_sent, ticket))
        self._kick()

    def _on_sent(self, ticket: PrefillTicket) -> None:
        self.num_transferring -= 1
        job = ticket.job
        if not ticket.is_withdrawn:
            computed = job.prompt_tokens - job.device_hit_tokens - job.host_hit_tokens - job.storage_hit_tokens
            ticket.outcome.set_result(PrefillOutcome(
                job.prompt_tokens, job.device_hit_tokens, job.host_hit_tokens, computed, ticket.arrival_s,
                ticket.prefill_done_s, self.clock.now_s, job.storage_hit_tokens))
        self._release(ticket, is_finished=not ticket.is_withdrawn)
        self._kick()

    def _release(self, ticket: PrefillTicket, *, is_finished: bool = False) -> None:
        """The job's KV has left (or it was dropped): unpin its chain (a tagged normal finish takes its session's
        reference) and give the chain's next request its turn."""
        job = ticket.job
        ticket.stage = PrefillStage.DONE
        del self._tickets[job.request_id]
        tag = self._tags.get(job.request_id)
        if is_finished and tag is not None and self.session_refs is not None:
            self.session_refs.finished(*tag, job.session_key, self.clock.now_s)
        else:
            self.cache.release(job.session_key, self.clock.now_s)
        self._next_on_chain(job.session_key)

    def _next_on_chain(self, chain_key: str) -> None:
        self._busy.discard(chain_key)
        parked = self._parked.get(chain_key)
        if parked:
            ticket = parked.popleft()
            if not parked:
                del self._parked[chain_key]
            self._enqueue(ticket)

    def _withdraw(self, ticket: PrefillTicket) -> None:
        ticket.is_withdrawn = True
        chain_key = ticket.job.session_key
        if ticket.stage == PrefillStage.PARKED:
            parked = self._parked[chain_key]
            parked.remove(ticket)
            if not parked:
                del self._parked[chain_key]
        elif ticket.stage == PrefillStage.QUEUED:
            self.instance.cancel(ticket.job)
            del self._tickets[ticket.job.request_id]
            self._next_on_chain(chain_key)
            self._kick()  # the head may have been this job, waiting for cache room
        elif ticket.stage == PrefillStage.PREFILLING:
            self.instance.cancel(ticket.job)  # its batch returns it; released then
        # TRANSFER: released when the transfer ends; DONE: nothing is held

"""One prefill instance: a waiting queue, chunked-prefill batches, and its prefix cache's hits.

Rules:
- Jobs wait in (priority, seq) order (FCFS when the priority is the call's send time).
- Priority never preempts on a PD prefill instance, as in SGLang (design.md: SGLang's preemption
  takes its victims from a running decode batch, which a PD prefill server does not keep): the
  chunked job in progress always continues first, and an urgent job waits for the running batch and
  goes at the head of the next one.
- One batch runs at a time. A batch takes the job left chunked by the previous batch first, then
  queue heads while the token budget (`chunked_prefill_tokens`) lasts; a job that does not fit in
  the rest of the budget is chunked: it computes what fits now and continues next batch (at most one
  chunked job, as SGLang's chunked prefill).
- A job's cache hit is decided when it first enters a batch (`RadixCache.admit`): its chain is
  pinned and the device memory for its whole uncached part is taken then. If the cache cannot make
  room (everything else pinned), the job stays at the head and the batch goes without it.
- Batch time comes from the profile's cost model: computed tokens, attention pairs
  computed * (context before the chunk + computed / 2), and host (and storage) load-backs.
- Write-back (lending decode-memory, kv_tiers.py): when a job's hit is decided, `write_back(job)` (if
  set) says how many of its uncached tokens a decode instance writes back instead; they are not
  computed. The copy goes layer by layer, overlapped with the batch's compute: the batch takes
  max(compute, transfer).
- Storage (lending storage-offload, storage.py): when a job's hit is decided, `storage_hit(job, now)`
  (if set) says how many of its uncached tokens come from the storage tier instead; they were
  prefetched to the host before the job was queued, so they are loaded host -> device with the batch
  like host hits, and not computed.
- A cancelled job (withdrawn: killed, timed out, given up) is skipped in the queue; in a batch it is
  returned by `finish_batch` at once, so the caller releases its chain.
- Every batch's (start, end) is kept in `busy_intervals` (in time order), for the busy fraction.

Invariant: waiting_tokens == sum of prompt tokens of queued, not cancelled, jobs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from basin_sim.profile import Profile
from basin_sim.radix_cache import RadixCache


@dataclass(slots=True, eq=False)
class PrefillJob:
    """One request as prefill sees it."""

    priority: float
    request_id: int
    session_key: str
    group_key: str
    group_tokens: int
    prompt_tokens: int
    remaining_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    written_back_tokens: int = 0
    storage_hit_tokens: int = 0
    is_started: bool = False
    is_cancelled: bool = False


@dataclass(frozen=True)
class PrefillBatch:
    """A batch in flight: (job, tokens computed for it) pairs, and when it ends."""

    parts: tuple[tuple[PrefillJob, int], ...]
    started: tuple[PrefillJob, ...]  # jobs whose cache hit was decided in this batch
    ends_s: float


class PrefillInstance:
    """Queue, batches and cache of one prefill instance."""

    def __init__(self, index: int, profile: Profile, cache: RadixCache) -> None:
        self.index = index
        self.profile = profile
        self.cache = cache
        self.waiting_tokens = 0
        self.batch: PrefillBatch | None = None
        self._queue: list[tuple[float, int, PrefillJob]] = []
        self._seq = 0
        self._chunked: PrefillJob | None = None
        self.write_back: Callable[[PrefillJob], int] | None = None
        self.written_back_tokens = 0
        self.storage_hit: Callable[[PrefillJob, float], int] | None = None
        self.busy_intervals: list[tuple[float, float]] = []

    @property
    def num_waiting(self) -> int:
        """Queued jobs (cancelled ones included until they reach the head)."""
        return len(self._queue)

    def enqueue(self, job: PrefillJob) -> None:
        """Queue a job (its decode memory is already reserved)."""
        self._seq += 1
        heapq.heappush(self._queue, (job.priority, self._seq, job))
        self.waiting_tokens += job.prompt_tokens

    def cancel(self, job: PrefillJob) -> None:
        """Mark a job cancelled; a queued one just leaves the queue's token count."""
        if not job.is_started and not job.is_cancelled:
            self.waiting_tokens -= job.prompt_tokens
        job.is_cancelled = True

    def start_batch(self, now: float) -> PrefillBatch | None:
        """Form and start the next batch if the instance is idle and has work; return it."""
        if self.batch is not None:
            return None
        budget = self.profile.chunked_prefill_tokens
        parts: list[tuple[PrefillJob, int]] = []
        started: list[PrefillJob] = []
        if self._chunked is not None:
            chunked, self._chunked = self._chunked, None
            budget = self._take(chunked, budget, parts)
        while budget > 0 and self._chunked is None and (job := self._admit_head(now)) is not None:
            started.append(job)
            budget = self._take(job, budget, parts)
        if not parts:
            return None
        computed = sum(tokens for _, tokens in parts)
        pairs = sum(tokens * (job.prompt_tokens - job.remaining_tokens + tokens / 2) for job, tokens in parts)
        loaded = sum(job.host_hit_tokens + job.storage_hit_tokens for job in started)
        duration = self.profile.prefill_batch_s(computed, pairs, loaded)
        written = sum(job.written_back_tokens for job in started)
        if written:
            duration = max(duration, self.profile.write_back_s(written))
        self.batch = PrefillBatch(tuple(parts), tuple(started), now + duration)
        self.busy_intervals.append((now, now + duration))
        return self.batch

    def busy_s(self, start_s: float, end_s: float) -> float:
        """Seconds of [start_s, end_s) this instance spent running batches."""
        return sum(max(0.0, min(end, end_s) - max(start, start_s)) for start, end in self.busy_intervals)

    def finish_batch(self) -> list[PrefillJob]:
        """End the running batch; return the jobs it completed (and the cancelled ones)."""
        assert self.batch is not None
        done: list[PrefillJob] = []
        for job, tokens in self.batch.parts:
            job.remaining_tokens -= tokens
            if job.remaining_tokens == 0 or job.is_cancelled:
                done.append(job)
                if job is self._chunked:
                    self._chunked = None
        self.batch = None
        return done

    def _take(self, job: PrefillJob, budget: int, parts: list[tuple[PrefillJob, int]]) -> int:
        tokens = min(job.remaining_tokens, budget)
        parts.append((job, tokens))
        if tokens < job.remaining_tokens:
            self._chunked = job
        return budget - tokens

    def _admit_head(self, now: float) -> PrefillJob | None:
        while self._queue:
            job = self._queue[0][2]
            if job.is_cancelled:
                heapq.heappop(self._queue)
                continue
            admission = self.cache.admit(job.session_key, job.group_key, job.group_tokens, job.prompt_tokens, now)
            if admission is None:
                return None
            heapq.heappop(self._queue)
            self.waiting_tokens -= job.prompt_tokens
            job.is_started = True
            job.device_hit_tokens = admission.device_hit_tokens
            job.host_hit_tokens = admission.host_hit_tokens
            job.remaining_tokens = admission.computed_tokens
            if self.storage_hit is not None:
                got = min(self.storage_hit(job, now), job.remaining_tokens - 1)
                if got > 0:
                    job.storage_hit_tokens = got
                    job.remaining_tokens -= got
            if self.write_back is not None:
                moved = min(self.write_back(job), job.remaining_tokens - 1)
                if moved > 0:
                    job.written_back_tokens = moved
                    job.remaining_tokens -= moved
                    self.written_back_tokens += moved
            return job
        return None

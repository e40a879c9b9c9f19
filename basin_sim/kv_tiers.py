"""Where a finished call's KV goes between calls: the deployment's lending switch as one strategy object.

Rules (`make_kv_tier` picks one per engine, from `Deployment.lending`):
- `none` (`KvTier`, stock SGLang): decode frees a request's KV when it finishes; the next call hits only
  what the prefill cache (and its host tier) kept.
- `decode-memory` (`DecodeMemoryLending`, the paper's lending): after each answer but the session's
  last, the decode instance keeps prompt + completion tokens of KV in idle memory (free less SGLang's
  RESERVED headroom per active request) if they fit, under the ledger's cap (`LEND_CAP_FRACTION` of its
  memory, oldest dropped first). Lent memory is reclaimed, oldest first, before any queued reservation
  waits and before a step would retract a request (decode wins). When the next call's hit is decided, a
  lent copy longer than prefill's cached prefix is written back (prefill.py) and leaves decode. An
  ended session's copy is forgotten.
- `storage-offload` (`StorageOffload`, stock SGLang: decode --disaggregation-decode-enable-offload-kvcache,
  prefill --enable-hierarchical-cache with a --hicache-storage-backend; storage.py): a computed prompt's
  whole pages are backed up to the storage tier shared by all instances, and every answer's pages
  (prompt tail + output, whole strides) are offloaded to it. A request whose prompt storage holds past
  its device + host hit prefetches that part to the host before it is queued on prefill (prefetch
  policy `timeout`, SGLang's default); when its hit is decided, what the prefetch brought past the
  (then) device + host hit is loaded with the batch, not computed, and counts as cached tokens.
- A strategy is wired to the instances once (`decode.reclaim`, `prefill.write_back`,
  `prefill.storage_hit`); the request path calls its hooks and never asks which one it is.
Invariant (`holds`): an ended session's KV is held by no tier.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from basin_runtime.policy.lending import LEND_CAP_FRACTION, LendingLedger
from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.lifecycle import Request
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.profile import Deployment, Profile
from basin_sim.storage import Prefetches, StorageTier, plan_prefetch

ScheduleDecode = Callable[[DecodeInstance], None]  # the engine re-plans an instance's next event


class KvTier:
    """Lending `none`: nothing kept between calls past the prefill cache. The base of every strategy."""

    ledger: LendingLedger | None = None
    storage: StorageTier | None = None

    def prefetch_wait_s(self, request: Request, now: float) -> float:
        """Start a granted request's storage prefetch; the wait before it may be queued on prefill."""
        return 0.0

    def prefetch_done(self, request: Request) -> None:
        """The request's prefetch wait is over: it is queued on prefill now."""

    def cancel_prefetch(self, request: Request) -> bool:
        """Forget a request withdrawn before prefill; True if it was still waiting for its prefetch."""
        return False

    def prefilled(self, job: PrefillJob) -> None:
        """Prefill computed a job's prompt."""

    def answered(self, job: PrefillJob, slot: DecodeSlot) -> None:
        """Decode finished a request."""

    def keep(self, request: Request, slot: DecodeSlot, now: float) -> None:
        """After an answer that is not its session's last: keep what this tier keeps of its KV."""

    def forget(self, session_id: str) -> None:
        """The session ended: drop what this tier keeps of it."""

    def holds(self, session_id: str) -> bool:
        """True if this tier keeps KV of the session."""
        return False


class DecodeMemoryLending(KvTier):
    """Lending `decode-memory`: idle decode memory keeps finished calls' KV; prefill gets it written back."""

    def __init__(self, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance],
                 schedule_decode: ScheduleDecode) -> None:
        self.ledger = self._ledger = LendingLedger(LEND_CAP_FRACTION)
        self._decode = decode
        self._schedule_decode = schedule_decode
        for decode_instance in decode:
            self._ledger.add_instance(str(decode_instance.index), decode_instance.capacity_tokens)
            decode_instance.reclaim = functools.partial(self._reclaim, decode_instance)
        for prefill_instance in prefill:
            prefill_instance.write_back = self._write_back

    def keep(self, request: Request, slot: DecodeSlot, now: float) -> None:
        """Lend the answer's prompt + completion KV if it fits the instance's idle memory."""
        tokens = slot.prompt_tokens + slot.completion_tokens
        if tokens <= request.decode.idle_tokens(now):
            self._ledger.lend(request.run.spec.session_id, str(request.decode.index), tokens)
            self.sync()

    def forget(self, session_id: str) -> None:
        """Drop the session's lent copy."""
        if self._ledger.forget(session_id) is not None:
            self.sync()

    def holds(self, session_id: str) -> bool:
        """True if some decode instance lends KV of the session."""
        return self._ledger.holder_of(session_id) is not None

    def sync(self) -> None:
        """Tell each decode instance what the ledger says it lends (its next event may move)."""
        for instance in self._decode:
            lent = self._ledger.lent_tokens(str(instance.index))
            if lent != instance.lent_tokens:
                instance.lent_tokens = lent  # moves the point where decode memory runs out
                self._schedule_decode(instance)

    def _reclaim(self, instance: DecodeInstance, tokens: int) -> None:
        """Decode needs `tokens` more (a reservation, or a step): lent KV goes first."""
        self._ledger.reclaim(str(instance.index), tokens)
        self.sync()

    def _write_back(self, job: PrefillJob) -> int:
        """Tokens of a job a decode instance writes back instead of prefill computing them."""
        plan = self._ledger.write_back_plan(job.session_key, job.device_hit_tokens + job.host_hit_tokens)
        if plan is None:
            return 0
        self._ledger.forget(job.session_key)
        self.sync()
        return plan.tokens_to_move


class StorageOffload(KvTier):
    """Lending `storage-offload`: prompts backed up and answers offloaded to storage; prefill prefetches them."""

    def __init__(self, prefill: Sequence[PrefillInstance], profile: Profile) -> None:
        self.storage = self._storage = StorageTier()
        self._profile = profile
        self._prefetches = Prefetches()
        self._prefetching: set[int] = set()  # request ids whose prefetch runs (not yet queued on prefill)
        for instance in prefill:
            instance.storage_hit = self._prefetches.hit

    def prefetch_wait_s(self, request: Request, now: float) -> float:
        """Prefetch what storage holds of the prompt past its device + host hit now; the wait for it."""
        job = request.job
        cached = request.prefill.cache.lookup(job.session_key, job.group_key).tokens
        tokens = self._storage.hit(job.session_key, cached, job.prompt_tokens)
        if tokens <= 0:
            return 0.0
        prefetch = plan_prefetch(self._storage.prefetch_policy, self._profile.storage_fetch_s(tokens), tokens)
        self._prefetches.reached(request.request_id, cached + prefetch.arrived_tokens)
        if prefetch.wait_s > 0:
            self._prefetching.add(request.request_id)
        return prefetch.wait_s

    def prefetch_done(self, request: Request) -> None:
        """The prefetch wait ended."""
        self._prefetching.discard(request.request_id)

    def cancel_prefetch(self, request: Request) -> bool:
        """Forget the request's prefetch; True if it was still running."""
        self._prefetches.forget(request.request_id)
        if request.request_id not in self._prefetching:
            return False
        self._prefetching.discard(request.request_id)
        return True

    def prefilled(self, job: PrefillJob) -> None:
        """Write-through: the prompt's pages reach storage off the critical path."""
        self._storage.backup_prompt(job.session_key, job.prompt_tokens)

    def answered(self, job: PrefillJob, slot: DecodeSlot) -> None:
        """Decode offloads the answer's pages as it frees them."""
        self._storage.offload_answer(job.session_key, job.prompt_tokens, slot.completion_tokens)


def make_kv_tier(deployment: Deployment, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance],
                 schedule_decode: ScheduleDecode) -> KvTier:
    """The strategy of the deployment's lending switch, wired to its instances."""
    if deployment.lending == "decode-memory":
        return DecodeMemoryLending(prefill, decode, schedule_decode)
    if deployment.lending == "storage-offload":
        return StorageOffload(prefill, deployment.profile)
    return KvTier()

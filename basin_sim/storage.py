"""SGLang's HiCache storage tier (L3) under prefill, as stock SGLang lends decode KV through it.

What is stored of each conversation (decode's offloaded answers, prefill's backed-up prompts) and what
a prefill request gets back from it; token counts only, read from sglang 0.5.23 (design.md names the
source files).

Rules (what is stored):
- Prefill with --enable-hierarchical-cache and a --hicache-storage-backend backs up every node it
  inserts (write-through: device -> host -> storage), page by page: a prompt of P tokens leaves its
  first floor(P / page) x page tokens in storage. The copy runs off the critical path.
- Decode with --disaggregation-decode-enable-offload-kvcache offloads the *incremental* part: tokens
  [floor(P / page) x page, P + n - 1) of a request with n output tokens (the last token's KV is never
  computed), in whole strides (SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE rounded down to pages, default one
  page) as it decodes and at its finish; a tail shorter than a stride is dropped. Pages are keyed by
  hashes chained from the prompt's page-aligned prefix, as prefill keys them, so the two line up.
- Storage is shared by every instance on the same backend (a file folder, Mooncake, ...) and
  /flush_cache does not clear it (its own endpoint does). Here it is unbounded: a disk or a
  distributed store holds far more than the working sets modeled.

Rules (what is read back):
- A request's prompt is matched on the device, then the host; the rest, page-aligned, is looked up
  in storage only if it is at least PREFETCH_THRESHOLD_TOKENS (256), and a storage hit under that
  threshold is revoked. The hit is the run of stored pages right after the device + host hit, and
  never the prompt's last token (it is computed for the logits, as SGLang always computes one).
- The hit is prefetched storage -> host before the request is scheduled (`plan_prefetch`;
  --hicache-storage-prefetch-policy: wait_complete waits for all of it; timeout, the default, waits at
  most 1 s + 0.25 s per 1,024 tokens, then takes what arrived; best_effort never waits), then loaded
  host -> device with the batch like any host hit: `Prefetches` remembers where each request's
  prefetch reached until its hit is decided (`PrefillInstance.storage_hit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = ("best_effort", "wait_complete", "timeout")
PREFETCH_THRESHOLD_TOKENS = 256  # storage_prefetch_threshold (mem_cache/unified_radix_cache.py)
PREFETCH_TIMEOUT_BASE_S = 1.0  # prefetch_timeout_base
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25  # prefetch_timeout_per_ki_token


def page_floor(tokens: int, page_tokens: int) -> int:
    """`tokens` rounded down to whole pages."""
    return tokens // page_tokens * page_tokens


def offload_stride_tokens(page_tokens: int, stride_env: int | None) -> int:
    """Decode's offload stride: SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE rounded down to pages, at least one page."""
    if stride_env is None or stride_env <= 0:
        return page_tokens
    return max(page_tokens, page_floor(stride_env, page_tokens))


def prompt_backup_end(prompt_tokens: int, page_tokens: int) -> int:
    """Where prefill's backup of a prompt ends: its whole pages."""
    return page_floor(prompt_tokens, page_tokens)


def decode_offload_range(prompt_tokens: int, completion_tokens: int, page_tokens: int,
                         stride_tokens: int) -> tuple[int, int]:
    """Token range [start, end) decode offloads of a finished request (empty when start == end)."""
    start = page_floor(prompt_tokens, page_tokens)
    incremental = max(0, prompt_tokens + completion_tokens - 1 - start)
    return start, start + incremental // stride_tokens * stride_tokens


def storage_hit_tokens(stored_end: int, cached_tokens: int, prompt_tokens: int, page_tokens: int,
                       threshold_tokens: int = PREFETCH_THRESHOLD_TOKENS) -> int:
    """Tokens a prompt gets from storage after `cached_tokens` hit on device and host (0 under the threshold)."""
    start = page_floor(cached_tokens, page_tokens)
    if page_floor(prompt_tokens - start, page_tokens) < threshold_tokens:
        return 0
    end = page_floor(min(stored_end, prompt_tokens - 1), page_tokens)
    hit = end - cached_tokens
    return hit if hit >= threshold_tokens else 0


def prefetch_wait_s(policy: PrefetchPolicy, fetch_s: float, tokens: int) -> float:
    """How long a request waits for its prefetch before it may be scheduled."""
    if policy == "best_effort":
        return 0.0
    if policy == "wait_complete":
        return fetch_s
    return min(fetch_s, PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_KI_TOKEN_S * tokens / 1024)


@dataclass(frozen=True)
class Prefetch:
    """A storage hit's prefetch: how long the request waits for it, and how much of it has arrived by then."""

    wait_s: float
    arrived_tokens: int


def plan_prefetch(policy: PrefetchPolicy, fetch_s: float, tokens: int) -> Prefetch:
    """The prefetch of a `tokens` storage hit that takes `fetch_s` in full: the wait the policy allows, and the
    tokens arrived by its end (all of them if the wait covers the fetch, else the share fetched by then)."""
    wait_s = prefetch_wait_s(policy, fetch_s, tokens)
    return Prefetch(wait_s, tokens if wait_s >= fetch_s else int(tokens * wait_s / fetch_s))


class PrefetchedJob(Protocol):
    """What `Prefetches.hit` reads of a prefill job (`prefill.PrefillJob`)."""

    request_id: int
    device_hit_tokens: int
    host_hit_tokens: int


class Prefetches:
    """Where each request's storage prefetch reached (a prompt position), until its prefill hit is decided."""

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}

    def reached(self, request_id: int, end: int) -> None:
        """The request's prefetch brought its prompt up to `end` (from the start) to the host."""
        self._ends[request_id] = end

    def forget(self, request_id: int) -> None:
        """The request left before its hit was decided."""
        self._ends.pop(request_id, None)

    def hit(self, job: PrefetchedJob, now: float) -> int:
        """Tokens of a job its prefetch brought past its device + host hit (`PrefillInstance.storage_hit`)."""
        return max(0, self._ends.pop(job.request_id, 0) - job.device_hit_tokens - job.host_hit_tokens)


@dataclass
class StorageTier:
    """What storage holds of each conversation: a run of tokens from its start (shared by every instance)."""

    page_tokens: int = 64  # --page-size of the recipe (deploy/sglang-pd-lending.md)
    stride_tokens: int = 64
    prefetch_policy: PrefetchPolicy = "timeout"  # SGLang's default --hicache-storage-prefetch-policy
    stored_end: dict[str, int] = field(default_factory=dict)
    backed_up_tokens: int = 0  # tokens written (sglang:backuped_tokens_total)

    def _extend(self, key: str, start: int, end: int) -> None:
        held = self.stored_end.get(key, 0)
        if start <= held < end:  # contiguous with what is stored: the run grows
            self.backed_up_tokens += end - held
            self.stored_end[key] = end

    def backup_prompt(self, key: str, prompt_tokens: int) -> None:
        """Prefill computed a prompt: its whole pages go to storage."""
        self._extend(key, 0, prompt_backup_end(prompt_tokens, self.page_tokens))

    def offload_answer(self, key: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Decode finished a request: its incremental pages go to storage."""
        self._extend(key, *decode_offload_range(prompt_tokens, completion_tokens, self.page_tokens,
                                                self.stride_tokens))

    def hit(self, key: str, cached_tokens: int, prompt_tokens: int) -> int:
        """Tokens of a prompt storage serves after a device + host hit of `cached_tokens`."""
        return storage_hit_tokens(self.stored_end.get(key, 0), cached_tokens, prompt_tokens, self.page_tokens)

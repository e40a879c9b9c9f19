"""The hardware side of the model: a named profile (one GPU instance serving one model) with its cost
model, and a deployment (how many prefill and decode instances, with which caches and lending switch).

Cost model (every number comes from the profile; the shipped profile's numbers are fitted to public
measurements and the paper's anchors by calibrate/cost_fit.py, its header says which and how well):
- Prefill batch:  t = max(compute, load_back_bytes / host_load_bytes_per_s), where
                  compute = batch_fixed_s + token_s * computed_tokens
                      + attention_pair_s * sum_i computed_i * (context_before_i + computed_i / 2)
  (linear layers cost per computed token; causal attention costs per (query, key) pair). Host-tier
  (and storage) load-back overlaps the forward layer by layer, so a batch takes the longer of the
  two, not their sum (docs/simulator/design.md says where SGLang does it).
- Decode step:    t = step_fixed_s + (dense_weight_bytes + expert_weight_bytes * touched(B)) / hbm
                      + kv_tokens * kv_read_bytes_per_token / hbm + B * 2 * state_bytes_per_request / hbm
  where touched(B) = 1 - (1 - experts_per_token / experts_total) ** B is the share of routed experts a
  batch of B requests reads (a MoE decode step reads every expert some token was routed to), and each
  request's fixed state (linear attention) is read and written once per step.
- KV transfer prefill -> decode: t = pd_request_overhead_s + transfer_fixed_s
                      + (tokens * kv_bytes + state_bytes) / bandwidth.
  pd_request_overhead_s is what a request waits in SGLang PD besides compute and bytes (pre-allocation
  and bootstrap handshakes, decode polling for the finished transfer; design.md). It holds no GPU, so
  it delays the first token only; the model puts it after the batch (same TTFT). A write-back of lent
  KV (decode -> prefill) does not pay it.

Invariants: every cost is finite and > 0 for a non-empty batch; all counts are whole tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from basin_runtime.policy.capacity import uniform_pooled_tokens
from basin_runtime.policy.lending import LENDING_KINDS, LendingKind

CacheKind = Literal["gpu", "host"]
CACHE_KINDS: tuple[CacheKind, ...] = ("gpu", "host")
SessionRadixCache = bool | Literal["faithful"]
SESSION_RADIX_CACHE_KINDS: tuple[SessionRadixCache, ...] = (False, True, "faithful")
SESSION_RADIX_CACHE_CHOICES: dict[str, SessionRadixCache] = {"false": False, "faithful": "faithful", "true": True}


class ProfileError(ValueError):
    """A profile or deployment value that the model cannot use."""


@dataclass(frozen=True)
class Profile:
    """One GPU instance serving one model: memory in tokens and the cost of each kind of work."""

    name: str
    kv_pool_tokens: int  # device KV pool of one instance: the prefill cache, or decode memory
    kv_bytes_per_token: float  # bytes of KV per token, moved by transfers and load-backs
    state_bytes_per_request: float  # fixed per-request state moved with the KV (linear-attention state)
    prefill_batch_fixed_s: float
    prefill_token_s: float
    prefill_attention_pair_s: float
    chunked_prefill_tokens: int  # token budget of one prefill batch
    decode_step_fixed_s: float
    dense_weight_bytes: float  # weights every decode step reads (attention, shared expert, embeddings)
    expert_weight_bytes: float  # routed-expert weights, read in the share `touched(B)`
    experts_total: int
    experts_per_token: int
    kv_read_bytes_per_token: float  # KV bytes a decode step reads per context token
    hbm_bytes_per_s: float  # effective device memory bandwidth
    transfer_fixed_s: float
    transfer_bytes_per_s: float  # prefill -> decode (RDMA)
    host_load_bytes_per_s: float  # host tier -> device (PCIe)
    host_cache_ratio: float  # host pool size as a multiple of the device pool (SGLang --hicache-ratio)
    pd_request_overhead_s: float = 0.0  # per request in PD: bootstrap handshake and transfer polling
    storage_load_bytes_per_s: float = 5.0e9  # HiCache storage tier -> host (prefetch; basin_sim/storage.py)

    def __post_init__(self) -> None:
        for name in ("kv_pool_tokens", "chunked_prefill_tokens", "experts_total", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be a whole number > 0, got {value!r}")
        for name, value in vars(self).items():
            if isinstance(value, float) and (not math.isfinite(value) or value < 0):
                raise ProfileError(f"profile {self.name!r}: {name} must be finite and >= 0, got {value!r}")
        if self.experts_per_token > self.experts_total:
            raise ProfileError(f"profile {self.name!r}: experts_per_token > experts_total")
        for name in ("prefill_token_s", "hbm_bytes_per_s", "transfer_bytes_per_s", "host_load_bytes_per_s",
                     "storage_load_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ProfileError(f"profile {self.name!r}: {name} must be > 0")
        if self.host_cache_ratio < 1:
            raise ProfileError(f"profile {self.name!r}: host_cache_ratio must be >= 1 (SGLang's minimum)")

    def prefill_batch_s(self, computed_tokens: int, attention_pairs: float, load_back_tokens: int) -> float:
        """Duration of one prefill batch (see the cost model at the top of this module)."""
        compute = (self.prefill_batch_fixed_s + self.prefill_token_s * computed_tokens
                   + self.prefill_attention_pair_s * attention_pairs)
        return max(compute, self.load_back_s(load_back_tokens))  # load-back overlaps the forward, layer by layer

    def load_back_s(self, tokens: int) -> float:
        """Time to copy `tokens` of KV from the host tier back to the device."""
        return tokens * self.kv_bytes_per_token / self.host_load_bytes_per_s

    def decode_step_s(self, batch_size: int, kv_tokens: float) -> float:
        """Duration of one decode step of `batch_size` requests reading `kv_tokens` of context."""
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts_total) ** batch_size
        weights = self.dense_weight_bytes + self.expert_weight_bytes * touched
        read = weights + kv_tokens * self.kv_read_bytes_per_token + batch_size * 2 * self.state_bytes_per_request
        return self.decode_step_fixed_s + read / self.hbm_bytes_per_s

    def storage_fetch_s(self, tokens: int) -> float:
        """Time to prefetch `tokens` of KV from the storage tier to the host (HiCache L3 -> L2)."""
        return tokens * self.kv_bytes_per_token / self.storage_load_bytes_per_s

    def transfer_s(self, tokens: int) -> float:
        """Time from a request's prefill end to its KV on decode (PD overhead + its whole prompt's KV)."""
        size = tokens * self.kv_bytes_per_token + self.state_bytes_per_request
        return self.pd_request_overhead_s + self.transfer_fixed_s + size / self.transfer_bytes_per_s

    def write_back_s(self, tokens: int) -> float:
        """Time to write `tokens` of lent KV back from decode to prefill (the KV-transfer bandwidth)."""
        return self.transfer_fixed_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def host_tier_tokens(self) -> int:
        """Tokens the host tier holds beyond the device copy.

        SGLang's HiCache writes through, so its host pool (`host_cache_ratio` x the device pool) also
        holds copies of what is on the device; the model keeps tiers exclusive and gives the host the
        part that is not a copy: (ratio - 1) x the device pool.
        """
        return int((self.host_cache_ratio - 1.0) * self.kv_pool_tokens)


@dataclass(frozen=True)
class Deployment:
    """P prefill and D decode instances of one profile; caches in tokens (host 0: no host tier); lending."""

    name: str
    profile: Profile
    num_prefill: int
    num_decode: int
    prefill_cache_tokens: int
    decode_kv_tokens: int
    host_cache_tokens: int = 0
    # SGLang decode server settings (basin_sim/decode.py): --num-reserved-decode-tokens,
    # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION and --retraction-policy, at their defaults.
    decode_reserved_tokens: int = 512
    decode_clip_max_new_tokens: int = 4096
    retraction_policy: Literal["length", "priority"] = "length"
    lending: LendingKind = "none"  # a deployment switch every policy runs under (LENDING_KINDS)
    # SGLang's --enable-session-radix-cache on the prefill tree (basin_sim/radix_cache.py): False off,
    # "faithful" as SGLang's code runs it under PD (no reference is taken on prefill: inert, reported),
    # True the intended semantics on the prefill tree (hypothetical under PD).
    session_radix_cache: SessionRadixCache = False

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "prefill_cache_tokens", "decode_kv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ProfileError(f"deployment {self.name!r}: {name} must be a whole number > 0, got {value!r}")
        if self.host_cache_tokens < 0:
            raise ProfileError(f"deployment {self.name!r}: host_cache_tokens must be >= 0")
        if self.decode_reserved_tokens < 0 or self.decode_clip_max_new_tokens < 0:
            raise ProfileError(f"deployment {self.name!r}: decode_reserved_tokens and decode_clip_max_new_tokens "
                               "must be >= 0")
        if self.retraction_policy not in ("length", "priority"):
            raise ProfileError(f"deployment {self.name!r}: retraction_policy must be length or priority, "
                               f"got {self.retraction_policy!r}")
        value = self.session_radix_cache
        if not any(value == kind and type(value) is type(kind) for kind in SESSION_RADIX_CACHE_KINDS):
            raise ProfileError(f"deployment {self.name!r}: session_radix_cache must be one of "
                               f"{list(SESSION_RADIX_CACHE_KINDS)}, got {value!r}")
        if self.lending not in LENDING_KINDS:
            raise ProfileError(f"deployment {self.name!r}: lending must be one of {list(LENDING_KINDS)}, "
                               f"got {self.lending!r}")

    @classmethod
    def of(cls, name: str, profile: Profile, num_prefill: int, num_decode: int, cache: CacheKind) -> Deployment:
        """A deployment whose caches are the profile's whole KV pool (and host tier if `cache` is 'host')."""
        host = profile.host_tier_tokens() if cache == "host" else 0
        return cls(name, profile, num_prefill, num_decode, profile.kv_pool_tokens, profile.kv_pool_tokens, host)

    @property
    def has_host_tier(self) -> bool:
        """True when evicted device KV goes to a host tier instead of being dropped."""
        return self.host_cache_tokens > 0

    @property
    def cache_capacity_tokens(self) -> int:
        """The prefix cache of all prefill instances together (a calibration's `cache_capacity_tokens`)."""
        return uniform_pooled_tokens(self.prefill_cache_tokens, self.num_prefill)

    @property
    def decode_capacity_tokens(self) -> int:
        """The KV memory of all decode instances together."""
        return uniform_pooled_tokens(self.decode_kv_tokens, self.num_decode)

    @property
    def host_capacity_tokens(self) -> int:
        """The host tier of all prefill instances together (0: no host tier)."""
        return uniform_pooled_tokens(self.host_cache_tokens, self.num_prefill)

    @property
    def takes_session_refs(self) -> bool:
        """True when the prefill caches keep session references (`session_radix_cache: true`)."""
        return self.session_radix_cache is True

    @property
    def cache_kind(self) -> CacheKind:
        """'host' with a host tier, else 'gpu'."""
        return "host" if self.has_host_tier else "gpu"

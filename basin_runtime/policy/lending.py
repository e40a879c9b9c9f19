"""`LendingLedger`: which decode instance lends how much KV to the prefix cache, and for whom.

The lending ledger: decode memory lent to the prefix cache.

Rules:
- Each decode instance (a string id) has a memory capacity in tokens; what it may lend is capped
  at cap_tokens = floor(capacity_tokens * lend_cap_fraction); the default `LEND_CAP_FRACTION`
  (half of its memory, the paper's cap) is the one definition the gateway and simulator share.
- An entry is the KV a decode instance kept of a session's finished call: session_id -> tokens.
  A session has at most one lent copy: lending again replaces the older copy, possibly on another
  instance. A zero-token copy is not kept.
- Lending beyond the cap evicts that instance's oldest entries first (least recently lent). A copy
  larger than the whole cap is not kept at all (and evicts nothing).
- `reclaim` gives memory back to decode: lent entries go first, oldest first, until the request is
  covered or nothing is lent. Decode always wins over the cache.
- `write_back_plan`: when a decode instance holds a longer prefix of a session than prefill's
  cache, move the difference back to prefill.
- Every method that drops entries returns them, so the caller frees exactly that KV.
Invariants: 0 <= lent_tokens(i) <= cap_tokens(i) and lent_tokens(i) == sum of i's entries for
every instance i; each session is held by at most one instance.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from basin_runtime.policy.config import PolicyError, require_finite, require_tokens

LEND_CAP_FRACTION = 0.5  # decode lends at most half of its memory (the paper's cap)
# A deployment's lending switch: "none" (stock SGLang: decode frees a finished request's KV),
# "decode-memory" (the paper's lending: decode keeps it in idle memory and writes back what prefill
# is missing), "storage-offload" (stock SGLang's flags: decode offloads it to the HiCache storage
# tier, prefill prefetches it back; basin_sim/storage.py). Calibration files and the simulator's
# deployments name it.
LendingKind = Literal["none", "decode-memory", "storage-offload"]
LENDING_KINDS: tuple[LendingKind, ...] = ("none", "decode-memory", "storage-offload")


@dataclass(frozen=True)
class LentEntry:
    """One session's KV kept by one decode instance."""

    session_id: str
    instance_id: str
    tokens: int


@dataclass(frozen=True)
class Reclaimed:
    """What `reclaim` gave back to decode: the entries dropped, oldest first."""

    instance_id: str
    requested_tokens: int
    freed_tokens: int
    entries: tuple[LentEntry, ...]


@dataclass(frozen=True)
class WriteBackPlan:
    """Move `tokens_to_move` of a session's KV from a decode instance back to prefill."""

    session_id: str
    instance_id: str
    held_tokens: int
    prefill_cached_tokens: int
    tokens_to_move: int


class LendingLedger:
    """Per decode instance, the KV of finished calls kept for the prefix cache, oldest first."""

    def __init__(self, lend_cap_fraction: float = LEND_CAP_FRACTION) -> None:
        fraction = require_finite("lend_cap_fraction", lend_cap_fraction)
        if not 0 < fraction <= 1:
            raise PolicyError(f"lend_cap_fraction must be in (0, 1], got {lend_cap_fraction!r}")
        self.lend_cap_fraction = fraction
        self._capacity: dict[str, int] = {}
        self._entries: dict[str, OrderedDict[str, int]] = {}  # instance -> session -> tokens
        self._lent: dict[str, int] = {}
        self._holder: dict[str, str] = {}  # session -> instance

    def add_instance(self, instance_id: str, capacity_tokens: int) -> None:
        """Register a decode instance with its memory capacity in tokens."""
        if not isinstance(instance_id, str) or not instance_id:
            raise PolicyError(f"instance_id must be a non-empty string, got {instance_id!r}")
        if instance_id in self._capacity:
            raise PolicyError(f"decode instance {instance_id!r} is already registered")
        capacity = require_tokens(f"capacity_tokens of instance {instance_id!r}", capacity_tokens)
        if capacity == 0:
            raise PolicyError(f"capacity_tokens of instance {instance_id!r} must be > 0, got 0")
        self._capacity[instance_id] = capacity
        self._entries[instance_id] = OrderedDict()
        self._lent[instance_id] = 0

    def instance_ids(self) -> tuple[str, ...]:
        """The registered decode instances, in registration order."""
        return tuple(self._capacity)

    def cap_tokens(self, instance_id: str) -> int:
        """The most an instance may lend."""
        return int(self._capacity_of(instance_id) * self.lend_cap_fraction)

    def lent_tokens(self, instance_id: str) -> int:
        """What an instance lends now."""
        self._capacity_of(instance_id)
        return self._lent[instance_id]

    def entries(self, instance_id: str) -> tuple[LentEntry, ...]:
        """An instance's lent entries, oldest first."""
        self._capacity_of(instance_id)
        return tuple(
            LentEntry(session_id, instance_id, tokens) for session_id, tokens in self._entries[instance_id].items()
        )

    def holder_of(self, session_id: str) -> LentEntry | None:
        """The lent copy of a session, or None."""
        instance_id = self._holder.get(session_id)
        if instance_id is None:
            return None
        return LentEntry(session_id, instance_id, self._entries[instance_id][session_id])

    def lend(self, session_id: str, instance_id: str, tokens: int) -> list[LentEntry]:
        """Record that an instance keeps `tokens` of a session; return the entries dropped."""
        cap = self.cap_tokens(instance_id)
        kept = require_tokens(f"lent tokens of session {session_id!r}", tokens)
        if not isinstance(session_id, str) or not session_id:
            raise PolicyError(f"session_id must be a non-empty string, got {session_id!r}")
        dropped: list[LentEntry] = []
        old = self.forget(session_id)
        if old is not None:
            dropped.append(old)
        new = LentEntry(session_id, instance_id, kept)
        if kept == 0:
            return dropped
        if kept > cap:
            dropped.append(new)
            return dropped
        while self._lent[instance_id] + kept > cap:
            dropped.append(self._pop_oldest(instance_id))
        self._entries[instance_id][session_id] = kept
        self._lent[instance_id] += kept
        self._holder[session_id] = instance_id
        return dropped

    def reclaim(self, instance_id: str, tokens_needed_by_decode: int) -> Reclaimed:
        """Free lent memory for decode, oldest entries first, until the need is covered."""
        self._capacity_of(instance_id)
        needed = require_tokens(f"tokens_needed_by_decode on {instance_id!r}", tokens_needed_by_decode)
        freed: list[LentEntry] = []
        freed_tokens = 0
        while freed_tokens < needed and self._entries[instance_id]:
            entry = self._pop_oldest(instance_id)
            freed.append(entry)
            freed_tokens += entry.tokens
        return Reclaimed(instance_id, needed, freed_tokens, tuple(freed))

    def write_back_plan(self, session_id: str, prefill_cached_tokens: int) -> WriteBackPlan | None:
        """If decode holds a longer prefix of the session than prefill's cache, plan the move."""
        cached = require_tokens(f"prefill_cached_tokens of session {session_id!r}", prefill_cached_tokens)
        entry = self.holder_of(session_id)
        if entry is None or entry.tokens <= cached:
            return None
        return WriteBackPlan(session_id, entry.instance_id, entry.tokens, cached, entry.tokens - cached)

    def forget(self, session_id: str) -> LentEntry | None:
        """Drop a session's lent copy (on session end); return it, or None if there was none."""
        entry = self.holder_of(session_id)
        if entry is None:
            return None
        del self._entries[entry.instance_id][session_id]
        del self._holder[session_id]
        self._lent[entry.instance_id] -= entry.tokens
        return entry

    def to_dict(self) -> dict[str, Any]:
        """Per instance: capacity, cap, lent tokens and entries (oldest first), as plain types."""
        return {
            instance_id: {
                "capacity_tokens": capacity,
                "cap_tokens": self.cap_tokens(instance_id),
                "lent_tokens": self._lent[instance_id],
                "entries": dict(self._entries[instance_id]),
            }
            for instance_id, capacity in self._capacity.items()
        }

    def _capacity_of(self, instance_id: str) -> int:
        capacity = self._capacity.get(instance_id)
        if capacity is None:
            raise PolicyError(f"unknown decode instance {instance_id!r}; call add_instance first")
        return capacity

    def _pop_oldest(self, instance_id: str) -> LentEntry:
        session_id, tokens = self._entries[instance_id].popitem(last=False)
        del self._holder[session_id]
        self._lent[instance_id] -= tokens
        return LentEntry(session_id, instance_id, tokens)

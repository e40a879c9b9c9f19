"""Bounded engine priority levels, the session routing key, and request ids.

What the gateway stamps on every forwarded call: the session's engine priority (a bounded level), its
routing key, and the request id.

Rules:
- Basin's priority p is in seconds, fixed per session, smaller served first
  (`basin_runtime.policy.priority`). Engines get a *level*, not p: a session's level is its rank among
  the sessions the gateway holds (live and queued) in (p, arrival) order, bucketed into `num_levels`:
  level = floor(rank x num_levels / n), so level 0 holds the most urgent 1/num_levels of them. The
  order is kept (a more urgent session never gets a larger level) while engines see at most
  `num_levels` distinct values: SGLang labels its metrics by `priority` when priority scheduling is
  on, so a value per second (or per session) would grow their label sets without bound.
- Value sent = level x (preemption_threshold + 1). SGLang preempts a running request only when the
  newcomer's priority differs by MORE than `--priority-scheduling-preemption-threshold` (default 10;
  `priority_diff > threshold` in managers/schedule_policy.py, sglang 0.5.23), so adjacent levels are
  exactly one step past it: a more urgent level may preempt, a same-level request never does.
  Smaller = earlier, so engines run `--enable-priority-scheduling --schedule-low-priority-values-first`.
- A session's level is read at each call (it moves as sessions ahead of it leave or arrive behind
  it). Cost: a call reads its rank with one bisect, O(log n); an arrival or an end inserts or removes
  one key of a sorted list (bisect, then a C memmove of n pointers), never a sort.
- Routing key: `basin-` + 24 hex characters of BLAKE2b(session id): stable across gateway replicas and
  restarts, safe ASCII, and never ending in `_t<n>`/`_r<n>` (which smg strips). Sent in the routing-key
  header (`x-smg-routing-key` by default), replacing a client's own.
- `rid` = `<routing key>_t<call index>`: stable too, and smg (sticky sessions on) derives the same
  key from it, since it strips one `_r<n>` then one `_t<n>` suffix and prefers a rid-derived key to the
  header. The gateway owns `rid` as it owns `priority`: a client's own rid is replaced (SGLang keys a
  request's state and its abort on the rid, and smg its routing, so a rid chosen by a client could
  collide with another session's calls). Batch requests (a list of prompts) carry no rid: SGLang
  makes one per item, and a client's own rid is removed.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Any

DEFAULT_NUM_LEVELS = 4
DEFAULT_PREEMPTION_THRESHOLD = 10  # SGLang's --priority-scheduling-preemption-threshold default
MAX_NUM_LEVELS = 64
ROUTING_KEY_HEADER = "x-smg-routing-key"  # smg's default --routing-key-headers


class PriorityLevels:
    """The held sessions in Basin order, and each one's bucketed engine priority."""

    def __init__(self, num_levels: int = DEFAULT_NUM_LEVELS,
                 preemption_threshold: int = DEFAULT_PREEMPTION_THRESHOLD) -> None:
        if not 1 <= num_levels <= MAX_NUM_LEVELS:
            raise ValueError(f"num_levels must be 1..{MAX_NUM_LEVELS}, got {num_levels}")
        if preemption_threshold < 0:
            raise ValueError(f"preemption_threshold must be >= 0, got {preemption_threshold}")
        self.num_levels = num_levels
        self.spacing = preemption_threshold + 1
        self._keys: list[tuple[float, int]] = []
        self._key_of: dict[str, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, session_id: str, priority_s: float) -> None:
        """A session the gateway now holds, with its fixed Basin priority (seconds)."""
        if math.isnan(priority_s):
            raise ValueError(f"session {session_id!r}: priority is NaN")
        if session_id in self._key_of:
            raise ValueError(f"session {session_id!r} is already ranked")
        self._seq += 1
        key = self._key_of[session_id] = (priority_s, self._seq)
        bisect.insort(self._keys, key)

    def reset(self, ranked: list[tuple[str, float]]) -> None:
        """Rank exactly these sessions (id, priority), added in this order (ties go to the earlier one)."""
        self._keys, self._key_of = [], {}
        for session_id, priority_s in ranked:
            self.add(session_id, priority_s)

    def remove(self, session_id: str) -> None:
        """A session left (no-op if it was not ranked)."""
        key = self._key_of.pop(session_id, None)
        if key is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]

    def level(self, session_id: str) -> int:
        """The session's level now: 0 (most urgent) .. num_levels - 1 (the last for a session not ranked: with
        a shared state, one whose registration is on its way)."""
        key = self._key_of.get(session_id)
        if key is None:
            return self.num_levels - 1
        return bisect.bisect_left(self._keys, key) * self.num_levels // len(self._keys)

    def value(self, session_id: str) -> int:
        """The integer the engines get: level x (preemption threshold + 1)."""
        return self.level(session_id) * self.spacing

    def values(self) -> frozenset[int]:
        """Every value a call may carry with this configuration."""
        return frozenset(level * self.spacing for level in range(self.num_levels))


def routing_key(session_id: str) -> str:
    """The session's routing key: the same on every replica and after a restart, safe ASCII."""
    return "basin-" + hashlib.blake2b(session_id.encode("utf-8"), digest_size=12).hexdigest()


def request_id(key: str, call_index: int) -> str:
    """The rid of a session's call: `<routing key>_t<call index>` (smg strips the `_t<n>` back to the key)."""
    return f"{key}_t{call_index}"


def stamp(body: dict[str, Any], priority: int, rid: str | None) -> str | None:
    """Set the gateway's `priority` and `rid` on the request body, replacing the client's (no rid: a batch, whose
    client rid is removed); return `rid`."""
    body["priority"] = priority
    if rid is None:
        body.pop("rid", None)
    else:
        body["rid"] = rid
    return rid

"""Routing of requests to one pool of workers (prefill, or decode), as SGLang's router smg 1.13.0 does
with its default policy `cache_aware`: radix-tree affinity under a balance gate.

In PD mode smg runs one such policy for prefill and another for decode, each with its own tree, on
the same text; the engine does the same (every decode is a partner of every prefill).

Rules (smg's, defaults in brackets):
- A radix tree of request texts is shared by the pool; a worker is a *tenant* of what was inserted
  for it (every worker starts with the empty string). matched = the longest prefix of the request
  held by any tenant; a hit if matched / request length > cache_threshold [0.3] (strict). A hit's
  candidates are the tenants of the deepest matched node (at most MAX_CANDIDATES, lowest index first).
- load = the worker's in-flight requests: +1 at dispatch (`route`, right after selection), -1 when
  the request's response ends (`finish`: answered, or the client went away). With no load reports
  the expected wait is the load: join-shortest-queue, ties uniformly at random (a seeded RNG).
- Balance gate: a worker is over if load > avg * balance_rel_threshold [1.5] and load > avg + margin,
  margin = min(balance_abs_threshold [64], max(ceil(2 sqrt(avg)), 4)), avg = mean load of the pool.
- Hit: the least loaded candidate under the gate. Spill (every candidate over): the least loaded
  worker under the gate (smg falls back to the whole pool if none is; with rel >= 1 the least
  loaded worker, at or below the mean, is always under). Miss: the least loaded worker of the pool.
- The chosen worker becomes a tenant of the request's whole text at routing time, spill targets
  too (a hot prefix is copied); nothing is inserted when the request completes.
- Left out: smg's overload protection (it acts on load reports, which the simulator does not send)
  and its periodic pruning (a session's entries go when it ends instead; design.md says why that
  changes no live session's routing).

The tree in tokens (a proxy for characters: the simulator has token counts, not text):
- Sessions of one group (benchmark) share a prefix of group_tokens (the system prompt) and nothing
  past it; a session's prompts are prefixes of each other (call k+1 extends call k), as
  radix_cache.py assumes. A prompt shorter than what a tenant holds of its session is a rewritten
  conversation (radix_cache.py forgets the chain then): that entry does not match, and it is dropped
  when the prompt is inserted. Session keys name distinct conversations (a replayed pool session
  under a new key shares only the group prefix), as in radix_cache.py. Match rates are token shares.
- So the index is flat: per session, each tenant and the prompt length inserted for it; per group,
  its tenants (every worker that got any of its sessions). matched = the longest held session prompt
  no longer than this one, else group_tokens if a tenant holds the group, else 0. The deepest node's
  tenants: those holding that length (the group's tenants when only the group prefix matches).
- A step does no scan over the pool (a 300-worker pool routes as fast as a 3-worker one): the total
  load is kept, the workers of each load in index order, and per group its MAX_CANDIDATES lowest
  tenants. Decisions and random draws are those of the scanning version (tests/sim/router_v1.py,
  checked by tests/sim/test_router_differential.py).
- Every step is validated before anything changes: a bad step raises RouterError and changes nothing.
"""

from __future__ import annotations

import bisect
import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

CACHE_THRESHOLD = 0.3  # smg --cache-threshold: share of the request a matched prefix must exceed
BALANCE_ABS_THRESHOLD = 64  # smg --balance-abs-threshold: cap of the gate's margin over the mean load
BALANCE_REL_THRESHOLD = 1.5  # smg --balance-rel-threshold: over the gate above this multiple of the mean
MIN_MARGIN = 4.0  # the gate's smallest margin over the mean load (in-flight requests)
MAX_CANDIDATES = 8  # tenants of the matched node considered on a hit


class RouterError(ValueError):
    """A routing step the router cannot honour (bad sizes, unknown worker, a load below zero)."""


class RouteKind(enum.Enum):
    """Why a worker was chosen."""

    HIT = "hit"  # a holder of the matched prefix, under the balance gate
    SPILL = "spill"  # every holder was over the gate: the least loaded worker under it
    MISS = "miss"  # too little of the request matched: the least loaded worker


@dataclass(frozen=True)
class Route:
    """A routing decision: the worker, why, and the tokens of the request the tree matched."""

    worker: int
    kind: RouteKind
    matched_tokens: int


@dataclass(slots=True)
class _Group:
    tokens: int
    tenants: set[int] = field(default_factory=set)
    lowest: list[int] = field(default_factory=list)  # the MAX_CANDIDATES lowest tenants, ascending

    def add(self, worker: int) -> None:
        if worker in self.tenants:
            return
        self.tenants.add(worker)
        lowest = self.lowest
        if len(lowest) < MAX_CANDIDATES or worker < lowest[-1]:
            bisect.insort(lowest, worker)
            del lowest[MAX_CANDIDATES:]


@dataclass(slots=True)
class _Conversation:
    group_key: str
    held_tokens: dict[int, int] = field(default_factory=dict)  # tenant -> prompt tokens inserted


def balance_margin(avg_load: float, balance_abs_threshold: float = BALANCE_ABS_THRESHOLD) -> float:
    """How far above the mean load a worker may go before the gate can call it over."""
    return min(balance_abs_threshold, max(math.ceil(2 * math.sqrt(avg_load)), MIN_MARGIN))


def is_over(load: float, avg_load: float, balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
            balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> bool:
    """The balance gate: True if a worker with this load is over it."""
    return (load > avg_load * balance_rel_threshold
            and load > avg_load + balance_margin(avg_load, balance_abs_threshold))


class CacheAwareRouter:
    """smg's `cache_aware` policy over `num_workers` workers, with a token-level index of what each holds."""

    def __init__(self, num_workers: int, *, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: float = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, seed: int = 0) -> None:
        if num_workers <= 0:
            raise RouterError(f"num_workers must be > 0, got {num_workers}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise RouterError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise RouterError(f"balance thresholds must be abs >= 0 and rel >= 1, got {balance_abs_threshold}, "
                              f"{balance_rel_threshold}")
        self.num_workers = num_workers
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._rng = random.Random(seed)
        self._loads = [0] * num_workers
        self._total_load = 0  # == sum(self._loads)
        self._by_load: dict[int, list[int]] = {0: list(range(num_workers))}  # load -> its workers, ascending
        self._min_load = 0  # the lowest load (its list is never empty)
        self._routed = [0] * num_workers
        self._groups: dict[str, _Group] = {}
        self._conversations: dict[str, _Conversation] = {}

    # --- questions -------------------------------------------------------------------------------

    @property
    def loads(self) -> tuple[int, ...]:
        """In-flight requests per worker."""
        return tuple(self._loads)

    @property
    def num_routed(self) -> tuple[int, ...]:
        """Requests dispatched to each worker over the router's life."""
        return tuple(self._routed)

    @property
    def num_conversations(self) -> int:
        """Sessions the index holds entries of."""
        return len(self._conversations)

    def holders(self, session_key: str) -> dict[int, int]:
        """Tenants holding a session's conversation, and the prompt tokens inserted for each."""
        conversation = self._conversations.get(session_key)
        return {} if conversation is None else dict(conversation.held_tokens)

    def group_tenants(self, group_key: str) -> frozenset[int]:
        """Tenants holding a group's shared prefix."""
        group = self._groups.get(group_key)
        return frozenset() if group is None else frozenset(group.tenants)

    def match(self, session_key: str, group_key: str, group_tokens: int,
              prompt_tokens: int) -> tuple[int, tuple[int, ...]]:
        """Matched tokens of a request and the tenants of the deepest matched node (no change)."""
        self._check(session_key, group_key, group_tokens, prompt_tokens)
        conversation = self._conversations.get(session_key)
        held = {} if conversation is None else conversation.held_tokens
        matching = {w: t for w, t in held.items() if t <= prompt_tokens}
        matched = max(matching.values(), default=0)
        if matched > group_tokens:
            return matched, tuple(sorted(w for w, t in matching.items() if t == matched)[:MAX_CANDIDATES])
        group = self._groups.get(group_key)
        if group is None or not group.tenants:
            return 0, ()
        return group_tokens, tuple(group.lowest)

    def is_over(self, worker: int) -> bool:
        """True if this worker is over the balance gate now."""
        avg_load = self._total_load / self.num_workers
        return is_over(self._loads[worker], avg_load, self.balance_abs_threshold, self.balance_rel_threshold)

    # --- steps -----------------------------------------------------------------------------------

    def route(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int) -> Route:
        """Choose the worker of a request, insert its text for that worker, count it in flight there."""
        matched, candidates = self.match(session_key, group_key, group_tokens, prompt_tokens)
        if matched / prompt_tokens > self.cache_threshold:
            route = self._choose_on_hit(candidates, matched)
        else:
            route = Route(self._least_loaded_of_pool(), RouteKind.MISS, matched)
        self._insert(route.worker, session_key, group_key, group_tokens, prompt_tokens)
        self._move(route.worker, +1)
        self._routed[route.worker] += 1
        return route

    def finish(self, worker: int) -> None:
        """A request's response on `worker` ended (answered, or its client went away)."""
        if not 0 <= worker < self.num_workers:
            raise RouterError(f"worker {worker} is not in a pool of {self.num_workers}")
        if self._loads[worker] == 0:
            raise RouterError(f"worker {worker} has no request in flight to finish")
        self._move(worker, -1)

    def forget(self, session_key: str) -> None:
        """Drop an ended session's entries (no request of it will come again)."""
        self._conversations.pop(session_key, None)

    # --- internals -------------------------------------------------------------------------------

    def _check(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int) -> None:
        if group_tokens <= 0 or prompt_tokens < group_tokens:
            raise RouterError(f"session {session_key!r}: need 0 < group tokens <= prompt tokens, got "
                              f"{group_tokens} and {prompt_tokens}")
        group = self._groups.get(group_key)
        if group is not None and group.tokens != group_tokens:
            raise RouterError(f"group {group_key!r} has {group.tokens} shared tokens, not {group_tokens}")
        conversation = self._conversations.get(session_key)
        if conversation is not None and conversation.group_key != group_key:
            raise RouterError(f"session {session_key!r} is in group {conversation.group_key!r}, not {group_key!r}")

    def _choose_on_hit(self, candidates: Sequence[int], matched: int) -> Route:
        holders = [w for w in candidates if not self.is_over(w)]
        if holders:
            return Route(self._least_loaded(holders), RouteKind.HIT, matched)
        # the least loaded workers under the gate are the pool's least loaded (never over: see the rules)
        return Route(self._least_loaded_of_pool(), RouteKind.SPILL, matched)

    def _least_loaded(self, workers: Sequence[int]) -> int:
        lowest = min(self._loads[w] for w in workers)
        ties = [w for w in workers if self._loads[w] == lowest]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def _least_loaded_of_pool(self) -> int:
        ties = self._by_load[self._min_load]  # in index order, as a scan of the pool lists them
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)

    def _move(self, worker: int, step: int) -> None:
        """Change a worker's load by `step` (+1 or -1), keeping the total, the buckets and the lowest load."""
        old = self._loads[worker]
        new = self._loads[worker] = old + step
        self._total_load += step
        bucket = self._by_load[old]
        del bucket[bisect.bisect_left(bucket, worker)]
        if not bucket:
            del self._by_load[old]
        bisect.insort(self._by_load.setdefault(new, []), worker)
        if new < self._min_load:
            self._min_load = new
        elif old == self._min_load and old not in self._by_load:
            self._min_load = new  # the lowest bucket emptied: the mover is now the lowest

    def _insert(self, worker: int, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int) -> None:
        self._groups.setdefault(group_key, _Group(group_tokens)).add(worker)
        conversation = self._conversations.setdefault(session_key, _Conversation(group_key))
        held = conversation.held_tokens
        for rewritten in [w for w, t in held.items() if t > prompt_tokens]:
            del held[rewritten]  # no longer a prefix of the conversation
        held[worker] = max(held.get(worker, 0), prompt_tokens)

"""A prefill instance's prefix cache: SGLang's RadixCache (LRU eviction of unreferenced leaves), with an
optional host tier (HiCache), over token counts rather than token ids.

The tree: root -> one *group* node per shared system prompt (one per benchmark) -> one *chain* per
session, whose nodes ("segments") are the per-call increments of its conversation. Call k+1's prompt
extends call k's prompt (plus the answer and the tool output), so it matches the whole chain and adds
one segment. A group node is stored as a one-segment chain with the session chains as children.

Rules:
- Every segment is in exactly one tier: device, host or none. Along any root-to-leaf path the tiers
  run device* host* none* (a prefix property: only a cached prefix can hit).
- `admit` (a request is scheduled): pin the chain and its group, hit = device part + host part,
  load the host part back, recompute the rest, append the call's new segment: afterwards the whole
  chain is on the device and pinned. If the pinned tokens leave no room, nothing changes (None).
  At least one token is always computed (the last prompt token, for the logits), as in SGLang.
- `release` (the KV reached decode): unpin. Touching a chain sets the last-access time of all its
  nodes, so the device nodes of a chain always share one last-access time.
- Holds (pins between calls, pins.py): `release(..., hold_until_s=t)` keeps the request's pin as a
  hold instead of unpinning; `hold(key, t)` moves its expiry; `expire_holds(now)` unpins every hold
  whose time has come (it becomes evictable as usual), but those its `keep` predicate keeps for now;
  the session's next `admit` turns its hold back into a request pin; `drop_hold` ends it at once (the
  session ended). A hold is one lock reference.
- Device eviction removes an unpinned leaf in LRU order (whole nodes, as SGLang does): the deepest
  device segment of the least recently used unpinned chain; a group node is a leaf once none of its
  chains has device segments. With a host tier the node moves to the host (evicting the host's LRU
  leaves for room); without one, or if it cannot fit, it is dropped, with the unreachable host nodes
  below it. Host eviction is LRU over host leaves, never pinned ones. Tiers are exclusive, with a host
  tier of (ratio - 1) x the device pool: the same host-only capacity as SGLang's write-through HiCache
  once the device is full (design.md).
- Records: the cache keeps a chain's record while some segment of it is on the device or the host,
  or it is pinned (a request or a hold), or its session holds a reference; a group's while it is
  cached or has a chain record. Once neither holds, the record goes (an ended session's KV stays until
  eviction takes it, as in SGLang, which without session references never learns that a session
  ended). A session whose chain went comes back as a new chain: its next prompt past the group is one
  new segment, as SGLang inserts it as one new node.
- Session references (`session_refs=True`: SGLang's `--enable-session-radix-cache`, field-sources.md
  section 2): `release(..., finished=True)` (a call's normal finish, not an abort) gives the session one
  reference on its path: the group and the chain's segments so far (its coverage); a later finish moves
  that coverage forward to the new segments, so a session holds one reference per path, not one per call.
  `close_session` (the session ended: SGLang's `/close_session`) drops its reference (the KV stays,
  unreferenced) and tombstones the id, so a late finish after the close takes none (the last 8192 closed
  ids are kept, SGLang's `_CLOSED_SESSION_TOMBSTONE_LIMIT`). Eviction (device and host) takes unreferenced
  leaves first, in LRU order, then referenced ones, in LRU order: soft, so referenced KV still goes under
  pressure; pinned (in-flight, held) chains never. A segment dropped to no tier leaves the coverage (it
  recedes to what is left, as SGLang's `discard_deleted_session_leaf`); a group dropped to no tier ends
  the references of its sessions (none is left on their path). A conversation rewritten (its segments
  forgotten) keeps its reference on the group only.
- Assumption (session references): a node's place in LRU order is its last access; a reference taken or
  dropped does not move it (the heap version of SGLang's eviction, `session_ref_eviction_strategy`,
  ranks by (referenced, strategy key); the list version re-files a node at the MRU end on a 0<->1
  change instead). With `session_refs=False` every leaf is unreferenced and the order is the plain LRU.
- Heaps use lazy invalidation (a version per chain; an entry (referenced, last_access_s, seq) ranks leaves, ties
  by push order). A heap is rebuilt from the current leaves, in record order, once its entries
  outnumber twice the records (+ MIN_HEAP_SLACK): match is O(1), eviction O(log n) amortized, and
  memory is bounded by what the cache holds.

Invariants (`check`): tier order on every path; device_used == sum of device segments <= capacity;
host_used == sum of host segments <= host capacity; pinned_tokens == device tokens of pinned chains
and of groups with a pinned chain; every record is cached or pinned or referenced (groups: or has
chains); a group's session_refs == its referencing chains; a chain's covered segments <= its cached ones,
0 without a reference; no closed session holds a reference.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MIN_HEAP_SLACK = 1024  # stale heap entries tolerated on top of twice the records before a rebuild
CLOSED_SESSION_TOMBSTONE_LIMIT = 8192  # SGLang's _CLOSED_SESSION_TOMBSTONE_LIMIT (session_ref_tracker.py)


class CacheError(ValueError):
    """A request the cache cannot represent (e.g. a prompt shorter than its group's shared prefix)."""


class Chain:
    """A path of segments: one session's conversation, or (with children) a group's shared prefix."""

    __slots__ = ("children", "device_children", "device_count", "device_tokens", "group", "host_count",
                 "host_tokens", "key", "last_access_s", "lock_ref", "locked_children", "ref_segments",
                 "resident_children", "segments", "session_refs", "tokens", "version")

    def __init__(self, key: str, group: Chain | None) -> None:
        self.key = key
        self.group = group
        self.segments: list[int] = []
        self.tokens = 0
        self.device_count = 0
        self.host_count = 0
        self.device_tokens = 0
        self.host_tokens = 0
        self.last_access_s = 0.0
        self.lock_ref = 0
        self.version = 0
        self.children: dict[str, Chain] = {}  # groups only: the chain records below it, by session
        self.device_children = 0  # children with device segments (groups only)
        self.resident_children = 0  # children with device or host segments (groups only)
        self.locked_children = 0  # pinned children (groups only)
        self.session_refs = 0  # chains: 1 while its session holds a reference; groups: referencing chains
        self.ref_segments = 0  # chains: leading segments the session's reference covers

    @property
    def is_resident(self) -> bool:
        """True while some segment is on the device or the host."""
        return self.device_count + self.host_count > 0

    def is_device_leaf(self) -> bool:
        """True when its deepest device segment may be evicted now."""
        if self.device_count == 0:
            return False
        if self.group is None:
            return self.device_children == 0 and self.locked_children == 0
        return self.lock_ref == 0

    def is_host_leaf(self) -> bool:
        """True when its deepest host segment may be evicted now."""
        if self.host_count == 0:
            return False
        if self.group is None:
            return self.resident_children == 0 and self.locked_children == 0
        return self.lock_ref == 0


@dataclass(frozen=True)
class Hit:
    """Cached tokens of a prompt: on the device, and on the host after them."""

    device_tokens: int
    host_tokens: int

    @property
    def tokens(self) -> int:
        """All cached tokens (device and host)."""
        return self.device_tokens + self.host_tokens


@dataclass(frozen=True)
class Admission:
    """What `admit` did: tokens hit on the device, loaded back from the host, and to compute."""

    device_hit_tokens: int
    host_hit_tokens: int
    computed_tokens: int


_Entry = tuple[bool, float, int, Chain, int]  # (referenced, last_access_s, seq, chain, version)


class RadixCache:
    """The device (and optional host) prefix cache of one prefill instance."""

    def __init__(self, capacity_tokens: int, host_capacity_tokens: int = 0, *, session_refs: bool = False) -> None:
        if capacity_tokens <= 0 or host_capacity_tokens < 0:
            raise CacheError(f"capacity must be > 0 and host capacity >= 0, got {capacity_tokens}, "
                             f"{host_capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.host_capacity_tokens = host_capacity_tokens
        self.device_used_tokens = 0
        self.host_used_tokens = 0
        self.pinned_tokens = 0
        self.evicted_tokens = 0  # device evictions, over the cache's life
        self.loaded_back_tokens = 0
        self._groups: dict[str, Chain] = {}
        self._chains: dict[str, Chain] = {}
        self._device_heap: list[_Entry] = []
        self._host_heap: list[_Entry] = []
        self._seq = 0
        self._holds: dict[str, float] = {}  # session -> hold expiry
        self._hold_heap: list[tuple[float, str]] = []  # lazy: stale entries skipped
        self.session_refs = session_refs
        self.references_taken = 0  # finishes that registered a session reference
        self.late_finishes = 0  # finishes of closed sessions (no reference taken)
        self.sessions_closed = 0
        self.evicted_referenced_tokens = 0  # device evictions of referenced segments
        self._closed: OrderedDict[str, None] = OrderedDict()  # tombstones of closed sessions

    # --- questions -------------------------------------------------------------------------------

    def lookup(self, session_key: str, group_key: str) -> Hit:
        """The cached prefix a session's next prompt would hit now (no change)."""
        group = self._groups.get(group_key)
        if group is None:
            return Hit(0, 0)
        chain = self._chains.get(session_key)
        device, host = group.device_tokens, group.host_tokens
        if chain is not None:
            device, host = device + chain.device_tokens, host + chain.host_tokens
        return Hit(device, host)

    @property
    def held_tokens(self) -> int:
        """Device tokens of the chains held between calls: holds with a finite expiry, a TTL after an answer, not
        those held until an answer comes (O(holds))."""
        return sum(self._chains[key].device_tokens for key, until_s in self._holds.items() if until_s != math.inf)

    @property
    def evictable_tokens(self) -> int:
        """Device tokens that eviction could free (everything not pinned)."""
        return self.device_used_tokens - self.pinned_tokens

    def has_chain(self, session_key: str) -> bool:
        """True while the cache keeps a record of a session's chain (something of it cached, or pinned)."""
        return session_key in self._chains

    @property
    def num_chains(self) -> int:
        """Session chains the cache keeps a record of (cached or pinned)."""
        return len(self._chains)

    @property
    def num_groups(self) -> int:
        """Groups the cache keeps a record of (cached, or with chain records)."""
        return len(self._groups)

    @property
    def num_heap_entries(self) -> int:
        """Entries in the eviction and hold heaps, stale ones included (bounded by the records)."""
        return len(self._device_heap) + len(self._host_heap) + len(self._hold_heap)

    # --- events ----------------------------------------------------------------------------------

    def admit(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int,
              now: float) -> Admission | None:
        """Pin a session's chain for a request, bring its prompt onto the device; None if no room."""
        group = self._group(group_key, group_tokens, session_key, prompt_tokens)
        chain = self._chains.get(session_key)
        if chain is None:
            chain = self._chains[session_key] = group.children[session_key] = Chain(session_key, group)
        elif session_key in self._holds:  # a held chain: the hold becomes this request's pin
            del self._holds[session_key]
            self._unlock(chain)
        if chain.lock_ref > 0:
            raise CacheError(f"session {session_key!r} is admitted twice at once")
        if prompt_tokens < group.tokens + chain.tokens:  # the conversation was rewritten: no longer a prefix
            self._forget_segments(chain)
        device_hit = group.device_tokens + chain.device_tokens
        host_hit = group.host_tokens + chain.host_tokens
        self._lock(chain)
        if self.capacity_tokens - self.pinned_tokens < prompt_tokens - device_hit:
            self._unlock(chain)
            self._forget_if_gone(chain)
            return None
        self._make_room(prompt_tokens - device_hit)
        self.loaded_back_tokens += host_hit
        self._load_all(group)
        new_tokens = prompt_tokens - group.tokens - chain.tokens
        if new_tokens > 0:
            chain.segments.append(new_tokens)
            chain.tokens += new_tokens
        self._load_all(chain)
        self._touch(chain, now)
        computed = prompt_tokens - device_hit - host_hit
        if computed == 0:  # a full hit still computes the last token
            computed = 1
            device_hit, host_hit = (device_hit, host_hit - 1) if host_hit else (device_hit - 1, 0)
        return Admission(device_hit, host_hit, computed)

    def release(self, session_key: str, now: float, hold_until_s: float | None = None, *,
                finished: bool = False) -> None:
        """Unpin a session's chain (its request's KV has left the instance), or keep it as a hold; `finished`
        (a normal finish, not an abort) takes the session's reference when session references are on."""
        chain = self._chains.get(session_key)
        if chain is None:
            raise CacheError(f"unknown session {session_key!r} released")
        if chain.lock_ref == 0 or session_key in self._holds:
            raise CacheError(f"session {session_key!r} released but not pinned by a request")
        if finished and self.session_refs:
            self._register(chain)
        self._touch(chain, now)
        if hold_until_s is None:
            self._unlock(chain)
            self._forget_if_gone(chain)
        else:
            self._set_hold(session_key, hold_until_s)

    def close_session(self, session_key: str) -> bool:
        """The session ended (SGLang's `/close_session`): drop its reference, KV kept; True if it held one."""
        self.sessions_closed += 1
        if not self.session_refs:
            return False
        self._closed[session_key] = None
        self._closed.move_to_end(session_key)
        if len(self._closed) > CLOSED_SESSION_TOMBSTONE_LIMIT:
            self._closed.popitem(last=False)
        return self.drop_reference(session_key)

    def drop_reference(self, session_key: str) -> bool:
        """Drop a session's reference without a tombstone (its KV kept, unreferenced); True if it held one."""
        chain = self._chains.get(session_key)
        if chain is None or not chain.session_refs:
            return False
        self._dereference(chain)
        self._forget_if_gone(chain)
        return True

    def is_referenced(self, session_key: str) -> bool:
        """True while a session holds a reference on its path."""
        chain = self._chains.get(session_key)
        return chain is not None and chain.session_refs > 0

    def _register(self, chain: Chain) -> None:
        """A normal finish: the session's reference covers its whole chain now (SGLang `register_session_ref`)."""
        if chain.key in self._closed:
            self.late_finishes += 1
            return
        group = chain.group
        assert group is not None
        self.references_taken += 1
        if not chain.session_refs:
            chain.session_refs = 1
            group.session_refs += 1
            self._push(group)
        chain.ref_segments = len(chain.segments)
        self._push(chain)

    def _dereference(self, chain: Chain) -> None:
        group = chain.group
        assert group is not None
        chain.session_refs, chain.ref_segments = 0, 0
        group.session_refs -= 1
        self._push(chain)
        self._push(group)

    def _recede(self, node: Chain) -> None:
        """After `node` lost segments to no tier: its session coverage shrinks to what is left; a group gone
        ends the references of the sessions below it."""
        if node.group is not None:
            node.ref_segments = min(node.ref_segments, node.device_count + node.host_count)
            return
        if node.is_resident or not node.session_refs:
            return
        for child in [child for child in node.children.values() if child.session_refs]:
            self._dereference(child)
            self._forget_if_gone(child)

    def hold(self, session_key: str, until_s: float) -> None:
        """Set when a held chain's hold expires (it must be held already)."""
        if session_key not in self._holds:
            raise CacheError(f"session {session_key!r} is not held")
        self._set_hold(session_key, until_s)

    def is_held(self, session_key: str) -> bool:
        """True while a session's chain is held between calls."""
        return session_key in self._holds

    def drop_hold(self, session_key: str) -> bool:
        """End a hold at once; True if the session held something (no-op otherwise)."""
        if self._holds.pop(session_key, None) is None:
            return False
        self._unpin_hold(session_key)
        return True

    def expire_holds(self, now: float, keep: Callable[[str], bool] | None = None) -> int:
        """Unpin every hold whose expiry is <= now, but those `keep` keeps (looked at again next time); return how
        many expired."""
        count = 0
        heap = self._hold_heap
        kept: list[tuple[float, str]] = []
        while heap and heap[0][0] <= now:
            until_s, key = heapq.heappop(heap)
            if self._holds.get(key) == until_s:
                if keep is not None and keep(key):
                    kept.append((until_s, key))
                    continue
                del self._holds[key]
                self._unpin_hold(key)
                count += 1
        for entry in kept:
            heapq.heappush(heap, entry)
        return count

    def _set_hold(self, session_key: str, until_s: float) -> None:
        self._holds[session_key] = until_s
        heapq.heappush(self._hold_heap, (until_s, session_key))
        if len(self._hold_heap) > 2 * len(self._holds) + MIN_HEAP_SLACK:  # expiry only reads the live holds
            self._hold_heap = [(t, key) for key, t in self._holds.items()]
            heapq.heapify(self._hold_heap)

    def _unpin_hold(self, session_key: str) -> None:
        chain = self._chains[session_key]
        self._unlock(chain)
        self._forget_if_gone(chain)

    # --- pinning and loading -----------------------------------------------------------------------

    def _group(self, key: str, tokens: int, session_key: str, prompt_tokens: int) -> Chain:
        """The group of a request (a new record if none), once the request is checked against it."""
        group = self._groups.get(key)
        if group is None and tokens <= 0:
            raise CacheError(f"group {key!r}: shared prefix must be > 0 tokens, got {tokens}")
        if group is not None and group.tokens != tokens:
            raise CacheError(f"group {key!r} has {group.tokens} shared tokens, not {tokens}")
        if prompt_tokens < tokens:
            raise CacheError(f"session {session_key!r}: prompt of {prompt_tokens} tokens is shorter than the "
                             f"shared prefix of group {key!r} ({tokens} tokens)")
        if group is None:
            group = self._groups[key] = Chain(key, None)
            group.segments.append(tokens)
            group.tokens = tokens
        return group

    def _forget_if_gone(self, node: Chain) -> None:
        """Drop the record of a chain neither cached nor pinned, then its group's if neither cached nor with chains."""
        group = node.group
        if group is not None:
            if node.is_resident or node.lock_ref > 0 or node.session_refs or self._chains.get(node.key) is not node:
                return
            del self._chains[node.key], group.children[node.key]
            node = group
        if not node.is_resident and not node.children and self._groups.get(node.key) is node:
            del self._groups[node.key]

    def _lock(self, chain: Chain) -> None:
        group = chain.group
        assert group is not None
        chain.lock_ref += 1
        if chain.lock_ref == 1:
            self.pinned_tokens += chain.device_tokens
            group.locked_children += 1
            if group.locked_children == 1:
                self.pinned_tokens += group.device_tokens

    def _unlock(self, chain: Chain) -> None:
        group = chain.group
        assert group is not None
        chain.lock_ref -= 1
        if chain.lock_ref == 0:
            self.pinned_tokens -= chain.device_tokens
            group.locked_children -= 1
            if group.locked_children == 0:
                self.pinned_tokens -= group.device_tokens
            self._push(chain)
            self._push(group)

    def _is_pinned(self, chain: Chain) -> bool:
        return chain.lock_ref > 0 if chain.group is not None else chain.locked_children > 0

    def _load_all(self, chain: Chain) -> None:
        """Put every segment of a pinned chain on the device (host ones loaded, missing ones computed)."""
        missing = chain.tokens - chain.device_tokens
        if missing == 0:
            return
        was_device, was_resident = chain.device_count > 0, chain.is_resident
        self.host_used_tokens -= chain.host_tokens
        self.device_used_tokens += missing
        self.pinned_tokens += missing
        chain.device_count, chain.host_count = len(chain.segments), 0
        chain.device_tokens, chain.host_tokens = chain.tokens, 0
        self._count_child(chain, was_device, was_resident)

    def _count_child(self, chain: Chain, was_device: bool, was_resident: bool) -> None:
        """Keep a group's child counters in step after `chain` changed tiers; push what became a leaf."""
        group = chain.group
        if group is None:
            return
        group.device_children += (chain.device_count > 0) - was_device
        group.resident_children += chain.is_resident - was_resident
        if group.device_children == 0 or group.resident_children == 0:
            self._push(group)

    def _touch(self, chain: Chain, now: float) -> None:
        for node in (chain, chain.group):
            assert node is not None
            node.last_access_s = now
            node.version += 1
            self._push(node)

    def _forget_segments(self, chain: Chain) -> None:
        was_device, was_resident = chain.device_count > 0, chain.is_resident
        chain.ref_segments = 0
        self.device_used_tokens -= chain.device_tokens
        self.host_used_tokens -= chain.host_tokens
        chain.segments, chain.tokens = [], 0
        chain.device_count = chain.host_count = chain.device_tokens = chain.host_tokens = 0
        self._count_child(chain, was_device, was_resident)

    # --- eviction ----------------------------------------------------------------------------------

    @staticmethod
    def _is_referenced(chain: Chain, on_device: bool) -> bool:
        """True when the segment eviction would take next (device or host) is covered by a session reference."""
        if chain.group is None:
            return chain.session_refs > 0
        deepest = chain.device_count if on_device else chain.device_count + chain.host_count
        return deepest <= chain.ref_segments

    def _push(self, chain: Chain) -> None:
        self._seq += 1
        if chain.is_device_leaf():
            heapq.heappush(self._device_heap, (self._is_referenced(chain, True), chain.last_access_s, self._seq,
                                               chain, chain.version))
        if chain.is_host_leaf():
            heapq.heappush(self._host_heap, (self._is_referenced(chain, False), chain.last_access_s, self._seq,
                                             chain, chain.version))

    def _pop_leaf(self, heap: list[_Entry], on_device: bool) -> Chain | None:
        while heap:
            referenced, _, _, chain, version = heapq.heappop(heap)
            is_leaf = chain.is_device_leaf() if on_device else chain.is_host_leaf()
            if version == chain.version and is_leaf and referenced == self._is_referenced(chain, on_device):
                return chain
        return None

    def _make_room(self, tokens: int) -> None:
        while self.capacity_tokens - self.device_used_tokens < tokens:
            chain = self._pop_leaf(self._device_heap, on_device=True)
            assert chain is not None, "unpinned device tokens must all be evictable"
            self._evict_device_segment(chain)
        self._compact()

    def _evict_device_segment(self, chain: Chain) -> None:
        index = chain.device_count - 1
        tokens = chain.segments[index]
        was_device, was_resident = True, True
        if self._is_referenced(chain, True):
            self.evicted_referenced_tokens += tokens
        self.device_used_tokens -= tokens
        self.evicted_tokens += tokens
        chain.device_tokens -= tokens
        if self.host_capacity_tokens and self._make_host_room(tokens):
            chain.device_count -= 1
            chain.host_count += 1
            chain.host_tokens += tokens
            self.host_used_tokens += tokens
        else:
            chain.device_count -= 1
            self._drop_host_below(chain)
        self._count_child(chain, was_device, was_resident)
        self._recede(chain)
        self._push(chain)
        self._forget_if_gone(chain)

    def _make_host_room(self, tokens: int) -> bool:
        if tokens > self.host_capacity_tokens:
            return False
        while self.host_capacity_tokens - self.host_used_tokens < tokens:
            chain = self._pop_leaf(self._host_heap, on_device=False)
            if chain is None:
                return False
            self._evict_host_segment(chain)
        return True

    def _evict_host_segment(self, chain: Chain) -> None:
        tokens = chain.segments[chain.device_count + chain.host_count - 1]
        was_device, was_resident = chain.device_count > 0, chain.is_resident
        chain.host_count -= 1
        chain.host_tokens -= tokens
        self.host_used_tokens -= tokens
        self._count_child(chain, was_device, was_resident)
        self._recede(chain)
        self._push(chain)
        self._forget_if_gone(chain)

    def _drop_host_below(self, chain: Chain) -> None:
        """A node dropped to nothing makes the host nodes below it unreachable: drop them too."""
        self.host_used_tokens -= chain.host_tokens
        chain.host_count, chain.host_tokens = 0, 0
        if chain.resident_children == 0:  # a group's resident children are all on the host by now
            return
        for child in [child for child in chain.children.values() if child.host_count]:
            was_resident = child.is_resident
            self._drop_host_below(child)
            self._count_child(child, child.device_count > 0, was_resident)
            self._recede(child)
            self._forget_if_gone(child)

    def _compact(self) -> None:
        """Rebuild a heap from the current leaves once stale and duplicate entries outnumber them (amortized O(1))."""
        limit = 2 * (len(self._groups) + len(self._chains)) + MIN_HEAP_SLACK
        if len(self._device_heap) > limit:
            self._device_heap = self._entries((node for node in self._records() if node.is_device_leaf()), True)
        if len(self._host_heap) > limit:
            self._host_heap = self._entries((node for node in self._records() if node.is_host_leaf()), False)

    def _records(self) -> Iterable[Chain]:
        yield from self._groups.values()
        yield from self._chains.values()

    def _entries(self, leaves: Iterable[Chain], on_device: bool) -> list[_Entry]:
        heap: list[_Entry] = []
        for node in leaves:
            self._seq += 1
            heap.append((self._is_referenced(node, on_device), node.last_access_s, self._seq, node, node.version))
        heapq.heapify(heap)
        return heap

    # --- checks ------------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert every invariant in the module comment (O(n): for tests)."""
        device = host = pinned = 0
        for node in [*self._groups.values(), *self._chains.values()]:
            assert node.device_count + node.host_count <= len(node.segments)
            assert node.device_tokens == sum(node.segments[:node.device_count])
            assert node.host_tokens == sum(node.segments[node.device_count:node.device_count + node.host_count])
            assert node.tokens == sum(node.segments)
            device, host = device + node.device_tokens, host + node.host_tokens
            if node.group is not None:
                assert node.lock_ref >= (node.key in self._holds)
            if self._is_pinned(node):
                pinned += node.device_tokens
            if node.group is not None:
                if node.device_count:
                    assert node.group.device_count == 1, f"{node.key}: device below a non-device group"
                if node.host_count:
                    assert node.group.is_resident, f"{node.key}: host below a dropped group"
        assert device == self.device_used_tokens <= self.capacity_tokens
        assert host == self.host_used_tokens <= self.host_capacity_tokens
        assert pinned == self.pinned_tokens
        for key, chain in self._chains.items():
            assert chain.group is not None and chain.group.children.get(key) is chain
            assert chain.is_resident or chain.lock_ref > 0 or chain.session_refs, \
                f"{key}: a record of a chain the cache no longer holds"
            assert chain.session_refs in (0, 1) and chain.ref_segments <= chain.device_count + chain.host_count
            assert chain.session_refs or not chain.ref_segments, f"{key}: coverage without a reference"
            assert not (chain.session_refs and key in self._closed), f"{key}: a closed session holds a reference"
        for key, group in self._groups.items():
            assert group.is_resident or group.children, f"{key}: a record of a group the cache no longer holds"
            assert all(self._chains.get(k) is c and c.group is group for k, c in group.children.items())
            assert group.device_children == sum(c.device_count > 0 for c in group.children.values())
            assert group.resident_children == sum(c.is_resident for c in group.children.values())
            assert group.locked_children == sum(c.lock_ref > 0 for c in group.children.values())
            assert group.session_refs == sum(c.session_refs for c in group.children.values())
            assert group.session_refs == 0 or group.is_resident, f"{key}: references on a group the cache dropped"

# A plain model of basin_sim/radix_cache.py's rules, for the differential tests: every segment has a
# tier ("device", "host", "none"), and every question (used tokens, pins, leaves, the LRU leaf) is
# answered by scanning all records, so nothing here shares a heap, a counter or a cache with the real
# one. Eviction picks the leaf with the oldest last access and asserts it is the only one: the model
# is only meant for traffic whose touches never tie (the real cache breaks ties by push order).
# Records are dropped as the real cache's rules say: a chain once neither cached nor pinned, a group
# once neither cached nor holding chains.
"""An O(n) reference model of the prefix cache (tiers per segment, LRU by scanning)."""

from __future__ import annotations

from dataclasses import dataclass, field

from basin_sim.radix_cache import Admission, CacheError, Hit

DEVICE, HOST, NONE = "device", "host", "none"


@dataclass(eq=False)
class Node:
    """A group (`group` is None) or a session chain: its segments, one tier each, and its pins."""

    key: str
    group: Node | None
    segments: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    last_access_s: float = 0.0
    pins: int = 0

    def tokens_on(self, tier: str) -> int:
        return sum(s for s, t in zip(self.segments, self.tiers, strict=True) if t == tier)

    def is_resident(self) -> bool:
        return any(t != NONE for t in self.tiers)


class ModelCache:
    """The cache's rules, written as directly as possible."""

    def __init__(self, capacity_tokens: int, host_capacity_tokens: int = 0) -> None:
        self.capacity_tokens = capacity_tokens
        self.host_capacity_tokens = host_capacity_tokens
        self.groups: dict[str, Node] = {}
        self.chains: dict[str, Node] = {}
        self.holds: dict[str, float] = {}
        self.evicted_tokens = 0
        self.loaded_back_tokens = 0

    # --- what the real cache exposes ------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        return [*self.groups.values(), *self.chains.values()]

    def children(self, group: Node) -> list[Node]:
        return [chain for chain in self.chains.values() if chain.group is group]

    def is_pinned(self, node: Node) -> bool:
        if node.group is not None:
            return node.pins > 0
        return any(child.pins > 0 for child in self.children(node))

    @property
    def device_used_tokens(self) -> int:
        return sum(node.tokens_on(DEVICE) for node in self.nodes())

    @property
    def host_used_tokens(self) -> int:
        return sum(node.tokens_on(HOST) for node in self.nodes())

    @property
    def pinned_tokens(self) -> int:
        return sum(node.tokens_on(DEVICE) for node in self.nodes() if self.is_pinned(node))

    def is_held(self, session_key: str) -> bool:
        return session_key in self.holds

    def lookup(self, session_key: str, group_key: str) -> Hit:
        group = self.groups.get(group_key)
        if group is None:
            return Hit(0, 0)
        parts = [group] + ([self.chains[session_key]] if session_key in self.chains else [])
        return Hit(sum(n.tokens_on(DEVICE) for n in parts), sum(n.tokens_on(HOST) for n in parts))

    # --- events ---------------------------------------------------------------------------------------

    def admit(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int,
              now: float) -> Admission | None:
        group = self.groups.get(group_key)
        if group is None and group_tokens <= 0:
            raise CacheError("a group's shared prefix must be > 0 tokens")
        if group is not None and sum(group.segments) != group_tokens:
            raise CacheError("a group's shared prefix changed")
        if prompt_tokens < group_tokens:
            raise CacheError("a prompt shorter than the shared prefix")
        if group is None:
            group = self.groups[group_key] = Node(group_key, None, [group_tokens], [NONE])
        chain = self.chains.get(session_key)
        if chain is None:
            chain = self.chains[session_key] = Node(session_key, group)
        elif session_key in self.holds:
            del self.holds[session_key]
            chain.pins -= 1
        if chain.pins > 0:
            raise CacheError("admitted twice at once")
        if prompt_tokens < group_tokens + sum(chain.segments):
            chain.segments, chain.tiers = [], []
        device_hit = group.tokens_on(DEVICE) + chain.tokens_on(DEVICE)
        host_hit = group.tokens_on(HOST) + chain.tokens_on(HOST)
        chain.pins += 1
        if self.capacity_tokens - self.pinned_tokens < prompt_tokens - device_hit:
            chain.pins -= 1
            self.forget_if_gone(chain)
            return None
        while self.capacity_tokens - self.device_used_tokens < prompt_tokens - device_hit:
            self.evict_device_segment()
        self.loaded_back_tokens += host_hit
        new_tokens = prompt_tokens - group_tokens - sum(chain.segments)
        if new_tokens > 0:
            chain.segments.append(new_tokens)
            chain.tiers.append(NONE)
        for node in (group, chain):
            node.tiers = [DEVICE] * len(node.segments)
            node.last_access_s = now
        computed = prompt_tokens - device_hit - host_hit
        if computed == 0:
            return Admission(device_hit, host_hit - 1, 1) if host_hit else Admission(device_hit - 1, 0, 1)
        return Admission(device_hit, host_hit, computed)

    def release(self, session_key: str, now: float, hold_until_s: float | None = None) -> None:
        chain = self.chains.get(session_key)
        if chain is None:
            raise CacheError("unknown session released")
        if chain.pins == 0 or session_key in self.holds:
            raise CacheError("released but not pinned by a request")
        assert chain.group is not None
        chain.last_access_s = chain.group.last_access_s = now
        if hold_until_s is None:
            self.unpin(chain)
        else:
            self.holds[session_key] = hold_until_s

    def hold(self, session_key: str, until_s: float) -> None:
        if session_key not in self.holds:
            raise CacheError("not held")
        self.holds[session_key] = until_s

    def drop_hold(self, session_key: str) -> None:
        if self.holds.pop(session_key, None) is not None:
            self.unpin(self.chains[session_key])

    def expire_holds(self, now: float) -> int:
        due = [key for key, until_s in self.holds.items() if until_s <= now]
        for key in due:
            del self.holds[key]
            self.unpin(self.chains[key])
        return len(due)

    # --- eviction -------------------------------------------------------------------------------------

    def unpin(self, chain: Node) -> None:
        chain.pins -= 1
        self.forget_if_gone(chain)

    def forget_if_gone(self, node: Node) -> None:
        if node.group is not None and not node.is_resident() and node.pins == 0:
            del self.chains[node.key]
            node = node.group
        if node.group is None and not node.is_resident() and not self.children(node) \
                and self.groups.get(node.key) is node:
            del self.groups[node.key]

    def is_device_leaf(self, node: Node) -> bool:
        if DEVICE not in node.tiers or self.is_pinned(node):
            return False
        return node.group is not None or all(DEVICE not in c.tiers for c in self.children(node))

    def is_host_leaf(self, node: Node) -> bool:
        if HOST not in node.tiers or self.is_pinned(node):
            return False
        return node.group is not None or not any(c.is_resident() for c in self.children(node))

    @staticmethod
    def least_recent(leaves: list[Node]) -> Node:
        oldest = min(leaves, key=lambda n: n.last_access_s)
        assert sum(n.last_access_s == oldest.last_access_s for n in leaves) == 1, "a tie: the model cannot say"
        return oldest

    def evict_device_segment(self) -> None:
        leaves = [node for node in self.nodes() if self.is_device_leaf(node)]
        assert leaves, "unpinned device tokens must all be evictable"
        node = self.least_recent(leaves)
        index = max(i for i, tier in enumerate(node.tiers) if tier == DEVICE)
        tokens = node.segments[index]
        self.evicted_tokens += tokens
        if self.host_capacity_tokens and self.make_host_room(tokens):
            node.tiers[index] = HOST
        else:
            below = [node] if node.group is not None else [node, *self.children(node)]
            node.tiers[index] = NONE
            for other in below:
                other.tiers = [NONE if tier == HOST else tier for tier in other.tiers]
            for other in reversed(below):  # the chains first, then their group
                self.forget_if_gone(other)

    def make_host_room(self, tokens: int) -> bool:
        if tokens > self.host_capacity_tokens:
            return False
        while self.host_capacity_tokens - self.host_used_tokens < tokens:
            leaves = [node for node in self.nodes() if self.is_host_leaf(node)]
            if not leaves:
                return False
            node = self.least_recent(leaves)
            index = max(i for i, tier in enumerate(node.tiers) if tier == HOST)
            node.tiers[index] = NONE
            self.forget_if_gone(node)
        return True

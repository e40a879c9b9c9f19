# Routing of one request to a (prefill, decode) pair, as a cache-aware PD router does at arrival.
#
# Rules:
# - Prefill: the instance whose cache holds the longest prefix of the session (device + host) when
#   that prefix covers at least `cache_threshold` of the prompt; otherwise (a new session, or every
#   copy evicted) the least loaded instance by queued prompt tokens. Ties go to the lowest index.
# - Decode: the instance with the fewest committed tokens (reserved + queued for reservation).
# The router keeps no state: the same instances give the same answer.
"""Cache-aware prefill routing and least-committed decode routing."""

from __future__ import annotations

from collections.abc import Sequence

from basin_sim.decode import DecodeInstance
from basin_sim.prefill import PrefillInstance

CACHE_THRESHOLD = 0.5  # share of the prompt a cached prefix must cover to win the routing


def route_prefill(instances: Sequence[PrefillInstance], session_key: str, group_key: str,
                  prompt_tokens: int) -> PrefillInstance:
    """The prefill instance for a request of `session_key` with this prompt."""
    if len(instances) == 1:
        return instances[0]
    best = max(instances, key=lambda p: (p.cache.lookup(session_key, group_key).tokens, -p.index))
    if best.cache.lookup(session_key, group_key).tokens >= CACHE_THRESHOLD * prompt_tokens:
        return best
    return min(instances, key=lambda p: (p.waiting_tokens, p.index))


def route_decode(instances: Sequence[DecodeInstance]) -> DecodeInstance:
    """The decode instance with the most room once committed work is counted."""
    return min(instances, key=lambda d: (d.committed_tokens, d.index))

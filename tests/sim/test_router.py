"""Routing: a session goes back to the prefill instance holding its prefix; new ones to the least loaded."""

from __future__ import annotations

from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.radix_cache import RadixCache
from basin_sim.router import route_decode, route_prefill
from tests.sim.builders import TINY


def test_cache_aware_prefill_routing_and_least_committed_decode_routing() -> None:
    prefill = [PrefillInstance(i, TINY, RadixCache(100_000)) for i in range(3)]
    prefill[2].cache.admit("a", "bench", 500, 4_000, 1.0)
    prefill[2].cache.release("a", 1.0)
    assert route_prefill(prefill, "a", "bench", 5_000) is prefill[2]  # holds 4000 of 5000 >= half
    assert route_prefill(prefill, "a", "bench", 9_000) is prefill[0]  # 4000 < half of 9000: least loaded
    prefill[0].enqueue(PrefillJob(0.0, 1, "x", "bench", 500, 3_000))
    assert route_prefill(prefill, "new", "bench", 3_000) is prefill[1]  # no useful prefix: 0 queued, lowest index
    assert route_prefill(prefill, "new", "bench", 1_000) is prefill[2]  # its cached system prompt is half of it
    decode = [DecodeInstance(i, TINY, 10_000, 0.05) for i in range(2)]
    decode[0].enqueue(DecodeSlot(0.0, 1_000, 10, 2_000, request_id=1))
    assert route_decode(decode) is decode[1]

"""The prefix cache: hits on resent conversations, LRU eviction of unpinned leaves, the host tier."""

from __future__ import annotations

import math
import random

import pytest

from basin_sim.radix_cache import MIN_HEAP_SLACK, Admission, CacheError, Hit, RadixCache

GROUP = "bench"
SHARED = 1_000


def serve(cache: RadixCache, session: str, prompt: int, now: float) -> Admission:
    """One request: admitted (must fit), then released, as prefill then KV transfer would."""
    admission = cache.admit(session, GROUP, SHARED, prompt, now)
    assert admission is not None
    cache.release(session, now)
    cache.check()
    return admission


def test_a_resent_longer_conversation_hits_its_previous_prompt() -> None:
    cache = RadixCache(100_000)
    assert serve(cache, "a", 5_000, 1.0) == Admission(0, 0, 5_000)
    assert serve(cache, "a", 7_000, 2.0) == Admission(5_000, 0, 2_000)  # call 2 extends call 1
    assert serve(cache, "b", 3_000, 3.0) == Admission(SHARED, 0, 2_000)  # another session: system prompt only
    assert cache.lookup("a", GROUP) == Hit(7_000, 0)
    assert cache.device_used_tokens == 7_000 + 2_000


def test_a_full_hit_still_computes_one_token() -> None:
    cache = RadixCache(100_000)
    serve(cache, "a", 5_000, 1.0)
    assert serve(cache, "a", 5_000, 2.0) == Admission(4_999, 0, 1)


def test_a_rewritten_conversation_starts_over() -> None:
    cache = RadixCache(100_000)
    serve(cache, "a", 5_000, 1.0)
    assert serve(cache, "a", 4_000, 2.0) == Admission(SHARED, 0, 3_000)  # no longer extends: shared part only
    assert cache.device_used_tokens == 4_000


def test_eviction_takes_unreferenced_leaves_in_lru_order() -> None:
    cache = RadixCache(10_000)
    serve(cache, "old", 2_000, 1.0)
    serve(cache, "old", 3_000, 2.0)  # segments: 1000 (call 1) + 1000 (call 2), last used at t=2
    serve(cache, "mid", 3_000, 3.0)
    serve(cache, "new", 3_000, 4.0)
    assert cache.device_used_tokens == 1_000 + 3 * 2_000
    serve(cache, "next", 4_000, 5.0)  # needs 3000, 3000 free: nothing evicted
    assert cache.evicted_tokens == 0
    serve(cache, "next2", 2_000, 6.0)  # needs 1000: the LRU leaf is the tip of "old"
    assert cache.lookup("old", GROUP) == Hit(2_000, 0)
    assert cache.lookup("mid", GROUP) == Hit(3_000, 0)
    serve(cache, "next3", 3_000, 7.0)  # needs 2000: old's last segment (1000), then mid's tip (2000)
    assert cache.lookup("old", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("mid", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("new", GROUP) == Hit(3_000, 0)
    assert cache.evicted_tokens == 1_000 + 1_000 + 2_000


def test_a_hit_refreshes_recency() -> None:
    cache = RadixCache(7_000)
    serve(cache, "a", 3_000, 1.0)
    serve(cache, "b", 3_000, 2.0)
    serve(cache, "a", 3_000, 3.0)  # a is now the most recent
    serve(cache, "c", 3_000, 4.0)  # needs 2000, 2000 free
    serve(cache, "d", 2_000, 5.0)  # needs 1000: b is the LRU chain
    assert cache.lookup("b", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("a", GROUP) == Hit(3_000, 0)


def test_pinned_chains_are_never_evicted_and_a_request_that_cannot_fit_changes_nothing() -> None:
    cache = RadixCache(6_000)
    assert cache.admit("a", GROUP, SHARED, 3_000, 1.0) is not None  # pinned: not released
    assert cache.admit("b", GROUP, SHARED, 3_000, 2.0) is not None
    cache.check()
    assert cache.pinned_tokens == 5_000 and cache.evictable_tokens == 0
    before = (cache.device_used_tokens, cache.pinned_tokens, cache.lookup("c", GROUP))
    assert cache.admit("c", GROUP, SHARED, 3_000, 3.0) is None  # needs 2000, only 1000 free, nothing evictable
    assert (cache.device_used_tokens, cache.pinned_tokens, cache.lookup("c", GROUP)) == before
    cache.release("a", 4.0)
    assert cache.admit("c", GROUP, SHARED, 3_000, 5.0) is not None  # now a's 2000 can go
    assert cache.lookup("a", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("b", GROUP) == Hit(3_000, 0)
    cache.check()


def test_the_shared_prefix_outlives_its_sessions_and_goes_once_none_is_on_the_device() -> None:
    cache = RadixCache(4_000)
    serve(cache, "a", 2_500, 1.0)
    serve(cache, "b", 2_500, 2.0)  # same group: 1000 shared + 1500 + 1500
    assert cache.device_used_tokens == 4_000
    admission = cache.admit("x", "other-bench", 500, 3_000, 3.0)  # needs 3000: both chains go, the group stays
    assert admission == Admission(0, 0, 3_000)
    cache.release("x", 3.0)
    cache.check()
    assert cache.lookup("a", GROUP) == Hit(SHARED, 0) == cache.lookup("b", GROUP)
    admission = cache.admit("y", "other-bench", 500, 3_500, 4.0)  # needs 3000: the LRU leaf is now the group
    assert admission == Admission(500, 0, 3_000)
    cache.check()
    assert cache.lookup("a", GROUP) == Hit(0, 0)
    assert cache.lookup("x", "other-bench") == Hit(500, 0)  # x's 2500 went too: 1000 was not enough


def test_host_tier_keeps_evicted_tokens_and_a_hit_there_is_loaded_back() -> None:
    cache = RadixCache(5_000, host_capacity_tokens=10_000)
    serve(cache, "a", 4_000, 1.0)
    serve(cache, "b", 4_000, 2.0)  # evicts a's 3000 private tokens to the host
    assert cache.lookup("a", GROUP) == Hit(SHARED, 3_000)
    assert cache.host_used_tokens == 3_000
    admission = serve(cache, "a", 4_500, 3.0)
    assert admission == Admission(SHARED, 3_000, 500)  # 3000 loaded back, only the new 500 computed
    assert cache.loaded_back_tokens == 3_000
    assert cache.lookup("b", GROUP) == Hit(SHARED, 3_000)  # b moved to the host to make room


def test_host_tier_evicts_its_own_lru_leaves_when_full() -> None:
    cache = RadixCache(4_000, host_capacity_tokens=2_500)
    serve(cache, "a", 3_000, 1.0)
    serve(cache, "b", 3_000, 2.0)  # a (2000) -> host
    serve(cache, "c", 3_000, 3.0)  # b (2000) -> host, which must drop a first
    assert cache.lookup("a", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("b", GROUP) == Hit(SHARED, 2_000)
    assert cache.host_used_tokens == 2_000


def test_bad_requests_raise() -> None:
    cache = RadixCache(10_000)
    with pytest.raises(CacheError, match="shorter than the shared prefix"):
        cache.admit("a", GROUP, SHARED, 500, 1.0)
    cache.admit("a", GROUP, SHARED, 2_000, 1.0)
    with pytest.raises(CacheError, match="admitted twice"):
        cache.admit("a", GROUP, SHARED, 3_000, 2.0)
    cache.release("a", 2.0)
    with pytest.raises(CacheError, match="not pinned"):
        cache.release("a", 3.0)
    with pytest.raises(CacheError, match="unknown session"):
        cache.release("never-seen", 3.0)


@pytest.mark.parametrize("host", [0, 6_000])
def test_random_traffic_keeps_every_invariant(host: int) -> None:
    rng = random.Random(host)
    cache = RadixCache(12_000, host)
    prompts: dict[str, int] = {}
    pinned: set[str] = set()
    for step in range(3_000):
        now = float(step)
        session = f"s{rng.randrange(12)}"
        if session in pinned:
            cache.release(session, now)
            pinned.discard(session)
        else:
            group = f"g{int(session[1:]) % 2}"
            prompt = max(prompts.get(session, 0) + rng.randrange(0, 1_500), 800)
            if rng.random() < 0.05:
                prompt = 800 + rng.randrange(2_000)  # a rewritten conversation
            hit_before = cache.lookup(session, group)
            admission = cache.admit(session, group, 700, prompt, now)
            if admission is not None:
                assert admission.device_hit_tokens + admission.host_hit_tokens + admission.computed_tokens == prompt
                if prompt >= prompts.get(session, 0):
                    assert admission.device_hit_tokens + admission.host_hit_tokens >= min(hit_before.tokens, prompt - 1)
                prompts[session] = prompt
                pinned.add(session)
        cache.check()


# --- records: kept while something of a chain is cached or pinned, dropped after --------------------------


def private_tokens(cache: RadixCache, session: str) -> int:
    """A session's cached tokens past the shared prefix (device and host)."""
    return cache.lookup(session, GROUP).tokens - cache.lookup("nobody", GROUP).tokens


def test_an_ended_sessions_kv_stays_until_lru_eviction_and_then_its_record_goes() -> None:
    cache = RadixCache(10_000)
    serve(cache, "a", 3_000, 1.0)  # a's last call: nothing tells the cache
    serve(cache, "b", 4_000, 2.0)
    serve(cache, "c", 5_000, 3.0)  # the cache is full, nothing evicted
    assert cache.lookup("a", GROUP) == Hit(3_000, 0) and cache.has_chain("a") and cache.num_chains == 3
    serve(cache, "d", 2_000, 4.0)  # needs 1000: a is the LRU chain, all 2000 of it go (one node)
    assert cache.lookup("a", GROUP) == Hit(SHARED, 0)
    assert not cache.has_chain("a") and cache.num_chains == 3 and cache.num_groups == 1


def test_a_hosted_chain_keeps_its_record_until_the_host_drops_it_too() -> None:
    cache = RadixCache(4_000, host_capacity_tokens=2_500)
    serve(cache, "a", 3_000, 1.0)
    serve(cache, "b", 3_000, 2.0)  # a (2000) -> host: still cached, still recorded
    assert cache.lookup("a", GROUP) == Hit(SHARED, 2_000) and cache.has_chain("a")
    serve(cache, "c", 3_000, 3.0)  # b -> host, which drops a
    assert not cache.has_chain("a") and cache.has_chain("b") and cache.num_chains == 2


def test_a_pinned_or_held_chain_keeps_its_record_even_with_nothing_cached() -> None:
    cache = RadixCache(10_000)
    assert cache.admit("a", GROUP, SHARED, SHARED, 1.0) == Admission(0, 0, SHARED)  # the prompt is the group
    assert cache.has_chain("a")
    cache.release("a", 2.0, hold_until_s=5.0)
    assert cache.has_chain("a") and cache.is_held("a")
    assert cache.expire_holds(5.0) == 1
    assert not cache.has_chain("a") and cache.num_chains == 0 and cache.num_groups == 1  # the group is cached


def test_a_refused_request_leaves_no_record() -> None:
    cache = RadixCache(6_000)
    assert cache.admit("a", GROUP, SHARED, 5_000, 1.0) is not None  # pinned
    assert cache.admit("b", "other", 500, 3_000, 2.0) is None  # no room
    with pytest.raises(CacheError, match="shorter than the shared prefix"):
        cache.admit("c", "third", 800, 700, 3.0)
    assert (cache.num_chains, cache.num_groups) == (1, 1)
    cache.check()


def test_a_group_record_goes_with_its_last_chain_once_it_is_evicted() -> None:
    cache = RadixCache(4_000)
    serve(cache, "a", 2_500, 1.0)
    assert cache.admit("x", "other-bench", 500, 3_500, 2.0) == Admission(0, 0, 3_500)  # a's chain, then its group
    cache.release("x", 2.0)
    cache.check()
    assert cache.lookup("a", GROUP) == Hit(0, 0)
    assert (cache.num_chains, cache.num_groups) == (1, 1) and not cache.has_chain("a")


def test_a_session_whose_chain_went_comes_back_as_one_new_node() -> None:
    cache = RadixCache(6_000)
    serve(cache, "a", 2_000, 1.0)
    serve(cache, "a", 3_000, 2.0)  # a: 1000 + 1000
    serve(cache, "b", 3_000, 3.0)
    serve(cache, "c", 3_000, 4.0)  # needs 2000: a's tip goes
    serve(cache, "d", 2_000, 5.0)  # needs 1000: the rest of a goes, and its record
    assert not cache.has_chain("a")
    assert serve(cache, "a", 4_000, 6.0) == Admission(SHARED, 0, 3_000)  # b and c make room
    serve(cache, "d", 2_000, 7.0)  # a is now the LRU chain
    serve(cache, "e", 2_001, 8.0)  # needs one token more than is free: a's 3000 go at once, one node as in SGLang
    assert cache.lookup("a", GROUP) == Hit(SHARED, 0)
    assert cache.lookup("d", GROUP) == Hit(2_000, 0)


@pytest.mark.parametrize("host", [0, 30_000])
def test_records_follow_what_the_cache_holds_over_many_ended_sessions(host: int) -> None:
    cache = RadixCache(20_000, host)
    sessions = [f"s{i}" for i in range(2_000)]
    for i, session in enumerate(sessions):  # every session makes two calls and ends
        serve(cache, session, 2_000 + i % 7 * 100, 2.0 * i)
        serve(cache, session, 3_000 + i % 7 * 100, 2.0 * i + 1)
    cached = [s for s in sessions if private_tokens(cache, s) > 0]
    assert 0 < len(cached) < 60 and cache.num_chains == len(cached) and cache.num_groups == 1
    assert cache.num_heap_entries <= 3 * (2 * (cache.num_chains + 1) + MIN_HEAP_SLACK)


def test_repeated_hits_and_holds_keep_the_heaps_bounded() -> None:
    cache = RadixCache(100_000)
    bound = 3 * (2 * 2 + MIN_HEAP_SLACK)  # two eviction heaps and the hold heap, for one chain and its group
    for call in range(3_000):  # hits only: nothing is ever evicted, so nothing is popped
        now = 10.0 * call
        assert cache.admit("a", GROUP, SHARED, 2_000 + call, now) is not None
        cache.release("a", now, hold_until_s=math.inf if call % 2 else None)
        if cache.is_held("a"):
            cache.hold("a", now + 5.0)
        assert cache.num_heap_entries <= bound
    cache.check()

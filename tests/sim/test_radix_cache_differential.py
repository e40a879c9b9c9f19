"""The prefix cache against two references, over random traffic, after every step.

- `ModelMachine` / `test_long_traffic_matches_the_model`: against `radix_model.ModelCache`, a plain model
  that scans every record (independent of heaps and counters), with touches that never tie (time moves
  on every step). Sessions come back after their chain went, so dropping records is exercised, and the
  record counts must match the model's: a record kept for a chain the cache no longer holds fails. The
  long run also goes past heap rebuilds and checks that the heaps stay bounded by the records.
- `V1Machine`: against the cache as it was before records were dropped (`radix_cache_v1`, frozen), with
  many touches at the same time, so ties are broken by push order in both. A session whose chain went
  is not used again (the one place the two differ on purpose: v1 kept the old chain's segment
  boundaries for it), and the run stays below the heap rebuild threshold (v1 rebuilt its heaps later,
  counting every record it ever made).
Both compare the call's result (or that both raised `CacheError`: an illegal step changes nothing in
either) and the whole observable state: used, pinned, evicted and loaded-back tokens, every session's
hit and hold.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from basin_sim.radix_cache import MIN_HEAP_SLACK, Admission, CacheError, Hit, RadixCache
from tests.sim import radix_cache_v1
from tests.sim.radix_cache_v1 import RadixCache as RadixCacheV1
from tests.sim.radix_model import ModelCache

GROUP_TOKENS = (300, 500, 700)
NUM_SESSIONS = 8
MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None, database=None)


class CacheLike(Protocol):
    """What the tests read and call on the cache and on both references."""

    @property
    def device_used_tokens(self) -> int: ...
    @property
    def host_used_tokens(self) -> int: ...
    @property
    def pinned_tokens(self) -> int: ...
    @property
    def evicted_tokens(self) -> int: ...
    @property
    def loaded_back_tokens(self) -> int: ...
    def lookup(self, session_key: str, group_key: str) -> Hit | radix_cache_v1.Hit: ...
    def is_held(self, session_key: str) -> bool: ...
    def admit(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int,
              now: float) -> Admission | radix_cache_v1.Admission | None: ...
    def release(self, session_key: str, now: float, hold_until_s: float | None = None) -> None: ...
    def hold(self, session_key: str, until_s: float) -> None: ...
    def drop_hold(self, session_key: str) -> None: ...
    def expire_holds(self, now: float) -> int: ...


Op = tuple[str, str, float, int, float | None]  # (kind, session, now, prompt tokens, hold until)


def group_of(session: str) -> str:
    """Session "s<i>" (or "s<i>.<generation>") is in group "g<i mod number of groups>"."""
    return f"g{int(session[1:].split('.')[0]) % len(GROUP_TOKENS)}"


def apply(cache: CacheLike, op: Op) -> object:
    """Run one step; its result (an admission as a tuple), or "CacheError" if it raised one."""
    kind, session, now, prompt, until_s = op
    group = group_of(session)
    try:
        if kind == "admit":
            admission = cache.admit(session, group, GROUP_TOKENS[int(group[1:])], prompt, now)
            return None if admission is None else (admission.device_hit_tokens, admission.host_hit_tokens,
                                                   admission.computed_tokens)
        if kind == "expire":
            return cache.expire_holds(now)
        if kind == "release":
            cache.release(session, now, until_s)
        elif kind == "hold":
            assert until_s is not None
            cache.hold(session, until_s)
        else:
            assert kind == "drop_hold"
            cache.drop_hold(session)
        return None
    except (CacheError, radix_cache_v1.CacheError):
        return "CacheError"


def hit_of(cache: CacheLike, session: str) -> tuple[int, int]:
    """(device, host) tokens the session's next prompt would hit."""
    hit = cache.lookup(session, group_of(session))
    return hit.device_tokens, hit.host_tokens


def observed(cache: CacheLike, sessions: set[str]) -> dict[str, object]:
    """Everything a caller can see of a cache, for the sessions seen so far."""
    return {"device": cache.device_used_tokens, "host": cache.host_used_tokens, "pinned": cache.pinned_tokens,
            "evicted": cache.evicted_tokens, "loaded_back": cache.loaded_back_tokens,
            "hits": {s: hit_of(cache, s) for s in sorted(sessions)},
            "held": sorted(s for s in sessions if cache.is_held(s))}


class Traffic:
    """Random steps of a few sessions: growing prompts, rewrites, releases with or without holds, expiries."""

    def __init__(self, is_tied: bool, is_retiring: bool) -> None:
        self.now = 0.0
        self.is_tied = is_tied  # time may stand still between steps (when tied: 9 steps in 10)
        self.is_retiring = is_retiring  # a session whose chain went continues under a new key
        self.generations = [0] * NUM_SESSIONS
        self.prompts: dict[str, int] = {}  # per key: the last prompt admitted
        self.seen: set[str] = set()

    def key(self, index: int) -> str:
        generation = self.generations[index]
        return f"s{index}" if generation == 0 else f"s{index}.{generation}"

    def step(self, kind: str, index: int, amount: int, flag: int, is_same_time: bool) -> Op:
        """The next step (`amount`, `flag` drawn by the caller: a prompt growth or TTL, and a variant)."""
        if not (self.is_tied and is_same_time):
            self.now += 1
        key = self.key(index)
        self.seen.add(key)
        if kind == "admit":
            base = self.prompts.get(key, GROUP_TOKENS[index % len(GROUP_TOKENS)])
            prompt = base + amount
            if flag % 10 == 0:  # a rewritten conversation
                prompt = GROUP_TOKENS[index % len(GROUP_TOKENS)] + amount // 3
            elif flag % 29 == 1:  # shorter than the shared prefix: refused
                prompt = GROUP_TOKENS[index % len(GROUP_TOKENS)] - 1
            return ("admit", key, self.now, prompt, None)
        if kind == "release":
            until_s = (None, self.now + amount % 7, math.inf)[flag % 3]
            return ("release", key, self.now, 0, until_s)
        if kind == "hold":
            return ("hold", key, self.now, 0, self.now + amount % 7)
        return (kind, key, self.now, 0, None)

    def after(self, op: Op, result: object, cache: RadixCache) -> None:
        """Note an admitted prompt; retire the keys whose chain went (when retiring)."""
        if op[0] == "admit" and isinstance(result, tuple):
            self.prompts[op[1]] = op[3]
        if self.is_retiring:
            for index in range(NUM_SESSIONS):
                key = self.key(index)
                if key in self.prompts and not cache.has_chain(key):
                    self.generations[index] += 1


class Pair:
    """The cache and a reference, stepped together and compared after every step."""

    def __init__(self, capacity_tokens: int, host_tokens: int, reference: CacheLike, traffic: Traffic) -> None:
        self.cache = RadixCache(capacity_tokens, host_tokens)
        self.reference = reference
        self.traffic = traffic

    def run(self, op: Op) -> None:
        result = apply(self.cache, op)
        assert result == apply(self.reference, op), op
        self.traffic.after(op, result, self.cache)
        self.cache.check()
        assert observed(self.cache, self.traffic.seen) == observed(self.reference, self.traffic.seen), op
        if isinstance(self.reference, ModelCache):
            assert (self.cache.num_chains, self.cache.num_groups) == (len(self.reference.chains),
                                                                      len(self.reference.groups)), op


KINDS = ("admit", "admit", "admit", "release", "release", "hold", "drop_hold", "expire")
CAPACITIES = st.sampled_from([2_500, 4_000, 8_000])
HOSTS = st.sampled_from([0, 1_500, 6_000])


class _Machine(RuleBasedStateMachine):
    is_tied = False
    pair: Pair

    def make_reference(self, capacity_tokens: int, host_tokens: int) -> CacheLike:
        raise NotImplementedError

    @initialize(capacity_tokens=CAPACITIES, host_tokens=HOSTS)
    def setup(self, capacity_tokens: int, host_tokens: int) -> None:
        traffic = Traffic(is_tied=self.is_tied, is_retiring=self.is_tied)
        self.pair = Pair(capacity_tokens, host_tokens, self.make_reference(capacity_tokens, host_tokens), traffic)

    @rule(kind=st.sampled_from(KINDS), index=st.integers(0, NUM_SESSIONS - 1), amount=st.integers(0, 2_500),
          flag=st.integers(0, 99), time_roll=st.integers(0, 9))
    def step(self, kind: str, index: int, amount: int, flag: int, time_roll: int) -> None:
        self.pair.run(self.pair.traffic.step(kind, index, amount, flag, is_same_time=time_roll > 0))

    @invariant()
    def heaps_stay_small(self) -> None:
        assert_heaps_bounded(self.pair)


class ModelMachine(_Machine):
    """Against the scanning model, touches never tied."""

    def make_reference(self, capacity_tokens: int, host_tokens: int) -> CacheLike:
        return ModelCache(capacity_tokens, host_tokens)


class V1Machine(_Machine):
    """Against the frozen pre-change cache, with ties."""

    is_tied = True

    def make_reference(self, capacity_tokens: int, host_tokens: int) -> CacheLike:
        return RadixCacheV1(capacity_tokens, host_tokens)


TestAgainstModel = pytest.mark.integration(ModelMachine.TestCase)
TestAgainstModel.settings = MACHINE_SETTINGS
TestAgainstV1 = pytest.mark.integration(V1Machine.TestCase)
TestAgainstV1.settings = MACHINE_SETTINGS


def assert_heaps_bounded(pair: Pair) -> None:
    """Heaps are rebuilt before stale entries pile up; with ties, never rebuilt (v1 would rebuild later)."""
    cache = pair.cache
    if pair.traffic.is_tied:
        assert cache.num_heap_entries <= MIN_HEAP_SLACK
    else:  # two eviction heaps and the hold heap, each at most 2 x records + slack, plus one step's pushes
        assert cache.num_heap_entries <= 3 * (2 * (cache.num_chains + cache.num_groups) + MIN_HEAP_SLACK) + 16


def run_seeded(pair: Pair, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        pair.run(pair.traffic.step(rng.choice(KINDS), rng.randrange(NUM_SESSIONS), rng.randrange(2_500),
                                   rng.randrange(100), is_same_time=rng.random() < 0.9))
        assert_heaps_bounded(pair)


SIZES = [(4_000, 0), (6_000, 1_500), (8_000, 6_000)]


def test_long_traffic_matches_the_model() -> None:
    for seed, (capacity, host) in enumerate(SIZES):
        pair = Pair(capacity, host, ModelCache(capacity, host), Traffic(is_tied=False, is_retiring=False))
        run_seeded(pair, seed, 4_000)


def test_tied_traffic_matches_the_pre_change_cache() -> None:
    for seed in range(30):  # short runs: below the heap rebuild threshold
        capacity, host = SIZES[seed % len(SIZES)]
        pair = Pair(capacity, host, RadixCacheV1(capacity, host), Traffic(is_tied=True, is_retiring=True))
        run_seeded(pair, seed, 150)

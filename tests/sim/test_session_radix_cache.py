"""SGLang's session-aware radix cache (`session_radix_cache`, field-sources.md section 2) in the prefill cache.

- Unit: unreferenced leaves go before referenced ones, LRU within each; referenced KV still goes under
  pressure; one reference per session per path; a close dereferences (KV kept); a late finish after the
  close takes no reference; an abort takes none.
- Differential: with the key off, finishes and closes change nothing (against the plain model of the old
  cache); with it on, against `SessionModel`, the plain model with references and the two-partition order.
- Engine: under `sglang`, the key off gives the golden run unchanged (no `session_cache` in the JSON);
  "faithful" takes no reference (inert under PD, as SGLang's prefill code); true takes references,
  closes every session at its end and keeps a reused prefix that plain LRU evicts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from basin_sim.catalog import CatalogError, load_deployment
from basin_sim.engine import Engine
from basin_sim.experiments.calibrate.rates import overload_shape, rate_key
from basin_sim.experiments.cli import main
from basin_sim.policies import FcfsPolicy
from basin_sim.profile import Deployment, ProfileError
from basin_sim.radix_cache import Admission, CacheError, RadixCache
from tests.sim.builders import deployment, seeded_files, session, spec
from tests.sim.radix_model import DEVICE, HOST, NONE, ModelCache, Node
from tests.sim.test_cli import DEPLOYMENT as CLI_DEPLOYMENT
from tests.sim.test_cli import RATE, SCENARIO
from tests.sim.test_engine_golden import CELLS, POOL, golden
from tests.sim.test_radix_cache_differential import (
    KINDS,
    NUM_SESSIONS,
    SIZES,
    Op,
    Traffic,
    apply,
    observed,
)

GROUP = "g"


def admit(cache: RadixCache, key: str, prompt: int, now: float) -> None:
    assert cache.admit(key, GROUP, 100, prompt, now) is not None


def gone(cache: RadixCache, keys: str) -> set[str]:
    """Which of these one-segment sessions (100 tokens past the group) have lost their segment."""
    return {k for k in keys if cache.lookup(k, GROUP).device_tokens < 200}


# --- unit ----------------------------------------------------------------------------------------------

def filled() -> RadixCache:
    """A full 600-token cache: group (100) + a..e (100 each); a, c referenced (finished), b, d, e not (aborted)."""
    cache = RadixCache(600, session_refs=True)
    for now, (key, finished) in enumerate([("a", True), ("b", False), ("c", True), ("d", False), ("e", False)], 1):
        admit(cache, key, 200, now)
        cache.release(key, now + 0.5, finished=finished)
    cache.check()
    return cache


def test_unreferenced_go_first_in_lru_order_then_referenced_in_lru_order() -> None:
    cache = filled()
    order = []
    for now, key in enumerate("vwxyz", 10):  # each admission evicts exactly one 100-token leaf, and stays pinned
        before = gone(cache, "abcde")
        admit(cache, key, 200, now)
        order.extend(gone(cache, "abcde") - before)
        cache.check()
    assert order == ["b", "d", "e", "a", "c"]  # plain LRU would take a, b, c, d, e
    assert cache.evicted_referenced_tokens == 200 and cache.evicted_tokens == 500


def test_plain_lru_when_off() -> None:
    cache = RadixCache(600)
    for now, key in enumerate("abcde", 1):
        admit(cache, key, 200, now)
        cache.release(key, now + 0.5, finished=True)  # finishes take nothing with references off
    order = []
    for now, key in enumerate("vwxyz", 10):
        before = gone(cache, "abcde")
        admit(cache, key, 200, now)
        order.extend(gone(cache, "abcde") - before)
    assert order == list("abcde") and cache.references_taken == 0 and cache.evicted_referenced_tokens == 0


def test_referenced_kv_is_still_evicted_under_pressure_but_pinned_never() -> None:
    cache = RadixCache(600, session_refs=True)
    admit(cache, "a", 300, 1)
    cache.release("a", 2, finished=True)
    admit(cache, "b", 300, 3)  # b stays pinned (in flight)
    admit(cache, "c", 400, 4)  # needs 300: a's referenced 200 go, b's pinned 200 never
    assert gone(cache, "a") == {"a"} and cache.lookup("b", GROUP).device_tokens == 300
    assert cache.admit("d", GROUP, 100, 300, 5) is None  # only pinned KV left: no room, nothing changed
    cache.check()


def test_one_reference_per_session_per_path() -> None:
    cache = RadixCache(10_000, session_refs=True)
    for now, prompt in enumerate([200, 300, 450], 1):  # three calls, each extending the last
        admit(cache, "a", prompt, now)
        cache.release("a", now + 0.5, finished=True)
    admit(cache, "b", 250, 5)
    cache.release("b", 5.5, finished=True)
    assert cache.references_taken == 4
    group = cache._groups[GROUP]  # white box: the counts SGLang's validate_session_state checks
    assert group.session_refs == 2  # one per session, not one per call
    chain = cache._chains["a"]
    assert chain.session_refs == 1 and chain.ref_segments == 3  # the coverage moved forward over every segment
    cache.check()


def test_abort_takes_no_reference_and_an_unfinished_tail_is_unreferenced() -> None:
    cache = RadixCache(600, session_refs=True)
    admit(cache, "a", 200, 1)
    cache.release("a", 1.5, finished=True)
    admit(cache, "a", 300, 2)
    cache.release("a", 2.5)  # the second call aborted: its segment is cached, not covered
    admit(cache, "b", 200, 3)
    cache.release("b", 3.5, finished=True)
    admit(cache, "c", 400, 4)  # evicts 100: a's uncovered tail goes before b's referenced segment
    assert cache.lookup("a", GROUP).device_tokens == 200 and cache.lookup("b", GROUP).device_tokens == 200
    assert cache._chains["a"].ref_segments == 1
    cache.check()


def test_close_dereferences_keeps_the_kv_and_a_late_finish_takes_nothing() -> None:
    cache = RadixCache(600, session_refs=True)
    admit(cache, "a", 200, 1)
    cache.release("a", 1.5, finished=True)
    admit(cache, "b", 200, 2)
    cache.release("b", 2.5)
    assert cache.close_session("a") and not cache.is_referenced("a")
    assert cache.lookup("a", GROUP).device_tokens == 200  # only dereferenced, never freed
    assert not cache.close_session("a")  # idempotent
    admit(cache, "a", 300, 3)  # a late call of the closed session
    cache.release("a", 3.5, finished=True)
    assert not cache.is_referenced("a") and cache.late_finishes == 1 and cache.references_taken == 1
    cache.check()


def test_closed_session_kv_goes_first() -> None:
    cache = filled()  # a, c referenced
    cache.close_session("c")
    order = []
    for now, key in enumerate("vwx", 10):
        before = gone(cache, "abcde")
        admit(cache, key, 200, now)
        order.extend(gone(cache, "abcde") - before)
    assert order == ["b", "c", "d"]  # c is unreferenced now, ranked by its last access among b, d, e


def test_dropping_a_group_ends_its_sessions_references() -> None:
    cache = RadixCache(400, session_refs=True)
    admit(cache, "a", 200, 1)
    cache.release("a", 1.5, finished=True)
    assert cache.admit("x", "h", 300, 400, 2) is not None  # another group takes the whole cache
    assert not cache.is_referenced("a") and not cache.has_chain("a")
    cache.check()


def test_deployment_key_is_checked() -> None:
    assert deployment().session_radix_cache is False
    for value in (True, "faithful"):
        Deployment("d", deployment().profile, 1, 1, 1000, 1000, session_radix_cache=value)
    with pytest.raises(ProfileError, match="session_radix_cache"):
        Deployment("d", deployment().profile, 1, 1, 1000, 1000, session_radix_cache="yes")  # type: ignore[arg-type]


# --- differential --------------------------------------------------------------------------------------

class SessionModel(ModelCache):
    """The plain model with session references: per chain a reference flag and the segments it covers; the
    LRU leaf is taken among the unreferenced first, then among the referenced."""

    def __init__(self, capacity_tokens: int, host_capacity_tokens: int = 0) -> None:
        super().__init__(capacity_tokens, host_capacity_tokens)
        self.refs: dict[str, int] = {}  # session -> segments covered (present: the session holds a reference)
        self.closed: set[str] = set()
        self.tier = DEVICE

    def finish(self, session_key: str) -> None:
        if session_key not in self.closed:
            self.refs[session_key] = len(self.chains[session_key].segments)

    def close(self, session_key: str) -> None:
        self.closed.add(session_key)
        if self.refs.pop(session_key, None) is not None:
            self.forget_if_gone(self.chains[session_key])

    def referenced(self, node: Node) -> bool:
        if node.group is None:
            return any(c.key in self.refs for c in self.children(node))
        deepest = max(i for i, tier in enumerate(node.tiers) if tier == self.tier)
        return deepest < self.refs.get(node.key, 0)

    def least_recent(self, leaves: list[Node]) -> Node:  # type: ignore[override]
        keys = [(self.referenced(n), n.last_access_s) for n in leaves]
        oldest = min(keys)
        assert keys.count(oldest) == 1, "a tie: the model cannot say"
        return leaves[keys.index(oldest)]

    def forget_if_gone(self, node: Node) -> None:
        if node.group is not None and node.key in self.refs:
            return
        super().forget_if_gone(node)

    def recede(self) -> None:
        """Coverage shrinks to the cached segments; a group gone ends its sessions' references."""
        for key, covered in list(self.refs.items()):
            chain = self.chains[key]
            assert chain.group is not None
            if not chain.group.is_resident():
                del self.refs[key]
                self.forget_if_gone(chain)
            else:
                self.refs[key] = min(covered, sum(tier != NONE for tier in chain.tiers))
        for chain in list(self.chains.values()):
            if chain.key in self.chains and chain.key not in self.refs:
                self.forget_if_gone(chain)

    def evict_device_segment(self) -> None:
        super().evict_device_segment()
        self.recede()

    def make_host_room(self, tokens: int) -> bool:
        self.tier = HOST
        try:
            return super().make_host_room(tokens)
        finally:
            self.tier = DEVICE

    def admit(self, session_key: str, group_key: str, group_tokens: int, prompt_tokens: int,
              now: float) -> Admission | None:
        """A rewritten conversation (its segments forgotten) keeps the reference, covering nothing of its chain."""
        chain, group = self.chains.get(session_key), self.groups.get(group_key)
        if (chain is not None and group is not None and sum(group.segments) == group_tokens
                and (chain.pins == 0 or session_key in self.holds)
                and group_tokens <= prompt_tokens < group_tokens + sum(chain.segments) and session_key in self.refs):
            self.refs[session_key] = 0
        return super().admit(session_key, group_key, group_tokens, prompt_tokens, now)


def run_pair(cache: RadixCache, model: ModelCache, seed: int, steps: int, refs_on: bool) -> None:
    rng = random.Random(seed)
    traffic = Traffic(is_tied=False, is_retiring=False)
    for _ in range(steps):
        op: Op = traffic.step(rng.choice(KINDS), rng.randrange(NUM_SESSIONS), rng.randrange(2_500),
                              rng.randrange(100), is_same_time=False)
        kind, key = op[0], op[1]
        if kind == "release" and rng.random() < 0.7:  # a normal finish (else an abort)
            result = _finish(cache, model, op)
        elif kind == "drop_hold" and rng.random() < 0.05:  # the session ends (its id never comes back)
            cache.close_session(key)
            if isinstance(model, SessionModel):
                model.close(key)
            result = None
        else:
            result = apply(cache, op)
            assert result == apply(model, op), op
        traffic.after(op, result, cache)
        cache.check()
        assert observed(cache, traffic.seen) == observed(model, traffic.seen), op
        assert (cache.num_chains, cache.num_groups) == (len(model.chains), len(model.groups)), op
        if isinstance(model, SessionModel):
            assert {k for k in traffic.seen if cache.is_referenced(k)} == set(model.refs), op
    assert not refs_on or cache.references_taken > 0


def _finish(cache: RadixCache, model: ModelCache, op: Op) -> object:
    """A release as a normal finish: the reference is taken before the chain is unpinned, as in the cache."""
    _, key, now, _, until_s = op
    try:
        cache.release(key, now, until_s, finished=True)
        result: object = None
    except CacheError:
        result = "CacheError"
    chain = model.chains.get(key)
    if isinstance(model, SessionModel) and chain is not None and chain.pins > 0 and key not in model.holds:
        model.finish(key)
    assert apply(model, op) == result, op
    return result


def test_key_off_finishes_and_closes_change_nothing() -> None:
    for seed, (capacity, host) in enumerate(SIZES):
        run_pair(RadixCache(capacity, host), ModelCache(capacity, host), seed, 2_000, refs_on=False)


def test_key_on_matches_the_session_model() -> None:
    for seed, (capacity, host) in enumerate(SIZES):
        run_pair(RadixCache(capacity, host, session_refs=True), SessionModel(capacity, host), 10 + seed, 2_000,
                 refs_on=True)


# --- engine ----------------------------------------------------------------------------------------------

def run_engine(key: bool | str) -> Engine:
    """Under `sglang`: a session `keep` comes back after a 4 s tool call, while one-call sessions stream
    through a cache too small for all of them (6,000 tokens: the group, keep's 1,500, four more)."""
    base = deployment(cache_tokens=6_000)
    dep = dataclasses.replace(base, session_radix_cache=key)
    engine = Engine(dep, FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("keep", [2_000, 2_100, 2_200], completion=10, gap_s=4.0), 0.0, shared_tokens=500))
    for i in range(8):
        engine.add(spec(session(f"one{i}", [1_500], completion=10), 1.0 + 0.5 * i, shared_tokens=500))
    engine.run_until(math.inf)
    engine.check()
    return engine


def test_engine_key_off_faithful_and_true() -> None:
    off, faithful, on = run_engine(False), run_engine("faithful"), run_engine(True)
    cache_off, cache_faithful, cache_on = (e.prefill[0].cache for e in (off, faithful, on))
    assert cache_off.evicted_tokens > 0  # the one-call sessions press the cache
    # faithful: as SGLang's PD prefill code, no reference is taken: the same run as off
    assert cache_faithful.references_taken == 0 and cache_faithful.sessions_closed == 9
    assert cache_faithful.evicted_tokens == cache_off.evicted_tokens
    assert [r.ended_s for r in faithful.runs.values()] == [r.ended_s for r in off.runs.values()]
    # true: every normal finish registers, every session is closed at its end, keep's prefix survives
    assert cache_on.references_taken == 3 + 8 and cache_on.sessions_closed == 9
    assert not any(cache_on.is_referenced(s) for s in on.runs)
    hit_off, hit_on = (sum(e.timeline.device_hit_tokens) for e in (off, on))
    assert sum(off.timeline.prompt_tokens) == sum(on.timeline.prompt_tokens)
    assert hit_on - hit_off >= 1_000  # keep's later calls hit its 1,500-token chain instead of the group only


# --- deployment key, run summary, rate key --------------------------------------------------------------

def test_the_summary_reports_the_session_cache_only_with_the_key_on() -> None:
    cell = CELLS[0]  # sglang, no lending, on the golden surge
    assert cell.policy == "sglang" and cell.deployment.session_radix_cache is False
    expected = golden()[cell.name]["summary"]
    assert "session_cache" not in expected
    faithful = dataclasses.replace(cell, deployment=dataclasses.replace(cell.deployment,
                                                                        session_radix_cache="faithful")).run()["summary"]
    report = faithful.pop("session_cache")
    assert faithful == expected  # inert under PD: the same run, only the report added
    assert report["mode"] == "faithful" and report["references_taken"] == 0 and report["sessions_closed"] > 0
    assert report["evicted_referenced_tokens"] == 0
    on = dataclasses.replace(cell, deployment=dataclasses.replace(cell.deployment, session_radix_cache=True))
    report = on.run()["summary"]["session_cache"]
    assert report["mode"] == "true" and report["references_taken"] > 0
    assert report["evicted_referenced_tokens"] + report["evicted_unreferenced_tokens"] > 0


def test_the_deployment_file_key_and_the_rate_key(tmp_path: Path) -> None:
    text = "profile: h100-qwen3.6-35b-a3b\nnum_prefill: 1\nnum_decode: 3\ncache: gpu\n"
    for value, expected in (("", False), ("session_radix_cache: true\n", True),
                            ("session_radix_cache: faithful\n", "faithful")):
        (tmp_path / "d.yaml").write_text(text + value)
        spec_ = load_deployment(str(tmp_path / "d.yaml"))
        assert spec_.build().session_radix_cache == expected
        assert spec_.build(session_radix_cache=False).session_radix_cache is False
    (tmp_path / "d.yaml").write_text(text + "session_radix_cache: yes-please\n")
    with pytest.raises(CatalogError, match="session_radix_cache"):
        load_deployment(str(tmp_path / "d.yaml"))
    off = CELLS[0].deployment
    scenario = CELLS[0].scenario
    key = rate_key(off, scenario.workload, scenario.clients, POOL)
    for value in (True, "faithful"):  # every session-cache key of a shape runs at the same measured rate
        on = dataclasses.replace(off, session_radix_cache=value)
        assert rate_key(on, scenario.workload, scenario.clients, POOL) == key
        assert overload_shape(on) == overload_shape(off)


def test_run_takes_the_key_as_an_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    files = seeded_files(tmp_path, CLI_DEPLOYMENT)
    argv = ["run", "--scenario", str(tmp_path / "s.yaml"), "--deployment", files["deployment"], "--policy", "sglang",
            "--seed", "3", "--json", "--quiet", "--sessions", files["sessions"], *RATE]
    shown = {}
    for value in ("false", "true"):
        assert main([*argv, "--session-radix-cache", value]) == 0
        shown[value] = json.loads(capsys.readouterr().out)
    assert "session_cache" not in shown["false"]
    assert shown["true"]["session_cache"]["mode"] == "true" and shown["true"]["session_cache"]["references_taken"] > 0
    assert shown["true"]["base_rate_per_s"] == shown["false"]["base_rate_per_s"]  # the same arrivals

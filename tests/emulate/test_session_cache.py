"""SGLang's session radix cache in the emulator: the flag and its validation, session references on the prefill
cache (unreferenced KV evicted first), /close_session (dereference, tombstone, idempotent), and its metrics."""

from __future__ import annotations

import asyncio

import pytest

from basin_emulate.calls import Endpoint, parse_call
from basin_emulate.config import ConfigError, parse_config
from basin_emulate.errors import BadRequestError
from basin_emulate.prefill_engine import PrefillEngine
from basin_runtime.clock import ManualClock
from tests.emulate.rig import free_port, serving
from tests.emulate.test_engines import started_clock
from tests.sim.builders import TINY

CHAIN_TOKENS = 400
GROUP_TOKENS = 10
CAPACITY = 1000  # two chains of 400 (and their group) fit, a third does not
ON = ("--enable-session-radix-cache", "--radix-eviction-policy", "priority")


async def prefill(engine: PrefillEngine, wall: ManualClock, chain: str, tag: str | None) -> None:
    """One request on `chain` (its own prompt of CHAIN_TOKENS past the group), run to its end."""
    clock = engine.clock
    job = asyncio.ensure_future(engine.prefill(chain, "g", GROUP_TOKENS, GROUP_TOKENS + CHAIN_TOKENS, 0.0,
                                               clock.catch_up(), session_id=tag))
    await wall.drive(job)
    await job


def engine_on(*, takes_references: bool) -> tuple[PrefillEngine, ManualClock]:
    wall = ManualClock()
    engine = PrefillEngine(TINY, started_clock(10.0, wall), CAPACITY, session_cache=True,
                           takes_references=takes_references)
    return engine, wall


def cached(engine: PrefillEngine, chain: str) -> int:
    return engine.cached_tokens(chain, "g") - GROUP_TOKENS


@pytest.mark.asyncio
async def test_a_referenced_chain_survives_eviction_while_an_older_unreferenced_one_goes() -> None:
    engine, wall = engine_on(takes_references=True)
    await prefill(engine, wall, "a", "s1")  # the oldest, but its session holds a reference
    await prefill(engine, wall, "b", None)
    await prefill(engine, wall, "c", None)  # needs room: one of a, b goes
    assert cached(engine, "a") == CHAIN_TOKENS and cached(engine, "b") == 0
    assert engine.cache.is_referenced("a") and engine.session_refs is not None
    assert engine.session_refs.references_taken == 1 and engine.session_refs.num_open_sessions == 1


@pytest.mark.asyncio
async def test_faithful_mode_takes_no_reference_so_eviction_is_plain_lru() -> None:
    engine, wall = engine_on(takes_references=False)
    await prefill(engine, wall, "a", "s1")
    await prefill(engine, wall, "b", None)
    await prefill(engine, wall, "c", None)
    assert cached(engine, "a") == 0 and cached(engine, "b") == CHAIN_TOKENS
    assert engine.session_refs is not None and engine.session_refs.references_taken == 0
    assert engine.close_session("s1") == 0 and engine.session_refs.sessions_closed == 1


@pytest.mark.asyncio
async def test_close_dereferences_keeps_the_kv_and_is_idempotent() -> None:
    engine, wall = engine_on(takes_references=True)
    await prefill(engine, wall, "a", "s1")
    await prefill(engine, wall, "b", None)
    assert engine.close_session("s1") == 1
    assert cached(engine, "a") == CHAIN_TOKENS and not engine.cache.is_referenced("a")  # dereferenced, not freed
    assert engine.close_session("s1") == 0  # again: nothing changes but the count
    refs = engine.session_refs
    assert refs is not None and (refs.sessions_closed, refs.references_dropped, refs.num_open_sessions) == (2, 1, 0)
    await prefill(engine, wall, "c", None)  # a is unreferenced and the least recent: it goes now
    assert cached(engine, "a") == 0 and cached(engine, "b") == CHAIN_TOKENS
    engine.cache.check()


@pytest.mark.asyncio
async def test_a_session_closed_while_its_request_runs_is_tombstoned_so_that_late_finish_takes_no_reference() -> None:
    engine, wall = engine_on(takes_references=True)
    clock = engine.clock
    job = asyncio.ensure_future(engine.prefill("a", "g", GROUP_TOKENS, GROUP_TOKENS + CHAIN_TOKENS, 0.0,
                                               clock.catch_up(), session_id="s1"))
    await asyncio.sleep(0)  # it arrived (the tag opened) and is inside the instance
    assert engine.close_session("s1") == 0
    await wall.drive(job)
    await job
    refs = engine.session_refs
    assert refs is not None and refs.late_finishes == 1 and refs.references_taken == 0 and refs.is_closed("s1")
    assert not engine.cache.is_referenced("a") and engine.cache.pinned_tokens == 0


@pytest.mark.asyncio
async def test_a_closed_tag_used_again_reopens_and_takes_a_reference() -> None:
    engine, wall = engine_on(takes_references=True)
    await prefill(engine, wall, "a", "s1")
    engine.close_session("s1")
    await prefill(engine, wall, "a", "s1")  # SGLang's open_radix_session lifts the tombstone
    refs = engine.session_refs
    assert refs is not None and not refs.is_closed("s1") and engine.cache.is_referenced("a")
    assert (refs.references_taken, refs.late_finishes) == (2, 0)


@pytest.mark.asyncio
async def test_a_chain_two_sessions_reference_keeps_its_reference_until_both_close() -> None:
    engine, wall = engine_on(takes_references=True)
    await prefill(engine, wall, "a", "s1")
    await prefill(engine, wall, "a", "s2")  # the same conversation opening under another tag
    assert engine.close_session("s1") == 0 and engine.cache.is_referenced("a")
    assert engine.close_session("s2") == 1 and not engine.cache.is_referenced("a")


@pytest.mark.asyncio
async def test_a_flush_forgets_tags_and_tombstones_but_keeps_the_counts() -> None:
    engine, wall = engine_on(takes_references=True)
    await prefill(engine, wall, "a", "s1")
    engine.close_session("s2")
    assert engine.flush()
    refs = engine.session_refs
    assert refs is not None and refs.cache is engine.cache and not refs.is_closed("s2")
    assert refs.num_open_sessions == 0 and (refs.references_taken, refs.sessions_closed) == (1, 1)
    await prefill(engine, wall, "a", "s1")  # the new cache takes the reference
    assert engine.cache.is_referenced("a") and refs.references_taken == 2


def test_the_flag_needs_the_priority_eviction_policy_as_sglang_requires() -> None:
    base = ["--role", "prefill"]
    with pytest.raises(ConfigError, match=r"^--enable-session-radix-cache requires --radix-eviction-policy priority$"):
        parse_config([*base, "--enable-session-radix-cache"])
    with pytest.raises(ConfigError, match="--session-radix-cache-mode needs --enable-session-radix-cache"):
        parse_config([*base, "--session-radix-cache-mode", "true"])
    with pytest.raises(ConfigError, match="--radix-eviction-policy 'lfu' is not emulated"):
        parse_config([*base, "--radix-eviction-policy", "lfu"])
    off, on = parse_config(base), parse_config([*base, *ON])
    assert (off.enable_session_radix_cache, off.radix_eviction_policy) == (False, "lru")
    assert (on.enable_session_radix_cache, on.session_radix_cache_mode) == (True, "faithful")
    assert parse_config([*base, *ON, "--session-radix-cache-mode", "true"]).session_radix_cache_mode == "true"


def test_session_id_is_read_top_level_and_must_be_a_string() -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "session_id": "agent-42"}'
    assert parse_call(Endpoint.CHAT, body).session_id == "agent-42"
    assert parse_call(Endpoint.GENERATE, b'{"text": "hi"}').session_id is None
    with pytest.raises(BadRequestError, match="session_id must be a string"):
        parse_call(Endpoint.GENERATE, b'{"text": "hi", "session_id": 7}')


def prefill_argv(*extra: str) -> list[str]:
    return ["--role", "prefill", "--port", "1", "--disaggregation-bootstrap-port", str(free_port()),
            "--time-scale", "50", "--enable-metrics", *extra]


@pytest.mark.asyncio
async def test_close_session_route_answers_200_with_the_flag_off_or_on_and_400_on_a_bad_body() -> None:
    body = {"messages": [{"role": "user", "content": "task"}], "session_id": "agent-42", "max_tokens": 1}
    async with serving(prefill_argv()) as off:
        assert (await off.http.post("/v1/chat/completions", json=body)).status_code == 200  # the tag is ignored
        closed_off = await off.http.post("/close_session", json={"session_id": "agent-42"})
        metrics_off = (await off.http.get("/metrics")).text
        bad = await off.http.post("/close_session", json={"id": "agent-42"})
    async with serving(prefill_argv(*ON, "--session-radix-cache-mode", "true")) as on:
        assert (await on.http.post("/v1/chat/completions", json=body)).status_code == 200
        referenced = on.role.engine.session_refs.num_open_sessions
        closed = [(await on.http.request(method, "/close_session", json={"session_id": "agent-42"})).status_code
                  for method in ("POST", "GET")]
        metrics_on = (await on.http.get("/metrics")).text
        info = (await on.http.get("/server_info")).json()
    assert closed_off.status_code == 200 and closed_off.content == b"" and "basin_emulate_session" not in metrics_off
    assert bad.status_code == 400 and "session_id" in bad.json()["error"]["message"]
    assert referenced == 1 and closed == [200, 200]
    assert "basin_emulate_session_references_taken_total 1.0" in metrics_on
    assert "basin_emulate_session_closes_total 2.0" in metrics_on
    assert "basin_emulate_session_references_dropped_total 1.0" in metrics_on
    assert "basin_emulate_session_open 0.0" in metrics_on
    assert info["enable_session_radix_cache"] is True and info["radix_eviction_policy"] == "priority"
    assert info["basin_emulate"]["session_radix_cache_mode"] == "true"

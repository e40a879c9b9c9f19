"""`engine_session_cache`: every forwarded call carries its session's tag as top-level `session_id` (SGLang's
session radix cache), and a session's end POSTs /close_session to each engine in the background (failures
counted and logged, never seen by a call); off, nothing changes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from basin_runtime.gateway import resend
from basin_runtime.gateway.config import ConfigError, load_config
from basin_runtime.gateway.engine_sessions import EngineSessions
from basin_runtime.gateway.priority import routing_key
from tests.runtime.test_gateway_app import CHAT, Rig, conversation, eventually, rig_for

HANG_GUARD_S = 5.0  # only so a broken rule fails instead of hanging; never what a test asserts
ENGINES = ("http://prefill-0:30000", "http://decode-0:30001", "http://decode-1:30002")


class FakeEngines:
    """Records /close_session posts; `answer(url)` gives each engine's reply (an httpx error raises)."""

    def __init__(self, answer: Callable[[str], httpx.Response | Exception] | None = None) -> None:
        self.closes: list[tuple[str, dict[str, Any]]] = []
        self.answer = answer or (lambda url: httpx.Response(200))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.netloc.decode()}"
        self.closes.append((base + request.url.path, json.loads(request.content)))
        reply = self.answer(base)
        if isinstance(reply, Exception):
            raise reply
        return reply


def failures_counter() -> Counter:
    return Counter("basin_engine_session_close_failures", "test", ["engine"], registry=CollectorRegistry())


@asynccontextmanager
async def tagging_rig(engines: FakeEngines, failures: Counter | None = None,
                      **policy: Any) -> AsyncIterator[tuple[Rig, EngineSessions]]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    closer = EngineSessions(ENGINES, failures or failures_counter(), lambda: 0.0, client=client)
    async with rig_for(gateway_options={"tags_engine_sessions": True, "engine_sessions": closer}, **policy) as rig:
        try:
            yield rig, closer
        finally:
            await closer.aclose()


@pytest.mark.asyncio
async def test_every_forwarded_call_carries_its_sessions_routing_key_as_session_id_replacing_the_clients() -> None:
    async with tagging_rig(FakeEngines()) as (rig, _):
        assert (await rig.chat("s1", "fix the bug")).status_code == 200
        raw = (b'{"model": "m", "session_id": "someone-elses", "messages": [{"role": "user", "content": "a"}, '
               b'{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}], "session_id": "x"}')
        headers = {"X-Session-ID": "s2", "content-type": "application/json"}
        assert (await rig.client.post(CHAT, content=raw, headers=headers)).status_code == 200
        batch = await rig.client.post("/generate", json={"text": ["a", "b"], "sampling_params": {}})
        assert batch.status_code == 200
    first, second, batched = rig.upstream.requests
    assert "session_id" not in json.loads(batched.content)  # a batch goes untagged, as it goes without a rid
    assert json.loads(first.content)["session_id"] == routing_key("s1")
    assert second.content.count(b'"session_id"') == 1  # every client copy cut out, the gateway's spliced in
    assert json.loads(second.content)["session_id"] == routing_key("s2")


@pytest.mark.asyncio
async def test_off_a_clients_own_session_id_is_forwarded_untouched() -> None:
    async with rig_for() as rig:
        assert (await rig.chat("s1", "fix the bug", session_id="agent-7")).status_code == 200
        assert (await rig.chat("s2", "other task")).status_code == 200
    tagged, plain = rig.upstream.bodies()
    assert tagged["session_id"] == "agent-7" and "session_id" not in plain


@pytest.mark.asyncio
async def test_a_sessions_end_posts_close_session_to_every_engine() -> None:
    engines = FakeEngines()
    async with tagging_rig(engines) as (rig, closer):
        assert (await rig.chat("s1", "fix the bug")).status_code == 200
        assert engines.closes == []  # nothing is closed while the session lives
        assert (await rig.client.post("/basin/sessions/s1/end")).status_code == 200
        await closer.aclose()  # waits for the background closes
    assert sorted(url for url, _ in engines.closes) == sorted(url + "/close_session" for url in ENGINES)
    assert [body for _, body in engines.closes] == [{"session_id": routing_key("s1")}] * len(ENGINES)


@pytest.mark.asyncio
async def test_a_failed_close_is_counted_and_logged_and_never_fails_the_call(caplog: pytest.LogCaptureFixture) -> None:
    def answer(url: str) -> httpx.Response | Exception:
        if url == ENGINES[1]:
            return httpx.ConnectError("refused")
        return httpx.Response(500, text="boom") if url == ENGINES[2] else httpx.Response(200)

    failures = failures_counter()
    engines = FakeEngines(answer)
    with caplog.at_level(logging.WARNING, logger="basin_runtime.gateway.engine_sessions"):
        async with tagging_rig(engines, failures) as (rig, closer):
            assert (await rig.chat("s1", "fix the bug")).status_code == 200
            assert (await rig.client.post("/basin/sessions/s1/end")).status_code == 200
            await closer.aclose()
    assert len(engines.closes) == 3
    assert [failures.labels(url)._value.get() for url in ENGINES] == [0, 1, 1]
    logged = [r.getMessage() for r in caplog.records]
    assert any(ENGINES[1] in m and "ConnectError" in m for m in logged)
    assert any(ENGINES[2] in m and "HTTP 500" in m for m in logged)


@pytest.mark.asyncio
async def test_a_session_that_moved_to_another_replica_is_not_closed() -> None:
    engines = FakeEngines()
    async with tagging_rig(engines) as (rig, closer):
        assert (await rig.chat("s1", "fix the bug")).status_code == 200
        entry = rig.room.registry.get("s1")
        assert entry is not None
        rig.gateway.telemetry.session_ended(entry, "moved")  # it lives on elsewhere, under the same key
        await asyncio.sleep(0)
        await closer.aclose()
    assert engines.closes == []


@pytest.mark.asyncio
async def test_a_session_whose_calls_never_reached_the_engines_is_not_closed() -> None:
    engines = FakeEngines()
    async with tagging_rig(engines, budget_tokens=1) as (rig, closer):  # once one session is live, others wait
        assert (await rig.chat("first", "task one")).status_code == 200
        second = asyncio.create_task(rig.chat("second", "task two"))
        await eventually(lambda: rig.policy.is_queued("second"))
        assert (await rig.client.post("/basin/sessions/second/end")).status_code == 200  # withdrawn from the queue
        await asyncio.wait_for(second, timeout=HANG_GUARD_S)
        assert (await rig.client.post("/basin/sessions/first/end")).status_code == 200
        await closer.aclose()
    assert {body["session_id"] for _, body in engines.closes} == {routing_key("first")}


@pytest.mark.asyncio
async def test_a_big_resent_call_with_its_own_session_id_is_read_in_full_so_the_tag_replaces_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resend, "RESEND_MIN_BYTES", 64 << 10)
    messages = conversation("task " + "x" * 70_000)
    grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    async with tagging_rig(FakeEngines()) as (rig, _):
        for body in (messages, grown):
            response = await rig.client.post(CHAT, json={"model": "m", "messages": body, "session_id": "mine"},
                                             headers={"X-Session-ID": "big"})
            assert response.status_code == 200, response.text
    assert [b["session_id"] for b in rig.upstream.bodies()] == [routing_key("big")] * 2
    assert [r.content.count(b'"session_id"') for r in rig.upstream.requests] == [1, 1]


def test_the_option_needs_engines_and_reads_them_from_engine_metrics_urls() -> None:
    base = {"upstream": "http://r", "model": ["m.onnx"]}
    assert load_config(base).engine_session_cache is False
    with pytest.raises(ConfigError, match="engine_session_cache: no engine to close sessions on"):
        load_config({**base, "engine_session_cache": True})
    derived = load_config({**base, "engine_session_cache": True,
                           "engine_metrics_urls": ["http://p:30000/metrics", "http://d:30001/metrics"]})
    assert derived.session_close_urls == ("http://p:30000", "http://d:30001")
    given = load_config({**base, "engine_session_cache": True, "engine_urls": ["http://p:30000/"],
                         "engine_metrics_urls": ["http://d:30001/metrics"]})
    assert given.session_close_urls == ("http://p:30000",)

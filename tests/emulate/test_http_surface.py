"""The info endpoints smg and operators read, /flush_cache, and clients that leave early."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.types import Message

from tests.emulate.rig import free_port, pair, serving

pytestmark = pytest.mark.asyncio
CHAT = "/v1/chat/completions"


async def test_info_endpoints_answer_as_sglang_and_version_is_not_found() -> None:
    async with pair("--time-scale", "30", "--served-model-name", "emulated-qwen",
                    prefill_extra=("--enable-priority-scheduling",)) as p:
        await p.chat({"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4})
        prefill, decode = p.prefill.http, p.decode.http
        version = await decode.get("/version")
        models = (await decode.get("/v1/models")).json()
        info = (await prefill.get("/server_info")).json()
        old_info = (await decode.get("/get_server_info")).json()
        model_info = (await prefill.get("/model_info")).json()
        loads = (await decode.get("/v1/loads", params={"include": "core"})).json()
        health = [(await s.get(path)).status_code for s in (prefill, decode)
                  for path in ("/health", "/health_generate", "/get_model_info", "/loads")]
        metrics = (await prefill.get("/metrics")).status_code

    assert version.status_code == 404  # else smg takes the worker for vLLM
    assert models["data"][0]["id"] == "emulated-qwen" and models["data"][0]["owned_by"] == "sglang"
    assert info["disaggregation_mode"] == "prefill" and old_info["disaggregation_mode"] == "decode"
    assert info["max_total_num_tokens"] == 1_300_000 and isinstance(info["max_running_requests"], int)
    assert info["enable_priority_scheduling"] is True and old_info["enable_priority_scheduling"] is False
    assert info["time_scale"] == 30 and info["served_model_name"] == "emulated-qwen"
    lag = info["basin_emulate"]["lag"]
    assert set(lag) == {"count", "p50_s", "p99_s", "max_s", "window_s"} and lag["count"] >= 1
    assert 0 <= lag["p50_s"] <= lag["p99_s"] <= lag["max_s"] < 0.5
    assert model_info["is_generation"] is True
    (load,) = loads["loads"]
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0 and load["max_total_num_tokens"] == 1_300_000
    assert load["disaggregation"]["mode"] == "decode"
    assert health == [200] * 8
    assert metrics == 404  # only with --enable-metrics


async def test_flush_cache_empties_the_prefix_cache_when_idle() -> None:
    async with serving(["--role", "prefill", "--port", "1", "--disaggregation-bootstrap-port", str(free_port()),
                        "--time-scale", "50", "--enable-cache-report"]) as prefill:
        body = {"messages": [{"role": "system", "content": "shared " * 300}, {"role": "user", "content": "task"}]}
        await prefill.http.post(CHAT, json=body)
        before = (await prefill.http.post(CHAT, json=body)).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        flushed = await prefill.http.post("/flush_cache")
        after = (await prefill.http.post(CHAT, json=body)).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert before > 300 and flushed.status_code == 200 and "Cache flushed" in flushed.text and after == 0


def scripted_receive(body: bytes, leave: asyncio.Event) -> Callable[[], Awaitable[Message]]:
    """An ASGI receive that sends `body`, then reports a disconnect once `leave` is set."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    return receive


async def call_raw(app: Any, path: str, body: bytes, leave: asyncio.Event, sent: list[Message]) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2)}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, scripted_receive(body, leave), send)


async def test_a_client_leaving_gives_back_decode_memory_and_prefill_pins() -> None:
    async with pair("--time-scale", "2", "--max-total-tokens", "9000") as p:
        decode_engine, prefill_engine = p.decode.role.engine, p.prefill.role.engine
        routed = {"messages": [{"role": "user", "content": "long task " * 1500}], "max_tokens": 500,
                  "bootstrap_host": "127.0.0.1", "bootstrap_port": p.prefill.config.bootstrap_port}
        # 1. Mid-decode, non-streamed: both halves run; the decode client leaves while tokens are being made.
        leave, sent = asyncio.Event(), []
        body = json.dumps({**routed, "bootstrap_room": 77}).encode()
        halves = [asyncio.create_task(call_raw(p.prefill.app, CHAT, body, asyncio.Event(), [])),
                  asyncio.create_task(call_raw(p.decode.app, CHAT, body, leave, sent))]
        while decode_engine.instance.batch_size == 0:
            await asyncio.sleep(0.01)
        assert decode_engine.instance.used_tokens() > 0
        leave.set()
        await asyncio.gather(*halves)
        assert decode_engine.instance.used_tokens() == 0 and decode_engine.is_idle
        assert prefill_engine.cache.pinned_tokens == 0 and prefill_engine.is_idle
        # 2. Streamed: the client leaves after the first chunk.
        leave, sent = asyncio.Event(), []
        body = json.dumps({**routed, "bootstrap_room": 78, "stream": True}).encode()
        halves = [asyncio.create_task(call_raw(p.prefill.app, CHAT, body, asyncio.Event(), [])),
                  asyncio.create_task(call_raw(p.decode.app, CHAT, body, leave, sent))]
        while not any(m["type"] == "http.response.body" and m.get("body") for m in sent):
            await asyncio.sleep(0.01)
        leave.set()
        await asyncio.gather(*halves)
        assert decode_engine.instance.used_tokens() == 0 and decode_engine.instance.batch_size == 0
        # 3. Waiting for memory: a request that cannot be reserved yet, whose client leaves while it waits.
        blocker = decode_engine.submit(8_000, 500, 500, 0.0, False, 0.0)
        leave, sent = asyncio.Event(), []
        body = json.dumps({**routed, "bootstrap_room": 79}).encode()
        waiting = asyncio.create_task(call_raw(p.decode.app, CHAT, body, leave, sent))
        while decode_engine.instance.num_queued == 0:
            await asyncio.sleep(0.01)
        leave.set()
        await waiting
        decode_engine.withdraw(blocker)
        assert decode_engine.instance.used_tokens() == 0 and decode_engine.instance.queued_tokens == 0
        # 4. The prefill's own client leaves while it waits for its decode half: its room is closed.
        leave = asyncio.Event()
        prefill_only = asyncio.create_task(call_raw(p.prefill.app, CHAT, json.dumps(
            {**routed, "bootstrap_room": 80}).encode(), leave, []))
        while p.prefill.role.rooms.num_waiting_ready == 0:
            await asyncio.sleep(0.01)
        leave.set()
        await prefill_only
        assert p.prefill.role.rooms.num_waiting_ready == 0 and prefill_engine.is_idle

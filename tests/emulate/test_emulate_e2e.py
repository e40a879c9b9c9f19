"""End to end: the official `openai` client -> the real SGLang router (`smg`, PD mode) -> two emulators.

Everything runs as subprocesses on free loopback ports: `python -m basin_emulate` as prefill and as
decode (priority scheduling on, cache report on, real time at --time-scale 1 so that queueing is visible;
the session radix cache on both, prefill in mode true so its references show), and
`python -m smg.launch_router --pd-disaggregation`. All are killed (process group, SIGKILL) in the
fixture's teardown, whatever happened.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from basin_runtime.gateway.engine_sessions import EngineSessions
from tests.e2e.test_gateway_e2e import STARTUP_TIMEOUT_S, Process, free_port, start, wait_ready

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]
MODEL = "emulated-qwen"


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The emulators' and the router's base URLs, by name (prefill, decode, router)."""
    logs: Path = tmp_path_factory.mktemp("emulate-e2e")
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "router", "metrics")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    common = ["--enable-priority-scheduling", "--enable-cache-report", "--enable-metrics",
              "--served-model-name", MODEL, "--log-level", "warning",
              "--enable-session-radix-cache", "--radix-eviction-policy", "priority"]
    processes: list[Process] = []
    try:
        processes.append(start("prefill", [sys.executable, "-m", "basin_emulate", "--role", "prefill", "--port",
                                           str(ports["prefill"]), "--disaggregation-bootstrap-port",
                                           str(ports["bootstrap"]), *common, "--session-radix-cache-mode", "true"],
                                     logs))
        processes.append(start("decode", [sys.executable, "-m", "basin_emulate", "--role", "decode", "--port",
                                          str(ports["decode"]), *common], logs))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for process in processes:
            wait_ready(process, f"{url[process.name]}/health", deadline)
        processes.append(start("router", [
            sys.executable, "-m", "smg.launch_router", "--pd-disaggregation",
            "--prefill", url["prefill"], str(ports["bootstrap"]), "--decode", url["decode"],
            "--host", "127.0.0.1", "--port", str(ports["router"]),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["metrics"]), "--log-level", "warn",
        ], logs))
        wait_ready(processes[-1], f"{url['router']}/readiness", deadline)
        _wait_registered(url["router"], deadline)
        yield url
    finally:
        for process in reversed(processes):
            process.kill()


@pytest.fixture(scope="module")
def router(urls: dict[str, str]) -> str:
    return urls["router"]


def _wait_registered(router: str, deadline: float) -> None:
    """Until smg lists both workers as ready SGLang workers."""
    while time.monotonic() < deadline:
        workers = httpx.get(f"{router}/workers", timeout=2).json()["workers"]
        if sorted((w["worker_type"], w["runtime_type"], w["status"]) for w in workers) == [
                ("decode", "sglang", "ready"), ("prefill", "sglang", "ready")]:
            return
        time.sleep(0.1)
    pytest.fail(f"smg did not register both emulators: {workers}")


def client(router: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router}/v1", api_key="e2e", max_retries=0, timeout=30)


def agent_call(task: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 100},
                                      {"role": "user", "content": f"{task} " + "in the storage layer " * 300}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"running step {turn}"},
                     {"role": "user", "content": f"step {turn} printed " + "ok " * 500}]
    return messages


async def test_smg_registers_both_emulators_and_serves_chat_streamed_and_not(router: str) -> None:
    async with client(router) as api:
        models = await api.models.list()
        reply = await api.chat.completions.create(model=MODEL, messages=agent_call("e2e plain", 0), max_tokens=12)
        stream = await api.chat.completions.create(model=MODEL, messages=agent_call("e2e stream", 0), max_tokens=30,
                                                   stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]

    assert MODEL in [m.id for m in models.data]
    assert reply.choices[0].finish_reason == "length" and reply.usage is not None
    assert reply.usage.completion_tokens == 12 == len((reply.choices[0].message.content or "").split())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 30
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


async def test_a_resent_longer_conversation_reports_cached_tokens(router: str) -> None:
    async with client(router) as api:
        first = await api.chat.completions.create(model=MODEL, messages=agent_call("e2e resend", 1), max_tokens=4)
        second = await api.chat.completions.create(model=MODEL, messages=agent_call("e2e resend", 2), max_tokens=4)

    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2  # the system prompt
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens


async def _queue_reaches(engine: str, running: int, queued: int, timeout_s: float = 20.0) -> None:
    """Until the engine's SGLang gauges show `running` requests in its batch and `queued` waiting."""
    want = {"sglang:num_running_reqs": float(running), "sglang:num_queue_reqs": float(queued)}
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=engine, timeout=2) as http:
        while time.monotonic() < deadline:
            text = (await http.get("/metrics")).text
            seen = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name in want}
            if seen == want:
                return
            await asyncio.sleep(0.02)
    pytest.fail(f"prefill never showed {want}; last seen {seen}")


async def test_rid_and_priority_pass_through_the_router(urls: dict[str, str]) -> None:
    async with client(urls["router"]) as api:
        async def call(task: str, tokens_of_text: int, priority: int) -> tuple[str, float]:
            messages = [{"role": "user", "content": f"{task} " + "word " * tokens_of_text}]
            reply = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                      extra_body={"priority": priority, "rid": f"rid-{task}"})
            return reply.id, time.monotonic()

        # At time scale 1 a 60k-token prompt keeps prefill busy for ~8 batches of 8192 tokens (~2 s). The low-
        # and high-priority calls (10k tokens: they cannot end in the same batch) are sent one after the other
        # once the engine's own gauges show the one before waiting, so arrival order does not hang on how
        # loaded the machine is; the high one, sent last, must be prefilled first.
        blocker = asyncio.create_task(call("blocker", 60_000, 0))
        await _queue_reaches(urls["prefill"], running=1, queued=0)
        low = asyncio.create_task(call("low", 10_000, 1))
        await _queue_reaches(urls["prefill"], running=1, queued=1)
        high = asyncio.create_task(call("high", 10_000, 100))
        await _queue_reaches(urls["prefill"], running=1, queued=2)
        results = await asyncio.gather(blocker, low, high)

    assert [rid for rid, _ in results] == ["rid-blocker", "rid-low", "rid-high"]
    (_, blocker_done), (_, low_done), (_, high_done) = results
    assert high_done < low_done, "priority did not reach the prefill queue"
    assert blocker_done < low_done


async def _session_counts(engine: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=engine, timeout=5) as http:
        text = (await http.get("/metrics")).text
    return {s.name.removeprefix("basin_emulate_session_"): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("basin_emulate_session_")}


async def test_the_session_tag_passes_smg_to_both_engines_and_the_gateway_closes_it_on_each(
        urls: dict[str, str]) -> None:
    async with client(urls["router"]) as api:
        await api.chat.completions.create(model=MODEL, messages=agent_call("e2e session", 0), max_tokens=2,
                                          extra_body={"session_id": "agent-42"})
    held = await _session_counts(urls["prefill"])
    async with httpx.AsyncClient(timeout=5) as http:
        through_router = await http.post(f"{urls['router']}/close_session", json={"session_id": "agent-42"})
    failures = Counter("basin_engine_session_close_failures", "e2e", ["engine"], registry=CollectorRegistry())
    closer = EngineSessions([urls["prefill"], urls["decode"]], failures, time.monotonic)
    closer.close("agent-42")  # what the gateway does at the session's end (smg routes no /close_session)
    await closer.aclose()
    prefill, decode = await _session_counts(urls["prefill"]), await _session_counts(urls["decode"])

    assert held["tagged_requests_total"] == 1 and held["references_taken_total"] == 1 and held["open"] == 1
    assert through_router.status_code == 404
    assert [failures.labels(url)._value.get() for url in (urls["prefill"], urls["decode"])] == [0, 0]
    assert prefill["closes_total"] == 1 and prefill["references_dropped_total"] == 1 and prefill["open"] == 0
    assert decode["tagged_requests_total"] == 1 and decode["closes_total"] == 1

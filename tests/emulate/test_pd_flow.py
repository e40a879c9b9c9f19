"""A prefill and a decode emulator in-process, driven as the router drives them (tests/emulate/rig.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from basin_runtime.clock import ManualClock
from basin_runtime.tokenizer import DEFAULT_TOKENIZER, get_tokenizer
from tests.emulate.rig import Pair, free_port, pair, serving, tiny_profile_file

pytestmark = pytest.mark.asyncio

TOKENIZER = get_tokenizer(DEFAULT_TOKENIZER)
CHAT = "/v1/chat/completions"
FAST = ("--time-scale", "50", "--enable-cache-report", "--enable-metrics")


def conversation(task: str, turns: int, words: int = 400) -> list[dict[str, Any]]:
    """A coding-agent conversation: system prompt, task, then `turns` (answer, tool output) pairs."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful coding agent. " * 50},
                                      {"role": "user", "content": f"{task}: " + "fix the storage layer " * words}]
    for turn in range(turns):
        messages += [{"role": "assistant", "content": f"I will run step {turn}."},
                     {"role": "tool", "content": f"output of step {turn} " + "line of log " * words}]
    return messages


async def until(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds (the timeout guards against a hang only)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.002)


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_resent_longer_conversation_hits_the_first_prompt(tmp_path: Path) -> None:
    async with pair(*FAST) as p:
        first = await p.chat({"messages": conversation("task-a", 1)})
        second = await p.chat({"messages": conversation("task-a", 3)})
        third = await p.chat({"messages": conversation("task-b", 1)})  # same system prompt, another task

    assert first["usage"]["prompt_tokens"] == TOKENIZER.count_prompt(conversation("task-a", 1))
    assert cached(first) == 0
    # Everything the first call sent is cached (the generation prompt is not part of the conversation).
    # The whole first prompt is a prefix of the second: its generation prompt opens the assistant's answer.
    assert cached(second) == first["usage"]["prompt_tokens"]
    system_tokens = TOKENIZER.count_message(conversation("x", 0)[0])
    assert cached(third) == system_tokens  # the shared system prompt (the group) hits, the rest is new


async def test_a_rewritten_conversation_recomputes_instead_of_hitting() -> None:
    async with pair(*FAST) as p:
        await p.chat({"messages": conversation("task-c", 2)})
        rewritten = conversation("task-c", 3)
        rewritten[2] = {"role": "assistant", "content": "A different answer than the one that was cached."}
        answer = await p.chat({"messages": rewritten})
        again = await p.chat({"messages": [*rewritten, {"role": "user", "content": "and now?"}]})

    assert cached(answer) == TOKENIZER.count_message(rewritten[0])  # only the group: a new chain
    assert cached(again) == answer["usage"]["prompt_tokens"]  # the new chain is then extended as usual


async def test_eviction_under_a_tiny_pool_recomputes_and_takes_longer(tmp_path: Path) -> None:
    profile = str(tiny_profile_file(tmp_path))
    async with serving(["--role", "prefill", "--port", "1", "--disaggregation-bootstrap-port", str(free_port()),
                        "--profile", profile, "--max-total-tokens", "12000", "--time-scale", "20"]) as prefill:
        async def generate(text: str) -> dict[str, Any]:
            response = await prefill.http.post("/generate", json={"text": text, "sampling_params": {
                "max_new_tokens": 1}})
            assert response.status_code == 200, response.text
            meta: dict[str, Any] = response.json()["meta_info"]
            return meta

        base = "session A " + "alpha beta gamma delta " * 1000
        first = await generate(base)
        hit = await generate(base + " more " * 50)
        for other in ("session B ", "session C "):  # two other 4k-token sessions push A out of a 12k pool
            await generate(other + "epsilon zeta eta theta " * 1000)
        evicted = await generate(base + " more " * 100)

    assert first["cached_tokens"] == 0
    assert hit["cached_tokens"] >= first["prompt_tokens"] - 2  # BPE may merge at the seam
    assert evicted["cached_tokens"] < 200  # at most the 512-character group prefix
    # 4k tokens recomputed at 0.1 ms each against ~50 tokens: the evicted call takes far longer (model time).
    assert evicted["e2e_latency"] > 4 * hit["e2e_latency"]


async def test_two_concurrent_calls_on_one_conversation_queue_behind_each_other() -> None:
    async with serving(["--role", "prefill", "--port", "1", "--disaggregation-bootstrap-port", str(free_port()),
                        "--time-scale", "5", "--enable-cache-report"]) as prefill:
        body = {"messages": conversation("task-d", 2)}
        responses = await asyncio.gather(*(prefill.http.post(CHAT, json=body) for _ in range(2)))
        waits = prefill.role.engine.totals.chain_waits

    answers = [r.json() for r in responses]
    assert waits == 1
    # The second waited for the first and hit all of it but the last token, which is always computed.
    assert sorted(cached(a) for a in answers) == [0, answers[0]["usage"]["prompt_tokens"] - 1]


async def test_streamed_chat_sends_every_token_then_usage_with_cached_tokens() -> None:
    async with pair(*FAST) as p:
        await p.chat({"messages": conversation("task-e", 0)})
        _, decode = await p.send(CHAT, {"messages": conversation("task-e", 1), "stream": True, "max_tokens": 40,
                                        "stream_options": {"include_usage": True}, "rid": "stream-1"})

    assert decode.status_code == 200 and decode.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in decode.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"stream-1"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 40
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 40
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_generate_reports_prefills_cached_tokens_and_echoes_rid() -> None:
    async with pair("--time-scale", "50") as p:  # no cache report: OpenAI usage has no details
        text = "You are an agent. " * 100 + "Task: refactor. " * 300
        await p.send("/generate", {"text": text, "sampling_params": {"max_new_tokens": 5}})
        _, decode = await p.send("/generate", {"text": text + " tool says ok" * 20, "rid": "gen-7",
                                               "sampling_params": {"max_new_tokens": 5}})
        _, chat = await p.send(CHAT, {"messages": [{"role": "user", "content": "hi"}]})

    body = decode.json()
    assert body["meta_info"]["id"] == "gen-7"
    assert body["meta_info"]["cached_tokens"] >= TOKENIZER.count_text(text) - 2
    assert body["meta_info"]["completion_tokens"] == 5 and len(body["output_ids"]) == 5
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chat.json()["usage"]["prompt_tokens_details"] is None
    assert chat.json()["usage"]["completion_tokens"] == 64  # the default length when none is asked
    assert chat.json()["choices"][0]["finish_reason"] == "stop"


async def test_a_decode_request_without_bootstrap_fields_is_a_bad_request() -> None:
    async with serving(["--role", "decode", "--port", "1"]) as decode:
        response = await decode.http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert "bootstrap_room" in response.json()["message"]


async def test_a_prefill_server_alone_serves_prefill_only_requests() -> None:
    async with serving(["--role", "prefill", "--port", "1", "--disaggregation-bootstrap-port", str(free_port()),
                        "--time-scale", "50", "--enable-cache-report"]) as pre:
        response = await pre.http.post(CHAT, json={"messages": conversation("alone", 0)})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 1


async def test_when_the_peer_never_shows_both_halves_answer_500_and_give_back_memory() -> None:
    wall = ManualClock()  # both servers' wall clock: the bootstrap timeout passes only as the test moves it
    timeout = ("--bootstrap-timeout", "0.3", "--time-scale", "50")
    async with pair(*timeout, wall=wall) as p:
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.prefill.config.bootstrap_port}
        body = {"messages": [{"role": "user", "content": "lonely " * 100}], **room}
        rooms = p.prefill.role.rooms
        started = wall.now()
        both = asyncio.ensure_future(asyncio.gather(
            p.decode.http.post(CHAT, json={**body, "bootstrap_room": 1_000_001}),
            p.prefill.http.post(CHAT, json={**body, "bootstrap_room": 1_000_002})))
        # both halves wait: the prefill half for its decode, the decode half's POST (across TCP) for the KV
        await until(lambda: rooms.num_waiting_ready == 1 and len(rooms) == 2 and rooms.get("1000001").ready.is_set())
        wall.advance(0.29)
        await wall.settle()
        assert rooms.num_waiting_ready == 1 and len(rooms) == 2 and not both.done()  # still waiting at 0.29 s
        await wall.drive(both, until_s=started + 0.3)  # the bootstrap timeout: both halves give up
        decode_alone, prefill_alone = await asyncio.wait_for(both, 60)
        assert wall.now() == started + 0.3  # failed at the timeout, on the clock (not the decode's own, later one)
        decode_engine, prefill_engine = p.decode.role.engine, p.prefill.role.engine
        assert decode_engine.instance.used_tokens() == 0 and decode_engine.is_idle
        assert prefill_engine.cache.pinned_tokens == 0 and prefill_engine.is_idle

    assert decode_alone.status_code == 500 and "1000001" in decode_alone.json()["message"]
    assert "published nothing for room 1000001 within 0.3 s" in decode_alone.json()["message"]
    assert prefill_alone.status_code == 500
    assert "no decode server connected to bootstrap room 1000002 within 0.3 s" in prefill_alone.json()["message"]


async def test_a_decode_whose_prefill_is_unreachable_fails_at_once() -> None:
    async with serving(["--role", "decode", "--port", "1", "--time-scale", "50"]) as decode:
        body = {"messages": [{"role": "user", "content": "hi"}], "bootstrap_host": "127.0.0.1",
                "bootstrap_port": 9, "bootstrap_room": 5}
        response = await decode.http.post(CHAT, json=body)
        assert decode.role.engine.instance.used_tokens() == 0
    assert response.status_code == 500 and "cannot reach" in response.json()["message"]


async def _run(p: Pair, n: int) -> None:
    for k in range(n):
        await p.chat({"messages": conversation(f"metrics-{k}", 1, words=50), "max_tokens": 8})


async def test_metrics_carry_sglangs_names_and_move() -> None:
    async with pair(*FAST) as p:
        before = (await p.prefill.http.get("/metrics")).text
        await _run(p, 2)
        prefill_text = (await p.prefill.http.get("/metrics")).text
        decode_text = (await p.decode.http.get("/metrics")).text

    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_used_tokens",
             "sglang:max_total_num_tokens", "sglang:cache_hit_rate", "sglang:num_prefill_bootstrap_queue_reqs",
             "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
             "sglang:num_decode_transfer_queue_reqs", "sglang:time_to_first_token_seconds_bucket",
             "sglang:inter_token_latency_seconds_bucket", "sglang:e2e_request_latency_seconds_bucket",
             "basin_emulate_lag_seconds_bucket", "basin_emulate_time_scale", "basin_emulate_lag_window_seconds")
    for name in names:
        assert f"\n{name}" in prefill_text and f"\n{name}" in decode_text, name

    def value(text: str, line_start: str) -> float:
        (line,) = [line for line in text.splitlines() if line.startswith(line_start)]
        return float(line.rsplit(" ", 1)[1])

    computed = 'sglang:prefill_effective_tokens_total{mode="input"'
    assert value(before, computed) == 0 < value(prefill_text, computed)
    assert value(prefill_text, 'sglang:prefill_effective_tokens_total{mode="device_hit"') > 0  # the system prompt
    assert value(prefill_text, 'sglang:cached_tokens_total{cache_source="device"') > 0
    assert value(prefill_text, "sglang:prompt_tokens_total") == value(decode_text, "sglang:prompt_tokens_total") > 0
    assert value(decode_text, "sglang:generation_tokens_total") == 16
    assert value(decode_text, "sglang:e2e_request_latency_seconds_count") == 2
    assert value(decode_text, "basin_emulate_time_scale") == 50


async def test_a_request_decode_refuses_fails_its_prefill_half_at_once() -> None:
    wall = ManualClock()  # never moved: whatever fails, fails without waiting for a timeout
    async with pair("--time-scale", "50", "--bootstrap-timeout", "30", decode_extra=("--max-total-tokens", "500"),
                    wall=wall) as p:
        started = wall.now()
        sent = p.send(CHAT, {"messages": [{"role": "user", "content": "too long " * 400}]})
        prefill, decode = await asyncio.wait_for(sent, 60)  # a guard against a hang only
        assert len(p.prefill.role.rooms) == 1  # kept (with its failure) until it expires
    assert decode.status_code == 400 and "max_total_num_tokens=500" in decode.json()["message"]
    assert prefill.status_code == 500 and "refused the request" in prefill.json()["message"]
    assert wall.now() == started  # at once: not at the 30 s bootstrap timeout (no time passed on the clock)


async def test_completions_answer_streamed_and_not() -> None:
    async with pair("--time-scale", "50", "--enable-cache-report") as p:
        _, plain = await p.send("/v1/completions", {"prompt": "def main():\n" * 200, "max_tokens": 6})
        _, streamed = await p.send("/v1/completions", {"prompt": "def main():\n" * 220, "max_tokens": 6,
                                                       "stream": True, "stream_options": {"include_usage": True}})
        _, ids = await p.send("/v1/completions", {"prompt": list(range(300)), "max_tokens": 2})
        assert len(p.prefill.role.rooms) == 0  # every room was read by its decode half

    body = plain.json()
    assert body["object"] == "text_completion" and len(body["choices"][0]["text"].split()) == 6
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line and "[DONE]" not in line]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).split() == \
        body["choices"][0]["text"].split()
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= body["usage"]["prompt_tokens"] - 2
    assert ids.json()["usage"]["prompt_tokens"] == 300

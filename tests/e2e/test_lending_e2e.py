"""Issue 21's acceptance: lending on stock SGLang's flags, end to end through the real router.

The official `openai` client -> basin-gateway -> `smg` 1.13 (PD, --sticky-sessions) -> one emulated
prefill and two emulated decodes sharing one storage folder (`SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`),
started with the recipe's flags (rig/basin_stack/lending.py). Two stacks: decode with the offload flag, and
the same stack without it. A session's second call, sent after prefill's cache was flushed
(`/flush_cache`), must report cached tokens that came from storage (`cache_source="storage"` on
prefill's /metrics) covering its first call's answer, and must be served by the decode instance that
served its first call; without the offload flag that answer, which only decode held, is recomputed.
Concurrent sessions' calls carry at most the gateway's configured number of priority values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from basin_runtime.gateway.priority import PriorityLevels
from basin_stack import lending
from basin_stack.stack import LocalStack, StackSpec

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "h100-qwen3.6-35b-a3b"  # the emulators' served name: the profile's
NUM_LEVELS = 4
ANSWER_TOKENS = 400  # far more than a page (64) and than the prefetch threshold (256)
GATEWAY = {"model": str(ROOT / "models" / "peak_predictor.onnx"), "budget_tokens": 1_000_000_000,
           "engine_priority_levels": NUM_LEVELS, "upstream_timeout_s": 60, "log_level": "warning"}


def _stack(folder: Path, with_offload: bool) -> LocalStack:
    storage = folder / "storage"
    storage.mkdir(parents=True)
    return LocalStack(StackSpec(folder / "logs", num_prefill=1, num_decode=2, time_scale=1.0,
                                max_total_tokens=400_000, gateway=GATEWAY, prefill_args=lending.prefill_args(),
                                decode_args=lending.decode_args(with_offload), engine_env=lending.storage_env(storage),
                                router_args=lending.SMG_ARGS))


@pytest.fixture(scope="module")
def offload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with _stack(tmp_path_factory.mktemp("lending-on"), with_offload=True) as stack:
        yield stack


@pytest.fixture(scope="module")
def no_offload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with _stack(tmp_path_factory.mktemp("lending-off"), with_offload=False) as stack:
        yield stack


def _client(stack: LocalStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)


def _opening(task: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a coding agent. " * 200},
            {"role": "user", "content": f"{task}: " + "fix the failing test in the storage layer " * 150}]


async def _call(api: openai.AsyncOpenAI, session: str, messages: list[dict[str, Any]]) -> tuple[str, str, int, int]:
    """(answer text, decode worker that served it, prompt tokens, cached tokens) of one chat call."""
    raw = await api.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=ANSWER_TOKENS,  # type: ignore[arg-type]
        extra_headers={"X-Session-ID": session})
    reply = raw.parse()
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content or "", raw.headers["x-smg-routed-worker-id"], reply.usage.prompt_tokens, \
        cached


def _counters(url: str) -> dict[str, float]:
    """Every counter sample of an engine's /metrics by name and its interesting label."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = sample.labels.get("cache_source") or sample.labels.get("mode") or sample.labels.get("priority")
            out[f"{sample.name}{{{label}}}" if label is not None else sample.name] = sample.value
    return out


async def _second_call_after_flush(stack: LocalStack, session: str) -> dict[str, Any]:
    """Call 1, flush prefill, call 2 (the conversation with call 1's answer and a tool result)."""
    prefill = stack.prefill_urls[0]
    async with _client(stack) as api:
        messages = _opening(session)
        answer, first_decode, first_prompt, _ = await _call(api, session, messages)
        flushed = httpx.post(f"{prefill}/flush_cache", timeout=5)
        assert flushed.status_code == 200, flushed.text
        before = _counters(prefill)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "the test passes now"}]
        _, second_decode, second_prompt, cached = await _call(api, session, messages)
        after = _counters(prefill)
    return {"first_decode": first_decode, "second_decode": second_decode, "first_prompt": first_prompt,
            "second_prompt": second_prompt, "cached": cached,
            "storage": after.get("sglang:cached_tokens_total{storage}", 0.0)
            - before.get("sglang:cached_tokens_total{storage}", 0.0),
            "computed": after["sglang:prefill_effective_tokens_total{input}"]
            - before["sglang:prefill_effective_tokens_total{input}"]}


async def test_after_a_prefill_flush_the_second_call_reads_its_first_answer_from_storage_on_the_same_decode(
        offload: LocalStack) -> None:
    seen = await _second_call_after_flush(offload, "lend-on")
    assert seen["second_decode"] == seen["first_decode"] and seen["first_decode"] in offload.decode_urls
    # storage held call 1's prompt (prefill's backup) and its answer (decode's offload), in 64-token pages
    assert seen["storage"] == seen["cached"] > seen["first_prompt"] + ANSWER_TOKENS // 2, seen
    assert seen["computed"] < seen["second_prompt"] - seen["first_prompt"], seen  # the answer was not recomputed
    backed_up = _counters(offload.decode_urls[0])["sglang:backuped_tokens_total"] \
        + _counters(offload.decode_urls[1])["sglang:backuped_tokens_total"]
    assert backed_up >= ANSWER_TOKENS - 64


async def test_without_the_offload_flag_the_answer_only_decode_held_is_recomputed(no_offload: LocalStack) -> None:
    seen = await _second_call_after_flush(no_offload, "lend-off")
    assert seen["second_decode"] == seen["first_decode"]  # sticky all the same
    assert 0 < seen["storage"] == seen["cached"] <= seen["first_prompt"], seen  # prefill's own backup only
    # everything past call 1's prompt pages is computed: call 1's answer (~400 tokens) and the new message
    assert seen["computed"] == seen["second_prompt"] - seen["cached"] > ANSWER_TOKENS, seen


async def test_concurrent_sessions_stay_on_their_decode_and_carry_at_most_the_configured_priority_values(
        offload: LocalStack) -> None:
    async with _client(offload) as api:
        async def session(k: int) -> set[str]:
            messages = _opening(f"levels {k}")
            served = set()
            for turn in range(3):
                answer, decode, _, _ = await _call(api, f"levels-{k}", messages)
                served.add(decode)
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"step {turn} ok"}]
            return served

        served = await asyncio.gather(*(session(k) for k in range(8)))
    assert all(len(decodes) == 1 for decodes in served), served  # every session stuck to one decode instance
    allowed = {str(v) for v in PriorityLevels(NUM_LEVELS).values()}
    labels = {key.split("{")[1].rstrip("}") for url in offload.engine_urls
              for key in _counters(url) if key.startswith("sglang:num_requests_total{")}
    assert labels <= allowed and len(labels) >= 2, labels  # several levels in use, never more than configured

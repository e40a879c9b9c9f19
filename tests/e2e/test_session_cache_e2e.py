"""The session radix cache through the whole chain: the official `openai` client -> basin-gateway
(`engine_session_cache`) -> smg 1.13 (PD) -> a prefill and a decode emulator with `--enable-session-radix-cache`
(the prefill in mode true, so its references show).

The gateway tags the session's calls with its routing key (smg forwards the tag to both engines); ending the
session makes the gateway POST /close_session to each engine itself (smg routes none). What the engines did is
read from their `basin_emulate_session_*` counters.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from basin_stack.stack import LocalStack, StackSpec

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "h100-qwen3.6-35b-a3b"  # the emulators' served name: the profile's
GATEWAY = {"model": str(ROOT / "models" / "peak_predictor.onnx"), "budget_tokens": 1_000_000_000,
           "engine_session_cache": True, "log_level": "warning"}
SESSION_FLAGS = ("--enable-session-radix-cache", "--radix-eviction-policy", "priority")
HANG_GUARD_S = 30.0  # only so a lost close fails instead of hanging; never what the test asserts


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    spec = StackSpec(tmp_path_factory.mktemp("session-cache") / "logs", num_prefill=1, num_decode=1, time_scale=1.0,
                     max_total_tokens=400_000, gateway=GATEWAY, emulator_args=SESSION_FLAGS,
                     prefill_args=("--session-radix-cache-mode", "true"))
    with LocalStack(spec) as running:
        yield running


def session_counts(engine: str) -> dict[str, float]:
    text = httpx.get(f"{engine}/metrics", timeout=5).text
    return {s.name.removeprefix("basin_emulate_session_"): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith("basin_emulate_session_")}


async def test_the_gateway_tags_a_sessions_calls_on_both_engines_and_closes_it_on_each_at_its_end(
        stack: LocalStack) -> None:
    messages = [{"role": "system", "content": "You are a coding agent. " * 50},
                {"role": "user", "content": "fix the failing test " * 50}]
    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="e2e", max_retries=0, timeout=60) as api:
        await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                          extra_headers={"X-Session-ID": "e2e-session"})
    (prefill,), (decode,) = stack.prefill_urls, stack.decode_urls
    live = session_counts(prefill)
    ended = httpx.post(f"{stack.base_url}/basin/sessions/e2e-session/end", timeout=10)
    deadline = time.monotonic() + HANG_GUARD_S
    while session_counts(prefill)["closes_total"] < 1 or session_counts(decode)["closes_total"] < 1:
        assert time.monotonic() < deadline, "the gateway's /close_session never reached both engines"
        time.sleep(0.05)
    after, on_decode = session_counts(prefill), session_counts(decode)
    gateway_metrics = httpx.get(f"{stack.base_url}/metrics", timeout=5).text

    assert ended.status_code == 200
    assert live["tagged_requests_total"] == 1 and live["references_taken_total"] == 1 and live["open"] == 1
    assert after["closes_total"] == 1 and after["references_dropped_total"] == 1 and after["open"] == 0
    assert on_decode["tagged_requests_total"] == 1 and on_decode["closes_total"] == 1
    assert "basin_engine_session_close_failures_total{" not in gateway_metrics  # no engine refused a close

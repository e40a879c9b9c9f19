"""The storage tier of stock SGLang's lending (basin_sim/storage.py) and the engine's `storage-offload` switch."""

from __future__ import annotations

import math

import pytest

from basin_sim.engine import Engine
from basin_sim.lifecycle import Status
from basin_sim.policies.fcfs import FcfsPolicy
from basin_sim.storage import (
    StorageTier,
    decode_offload_range,
    offload_stride_tokens,
    prefetch_wait_s,
    storage_hit_tokens,
)
from tests.sim.builders import deployment, session, spec, with_profile


def test_decode_offloads_the_prompt_tail_and_the_answer_but_the_last_token_in_whole_strides() -> None:
    # prompt 1,000 tokens, page 64: prefill's pages end at 960; decode offloads [960, 1,000 + 300 - 1) in strides
    assert decode_offload_range(1_000, 300, 64, 64) == (960, 960 + 320)  # 339 tokens -> 5 pages
    assert decode_offload_range(1_000, 300, 64, offload_stride_tokens(64, 200)) == (960, 960 + 192)  # stride 192
    assert decode_offload_range(1_000, 1, 64, 64) == (960, 960)  # one output token: only the prompt tail, < a page
    assert offload_stride_tokens(64, None) == offload_stride_tokens(64, 0) == 64 and offload_stride_tokens(64, 10) == 64


def test_a_storage_hit_is_whole_pages_after_the_cached_part_and_at_least_the_prefetch_threshold() -> None:
    assert storage_hit_tokens(stored_end=1_280, cached_tokens=960, prompt_tokens=2_000, page_tokens=64) == 320
    assert storage_hit_tokens(1_280, 1_100, 2_000, 64) == 0  # 180 tokens past the hit: revoked (< 256)
    assert storage_hit_tokens(1_280, 0, 200, 64) == 0  # the uncached part is under the threshold: not looked up
    assert storage_hit_tokens(1_280, 0, 1_280, 64) == 1_216  # never the last prompt token: its page is computed
    assert prefetch_wait_s("best_effort", 3.0, 10_000) == 0.0 and prefetch_wait_s("wait_complete", 3.0, 10) == 3.0
    assert prefetch_wait_s("timeout", 30.0, 4_096) == pytest.approx(2.0)  # 1 s + 0.25 s per 1,024 tokens


def test_the_tier_keeps_one_contiguous_run_per_conversation() -> None:
    tier = StorageTier(page_tokens=64)
    tier.offload_answer("a", 1_000, 300)  # the prompt's pages are not there: the answer's cannot be reached
    assert tier.stored_end.get("a", 0) == 0
    tier.backup_prompt("a", 1_000)
    tier.offload_answer("a", 1_000, 300)
    assert tier.stored_end["a"] == 1_280 and tier.backed_up_tokens == 1_280
    assert tier.hit("a", cached_tokens=0, prompt_tokens=1_500) == 1_280


@pytest.mark.parametrize("lending", ["none", "storage-offload"])
def test_after_prefill_lost_it_the_second_call_reads_its_first_calls_prompt_and_answer_from_storage(
        lending: str) -> None:
    """Prefill's cache (5,000) cannot keep both sessions: without storage b's second call recomputes its
    history; with storage-offload it computes only what storage did not hold (its new tokens)."""
    d = deployment(with_profile(storage_load_bytes_per_s=1e9), cache_tokens=5_000, lending=lending)  # type: ignore[arg-type]
    engine = Engine(d, FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [3_000, 3_500], completion=300, gap_s=5.0), 0.0))
    engine.add(spec(session("b", [3_000, 3_800], completion=300, gap_s=5.0), 0.5))
    computed = {}
    original = engine.prefill[0].finish_batch

    def record() -> list:  # type: ignore[type-arg]
        for job, tokens in engine.prefill[0].batch.parts:  # type: ignore[union-attr]
            computed[(job.session_key, job.prompt_tokens)] = computed.get((job.session_key, job.prompt_tokens), 0) \
                + tokens
        return original()

    engine.prefill[0].finish_batch = record  # type: ignore[method-assign]
    engine.run_until(math.inf)
    engine.check()
    assert all(run.status == Status.FINISHED for run in engine.runs.values())
    if lending == "none":
        assert engine.storage is None and computed[("a", 3_500)] == 3_500 - 500  # all but the shared 500 tokens
    else:
        assert engine.storage is not None
        # storage held a's prompt and answer (3,000 + 299 -> whole pages to 3,264): only the rest is computed
        assert computed[("a", 3_500)] == 3_500 - 3_264
        assert engine.storage.stored_end["b"] == 4_096  # b's last prompt (3,776) and its answer (to 4,099): pages

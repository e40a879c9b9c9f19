"""The gateway's memory of finished tasks (basin_runtime/gateway/task_memory.py), in process on the ManualClock."""

from __future__ import annotations

import math
import uuid

import pytest
from prometheus_client import CollectorRegistry

from basin_runtime.gateway.task_memory import GatewayTaskMemory
from basin_runtime.state.redis_backend import redis_client
from basin_runtime.state.task_peaks import RedisTaskPeaks
from basin_runtime.task_memory import Shrinkage, shrunk_peak
from basin_stack.stack import free_port
from tests.redis_server import RedisServer
from tests.runtime.test_gateway_app import TOKENIZER, StubModel, conversation, rig_for

pytestmark = pytest.mark.asyncio
K = 1.0
PREDICTED = 1_000.0


async def test_a_new_session_is_told_its_prediction_shrunk_toward_its_tasks_finished_peaks() -> None:
    registry = CollectorRegistry()
    memory = GatewayTaskMemory(Shrinkage(K), registry)
    async with rig_for(model=StubModel(default=PREDICTED), gateway_options={"task_memory": memory}) as rig:
        registry_of = rig.gateway.room.registry
        assert (await rig.chat("a", "Fix the bug")).status_code == 200
        peak_a = TOKENIZER.count_prompt(conversation("Fix the bug"))
        assert registry_of.get("a").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        assert (await rig.chat("b", "fix  the\nBUG")).status_code == 200  # a is still live: nothing remembered
        assert registry_of.get("b").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        rig.clock.advance(5.0)
        assert (await rig.client.post("/basin/sessions/a/end")).status_code == 200
        rig.clock.advance(1.0)
        assert (await rig.chat("c", "FIX THE BUG")).status_code == 200
        want = shrunk_peak(PREDICTED, [float(peak_a)], K)
        assert want != PREDICTED
        assert math.isclose(registry_of.get("c").predicted_peak_tokens, want)  # type: ignore[union-attr]
        assert (await rig.chat("d", "Write a parser")).status_code == 200  # another task
        assert registry_of.get("d").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
    assert registry.get_sample_value("basin_task_memory_sessions_total") == 4
    assert registry.get_sample_value("basin_task_memory_hits_total") == 1
    assert registry.get_sample_value("basin_task_memory_recorded_total") >= 1


async def test_a_session_that_did_not_run_to_its_end_is_not_remembered() -> None:
    registry = CollectorRegistry()
    memory = GatewayTaskMemory(Shrinkage(K), registry)
    async with rig_for(model=StubModel(default=PREDICTED), gateway_options={"task_memory": memory}) as rig:
        assert (await rig.chat("a", "Fix the bug")).status_code == 200
        entry = rig.gateway.room.registry.get("a")
        assert entry is not None
        memory.session_ended(entry, "withdrawn", rig.clock.wall() - 1.0)
        memory.session_ended(entry, "shutdown", rig.clock.wall() - 1.0)
        rig.clock.advance(1.0)
        assert (await rig.chat("b", "Fix the bug")).status_code == 200
        assert rig.gateway.room.registry.get("b").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        memory.session_ended(entry, "ended", rig.clock.wall())
        rig.clock.advance(1.0)
        assert (await rig.chat("c", "Fix the bug")).status_code == 200
        assert rig.gateway.room.registry.get("c").predicted_peak_tokens != PREDICTED  # type: ignore[union-attr]


# --- replicas: the peaks in the shared Redis -----------------------------------------------------


def _shared(server: RedisServer, prefix: str, **bounds: int) -> RedisTaskPeaks:
    return RedisTaskPeaks(redis_client(server.url, socket_timeout=5, socket_connect_timeout=5), prefix=prefix,
                          **bounds)


async def test_a_session_ended_on_one_replica_shrinks_the_next_one_of_its_task_on_another(
        redis_server: RedisServer) -> None:
    prefix = f"memory-{uuid.uuid4().hex[:10]}"
    store_a, store_b = _shared(redis_server, prefix), _shared(redis_server, prefix)
    registry_a, registry_b = CollectorRegistry(), CollectorRegistry()
    memory_a = GatewayTaskMemory(Shrinkage(K), registry_a, store_a)
    memory_b = GatewayTaskMemory(Shrinkage(K), registry_b, store_b)
    async with rig_for(model=StubModel(default=PREDICTED), gateway_options={"task_memory": memory_a}) as a, \
            rig_for(model=StubModel(default=PREDICTED), gateway_options={"task_memory": memory_b}) as b:
        assert (await a.chat("s1", "Fix the bug")).status_code == 200
        a.clock.advance(5.0)
        assert (await a.client.post("/basin/sessions/s1/end")).status_code == 200
        await store_a.flush()
        assert (await b.chat("s2", "fix the BUG")).status_code == 200  # a ended after b's now: not counted
        assert b.gateway.room.registry.get("s2").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        b.clock.advance(6.0)
        assert (await b.chat("s3", "fix the BUG")).status_code == 200
        peak = float(TOKENIZER.count_prompt(conversation("Fix the bug")))
        told = b.gateway.room.registry.get("s3").predicted_peak_tokens  # type: ignore[union-attr]
        assert math.isclose(told, shrunk_peak(PREDICTED, [peak], K))
    await memory_a.aclose()
    await memory_b.aclose()
    assert registry_b.get_sample_value("basin_task_memory_hits_total") == 1
    assert registry_a.get_sample_value("basin_task_memory_recorded_total") == 1


async def test_the_shared_memory_keeps_the_newest_peaks_of_the_most_recent_tasks(redis_server: RedisServer) -> None:
    store = _shared(redis_server, f"memory-{uuid.uuid4().hex[:10]}", max_peaks_per_task=2, max_tasks=2)
    errors: list[int] = []
    try:
        for k, peak in enumerate((10.0, 20.0, 30.0)):  # made at once: sent in this order
            store.record("t1", f"s{k}", peak, float(k), lambda: errors.append(1))
        await store.flush()
        assert await store.peaks("t1", 99.0) == [20.0, 30.0]
        assert await store.peaks("t1", 2.0) == [20.0]  # only those that ended before
        store.record("t2", "x", 5.0, 3.0, lambda: errors.append(1))
        await store.flush()
        store.record("t1", "s3", 40.0, 4.0, lambda: errors.append(1))
        await store.flush()
        store.record("t3", "y", 7.0, 5.0, lambda: errors.append(1))  # t2, recorded least recently, goes
        await store.flush()
        assert await store.peaks("t2", 99.0) == []
        assert await store.peaks("t1", 99.0) == [30.0, 40.0]
        assert await store.client.exists(store.key("t2")) == 0
        assert await store.client.zcard(store.tasks_key) == 2
        await store.client.rpush(store.key("t3"), "not json")
        assert await store.peaks("t3", 99.0) == [7.0]  # a malformed item is skipped
        assert errors == []
    finally:
        await store.aclose()


async def test_a_store_out_of_reach_tells_the_prediction_alone_and_counts_it() -> None:
    store = RedisTaskPeaks(redis_client(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=1,
                                        socket_connect_timeout=1))
    registry = CollectorRegistry()
    memory = GatewayTaskMemory(Shrinkage(K), registry, store)
    async with rig_for(model=StubModel(default=PREDICTED), gateway_options={"task_memory": memory}) as rig:
        assert (await rig.chat("a", "Fix the bug")).status_code == 200
        assert rig.gateway.room.registry.get("a").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        assert (await rig.client.post("/basin/sessions/a/end")).status_code == 200
    await memory.aclose()
    assert registry.get_sample_value("basin_task_memory_errors_total") == 2  # the lookup and the record

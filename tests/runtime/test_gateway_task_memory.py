"""The gateway's memory of finished tasks (basin_runtime/gateway/task_memory.py), in process on the ManualClock."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from basin_runtime.gateway.task_memory import GatewayTaskMemory
from basin_runtime.task_memory import Shrinkage, shrunk_peak
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
        memory.session_ended(entry, "withdrawn", rig.clock.now() - 1.0)
        memory.session_ended(entry, "shutdown", rig.clock.now() - 1.0)
        rig.clock.advance(1.0)
        assert (await rig.chat("b", "Fix the bug")).status_code == 200
        assert rig.gateway.room.registry.get("b").predicted_peak_tokens == PREDICTED  # type: ignore[union-attr]
        memory.session_ended(entry, "ended", rig.clock.now())
        rig.clock.advance(1.0)
        assert (await rig.chat("c", "Fix the bug")).status_code == 200
        assert rig.gateway.room.registry.get("c").predicted_peak_tokens != PREDICTED  # type: ignore[union-attr]

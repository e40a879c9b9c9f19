"""Recovery at tool boundaries in the gateway (`recovery_holds.py`): a session the policy holds has its next call
held before it is forwarded, is closed on the engines while held (`engine_session_cache`), and its call goes on
once the policy resumes it; a held session that ends gets its call answered, not dropped."""

from __future__ import annotations

import asyncio

import pytest

from basin_runtime.gateway.priority import routing_key
from basin_runtime.policy import Held, Resumed
from basin_runtime.state.steps import Step
from tests.runtime.test_gateway_app import Rig, eventually
from tests.runtime.test_gateway_engine_sessions import ENGINES, FakeEngines, tagging_rig
from tests.runtime.test_gateway_ops import scrape

pytestmark = pytest.mark.asyncio
OFF, ON = 0.5, 0.95  # under and over the configured plateau's floor (0.9 - 0.05)
FIXED_BUDGET = {"budget_min_fraction": 1.0, "budget_max_fraction": 1.0}


async def tick(rig: Rig, hit_rate: float) -> list[object]:
    """A policy tick with this hit rate, through the room's backend (its events reach the room's listener)."""
    rig.clock.advance(10)
    return list(await rig.gateway.room.backend.step(Step("tick", None, (hit_rate, None), rig.clock.now())))


async def collapse(rig: Rig) -> None:
    """Two sessions live, the budget set just under their working set, then two ticks off the plateau: s2 held."""
    assert (await rig.chat("s1", "task one")).status_code == 200
    assert (await rig.chat("s2", "task two")).status_code == 200
    await rig.gateway.room.set_budget(rig.policy.snapshot().working_set_tokens - 1)
    assert not any(isinstance(e, Held) for e in await tick(rig, OFF))  # one tick off is not a knee
    assert [e.session_id for e in await tick(rig, OFF) if isinstance(e, Held)] == ["s2"]  # the later: lower priority


async def test_a_held_sessions_next_call_waits_closed_on_the_engines_until_it_is_resumed() -> None:
    engines = FakeEngines()
    async with tagging_rig(engines, **FIXED_BUDGET) as (rig, closer):
        await collapse(rig)
        call = asyncio.create_task(rig.chat("s2", "task two", "more"))
        await eventually(lambda: len(engines.closes) == len(ENGINES))  # closed once, when its call is held
        assert [body for _, body in engines.closes] == [{"session_id": routing_key("s2")}] * len(ENGINES)
        assert len(rig.upstream.bodies()) == 2 and not call.done()  # held before it is forwarded
        assert not any(isinstance(e, Resumed) for e in await tick(rig, ON) + await tick(rig, ON))  # s1 fills it
        assert not call.done()
        assert (await rig.client.post("/basin/sessions/s1/end")).status_code == 200
        metrics = await scrape(rig)
        assert (metrics["basin_recovery_holds_total"], metrics["basin_recovery_held_sessions"]) == (1, 1)
        assert metrics["basin_recovery_hold_seconds_count"] == 0
        assert [e.session_id for e in await tick(rig, ON) if isinstance(e, Resumed)] == ["s2"]  # it runs alone now
        metrics = await scrape(rig)
        assert (metrics["basin_recovery_held_sessions"], metrics["basin_recovery_hold_seconds_count"]) == (0, 1)
        assert metrics["basin_recovery_hold_seconds_sum"] == 30  # held at the second tick off, resumed 3 ticks on
        response = await asyncio.wait_for(call, timeout=5)
        assert response.status_code == 200 and len(rig.upstream.bodies()) == 3
        assert rig.upstream.bodies()[-1]["session_id"] == routing_key("s2")  # the tag reopens on the engines
        await closer.aclose()
    assert len(engines.closes) == 2 * len(ENGINES)  # and at its end (the rig's shutdown), once more


async def test_a_held_session_ended_meanwhile_answers_its_waiting_call() -> None:
    async with tagging_rig(FakeEngines(), **FIXED_BUDGET) as (rig, _):
        await collapse(rig)
        call = asyncio.create_task(rig.chat("s2", "task two", "more"))
        await eventually(lambda: (e := rig.gateway.room.registry.get("s2")) is not None
                         and e.is_engine_session_closed)
        assert (await rig.client.post("/basin/sessions/s2/end")).status_code == 200
        response = await asyncio.wait_for(call, timeout=5)
        assert response.status_code == 409 and len(rig.upstream.bodies()) == 2


async def test_with_recovery_off_nobody_is_held() -> None:
    async with tagging_rig(FakeEngines(), recovery=False, **FIXED_BUDGET) as (rig, _):
        assert (await rig.chat("s1", "task one")).status_code == 200
        assert (await rig.chat("s2", "task two")).status_code == 200
        await rig.gateway.room.set_budget(rig.policy.snapshot().working_set_tokens - 1)
        assert not any(isinstance(e, Held) for e in await tick(rig, OFF) + await tick(rig, OFF))
        assert (await rig.chat("s2", "task two", "more")).status_code == 200

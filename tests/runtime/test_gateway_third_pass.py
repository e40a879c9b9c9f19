"""Issue 46, the gateway's third pass: each defect the outside attack found, through the real app.

- item 1: a later call that outgrows its session's reservation while admission is engaged waits in the queue by its
  session's priority (the two-step attack); the reserved total never passes the budget but for a lone head;
- item 2: a session id names one conversation: a call that does not keep its first messages (a ride), or comes
  with another API key, is a session of its own (`--foreign-call new-session`) or a JSON 409 (`refuse`); after a
  restart, a stranger leaves the listed entry alone, and an adopted session's resumed call is held to what fits;
- item 4: ending a session with a key that is not its own gets one answer, held or not;
- item 6: every copy of a client's `rid` and `priority` is cut out of the forwarded bytes.
The slow-client limits (item 3) and the cut non-streamed answer (item 5) run against a real server
(test_gateway_slow_clients.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from basin_runtime.gateway.priority import routing_key
from basin_runtime.gateway.restart import LiveSessions, LiveSessionsFile
from basin_runtime.session_keys import SESSION_KEY_HEADER
from basin_runtime.session_log import LoggedCall
from tests.runtime.test_gateway_app import CHAT, RawCall, conversation, eventually, rig_for
from tests.runtime.test_gateway_restart import list_live, live_session, restart_rig

pytestmark = pytest.mark.asyncio

FILLER = "word " * 3000  # ~3k tokens a turn


def made_up_history(task: str, turns: int) -> list[dict[str, str]]:
    """A conversation that starts with `task` and carries `turns` made-up exchanges of ~3k tokens each."""
    messages = [{"role": "user", "content": task}]
    for _ in range(turns):
        messages += [{"role": "assistant", "content": FILLER}, {"role": "user", "content": FILLER}]
    return messages


async def views(rig: Any) -> dict[str, dict[str, Any]]:
    return {v["session_id"]: v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]}


# --- item 1: the two-step attack -----------------------------------------------------------------------------


async def test_a_later_call_past_its_reservation_waits_in_the_queue_and_the_budget_holds() -> None:
    # The attack scaled down: each attacker's first call is tiny (predicted 1,000 tokens), its second
    # carries ~15k made-up tokens; the budget is 20k, admission always engaged.
    async with rig_for(budget_tokens=20_000, always_engaged=True) as rig:
        assert (await rig.chat("owner", "the owner's task")).status_code == 200
        for k in range(4):
            assert (await rig.chat(f"a{k}", f"attack {k}")).status_code == 200
        assert rig.policy.snapshot().reserved_tokens == 5_000
        reserved_seen: list[int] = []

        async def second_call(k: int) -> httpx.Response:
            return await rig.client.post(CHAT, json={"messages": made_up_history(f"attack {k}", 2)},
                                         headers={"X-Session-ID": f"a{k}"})

        calls = [asyncio.create_task(second_call(k)) for k in range(4)]
        await eventually(lambda: len(rig.policy.snapshot().queued) >= 3)
        snapshot = rig.policy.snapshot()
        reserved_seen.append(snapshot.reserved_tokens)
        held = await views(rig)
        assert snapshot.reserved_tokens <= 20_000, snapshot
        queued = [sid for sid, v in held.items() if v["state"] == "queued"]
        assert queued and all(held[sid]["is_held_for_growth"] for sid in queued)
        assert all(held[sid]["reserved_tokens"] > 12_000 for sid in queued)  # context + predicted growth
        forwarded = len(rig.upstream.bodies())
        assert forwarded == 5 + (4 - len(queued))  # the held calls were not forwarded
        for sid in [*held]:  # the others end: each held call goes in when it fits, alone at worst
            if sid not in queued:
                assert (await rig.client.post(f"/basin/sessions/{sid}/end")).status_code == 200
                reserved_seen.append(rig.policy.snapshot().reserved_tokens)
        for sid in queued:
            await eventually(lambda s=sid: rig.policy.is_live(s))  # type: ignore[misc]
            live = rig.policy.snapshot().live
            assert len(live) == 1 or rig.policy.snapshot().reserved_tokens <= 20_000
            assert (await rig.client.post(f"/basin/sessions/{sid}/end")).status_code == 200
        answers = await asyncio.gather(*calls)
        assert [a.status_code for a in answers] == [200] * 4
        assert rig.policy.snapshot().reserved_tokens == 0 and not rig.room.registry  # 0 leaked reservations


async def test_a_held_call_whose_client_leaves_withdraws_its_session_and_returns_its_reservation() -> None:
    async with rig_for(budget_tokens=20_000, always_engaged=True) as rig:
        assert (await rig.chat("owner", "the owner's task")).status_code == 200
        rig.model.default = 15_000.0
        assert (await rig.chat("attacker", "attack")).status_code == 200  # 1,000 + 15,000 fits
        call = RawCall(rig.app, {"messages": made_up_history("attack", 4)}, session="attacker")  # ~24k tokens
        task = asyncio.create_task(call.run())
        await eventually(lambda: rig.policy.snapshot().queued == ("attacker",))
        call.leave.set()
        await asyncio.wait_for(task, timeout=2)
        assert call.status == 499
        await eventually(lambda: rig.room.registry.get("attacker") is None)
        assert rig.policy.snapshot().reserved_tokens == 1_000


# --- item 2: a session id names one conversation -------------------------------------------------------------


async def test_a_ride_on_a_live_id_is_a_session_of_its_own_under_its_own_admission() -> None:
    async with rig_for(budget_tokens=20_000, always_engaged=True) as rig:
        assert (await rig.chat("victim", "the victim's task")).status_code == 200
        ride = asyncio.create_task(rig.client.post(CHAT, json={"messages": made_up_history("unrelated", 8)},
                                                   headers={"X-Session-ID": "victim"}))
        await eventually(lambda: len(rig.policy.snapshot().queued) == 1)
        (rider,) = rig.policy.snapshot().queued
        assert rider.startswith("victim~") and rig.policy.snapshot().live == ("victim",)
        assert rig.policy.snapshot().working_set_tokens < 1_000  # the ride is not in the victim's working set
        assert (await rig.chat("victim", "the victim's task", "next")).status_code == 200  # the owner goes on
        assert (await rig.client.post("/basin/sessions/victim/end")).status_code == 200
        answer = await ride  # the lone head goes in once the victim has ended
        assert answer.status_code == 200 and answer.headers["x-session-id"] == rider


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "an unrelated prompt " * 50}),
    ("/generate", {"text": "an unrelated prompt " * 50}),
])
async def test_a_raw_prompt_ride_under_a_chat_sessions_id_is_refused_with_refuse(path: str,
                                                                               body: dict[str, Any]) -> None:
    async with rig_for(gateway_options={"foreign_call": "refuse"}) as rig:
        assert (await rig.chat("victim", "the victim's task")).status_code == 200
        answer = await rig.client.post(path, json=body, headers={"X-Session-ID": "victim"})
        error = answer.json()["error"]
        assert (answer.status_code, error["type"], error["session_id"], error["option"]) == (
            409, "session_id_in_use", "victim", "--foreign-call")
        assert "names another conversation" in error["message"]
        assert rig.policy.snapshot().live == ("victim",) and len(rig.upstream.requests) == 1


async def test_a_call_that_keeps_the_first_messages_continues_even_when_later_turns_are_trimmed() -> None:
    async with rig_for(gateway_options={"foreign_call": "refuse"}) as rig:
        first = conversation("task", system="you are an agent")
        assert (await rig.client.post(CHAT, json={"messages": first}, headers={"X-Session-ID": "s"})).status_code == 200
        grown = conversation("task", "more", "and more", system="you are an agent")
        assert (await rig.client.post(CHAT, json={"messages": grown}, headers={"X-Session-ID": "s"})).status_code == 200
        trimmed = [*grown[:2], {"role": "user", "content": "summary of the rest"}]  # compacted later turns
        assert (await rig.client.post(CHAT, json={"messages": trimmed},
                                      headers={"X-Session-ID": "s"})).status_code == 200
        other_system = conversation("task", "more", system="you are someone else")
        refused = await rig.client.post(CHAT, json={"messages": other_system}, headers={"X-Session-ID": "s"})
        assert refused.status_code == 409
        assert len(rig.room.registry.get("s").calls) == 3  # type: ignore[union-attr]


async def test_an_id_is_bound_to_the_api_key_it_first_came_with() -> None:
    async with rig_for(gateway_options={"foreign_call": "refuse"}) as rig:
        owner = {"Authorization": "Bearer key-of-the-owner"}
        assert (await rig.chat("s", "task", headers=owner)).status_code == 200
        assert (await rig.chat("s", "task", "more", headers=owner)).status_code == 200
        for headers in ({"Authorization": "Bearer another-key"}, {}):
            refused = await rig.chat("s", "task", "more", headers=headers)
            assert refused.status_code == 409 and refused.json()["error"]["type"] == "session_id_in_use"
        sent = [r.headers.get("authorization") for r in rig.upstream.requests]
        assert sent == ["Bearer key-of-the-owner"] * 2


async def test_a_stranger_leaves_a_listed_session_alone_and_its_owner_is_adopted(tmp_path: Path) -> None:
    list_live(tmp_path, "s1", contents=("task", "more"))
    async with restart_rig(tmp_path, budget_tokens=1_000_000) as rig:
        stranger = await rig.chat("s1", "some other task", "with history")
        assert stranger.status_code == 200 and stranger.headers["x-session-id"].startswith("s1~")
        owner = await rig.chat("s1", "task", "more", "go on")
        assert owner.status_code == 200 and owner.headers["x-session-id"] == "s1"
        assert rig.room.registry.get("s1").is_adopted  # type: ignore[union-attr]


async def test_adoption_reserves_what_the_session_held_and_holds_a_resumed_call_that_does_not_fit(
        tmp_path: Path) -> None:
    # The case scaled down: the owner plus a ~30k-token new turn, against a 20k budget, with another
    # session live and admission engaged.
    previous = live_session("task", "more", calls=(LoggedCall(1.7e9, 1.7e9 + 1, 40, 10),))
    (tmp_path / "log").mkdir()
    LiveSessionsFile(tmp_path / "log" / "sessions.live.json").write(LiveSessions({"s1": previous}, is_logged=True))
    async with rig_for(budget_tokens=20_000, always_engaged=True, gateway_options={
            "live_sessions": LiveSessionsFile(tmp_path / "log" / "sessions.live.json")}) as rig:
        assert (await rig.chat("other", "another task")).status_code == 200
        resumed = conversation("task", "more", FILLER * 10)
        call = asyncio.create_task(rig.client.post(CHAT, json={"messages": resumed}, headers={"X-Session-ID": "s1"}))
        await eventually(lambda: rig.policy.snapshot().queued == ("s1",))
        assert rig.room.registry.get("s1").is_adopted and rig.policy.snapshot().reserved_tokens <= 20_000  # type: ignore[union-attr]
        assert len(rig.upstream.requests) == 1
        assert (await rig.client.post("/basin/sessions/other/end")).status_code == 200
        assert (await call).status_code == 200  # alone now: in over budget, the lone-head rule


# --- item 4: ending a session --------------------------------------------------------------------------------


async def test_ending_with_a_made_up_key_answers_alike_whether_the_id_is_held_or_not() -> None:
    async with rig_for(admin_token="s3cret") as rig:
        assert (await rig.chat("held", "task")).status_code == 200
        answers = [await rig.client.post(f"/basin/sessions/{sid}/end", headers={SESSION_KEY_HEADER: "made-up"})
                   for sid in ("held", "not-held")]
        assert [a.status_code for a in answers] == [401, 401]
        assert answers[0].json()["error"]["message"] == answers[1].json()["error"]["message"]
        assert rig.policy.is_live("held")


# --- item 6: every copy of rid and priority ------------------------------------------------------------------


async def test_every_copy_of_a_clients_rid_and_priority_is_replaced_even_one_equal_to_the_gateways() -> None:
    async with rig_for() as rig:
        rid = f"{routing_key('s1')}_t0"
        raw = (b'{"rid": "victim-rid", "priority": 7, "messages": [{"role": "user", "content": "task"}], '
               b'"rid": "' + rid.encode() + b'", "priority": 0}')
        answer = await rig.client.post(CHAT, content=raw, headers={"X-Session-ID": "s1",
                                                                    "content-type": "application/json"})
        assert answer.status_code == 200
        (sent,) = rig.upstream.requests
        assert sent.content.count(b'"rid"') == 1 and sent.content.count(b'"priority"') == 1
        assert b"victim-rid" not in sent.content and b'"priority": 7' not in sent.content
        pairs = json.loads(sent.content, object_pairs_hook=list)
        assert [k for k, _ in pairs].count("rid") == 1 and dict(pairs)["rid"] == rid


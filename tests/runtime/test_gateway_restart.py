"""Restarts, shutdowns and failed first calls, in-process (the rig of test_gateway_app.py).

- The adoption rule: only a session the previous run listed as live, resuming with its history within
  the adoption window, skips the queue; everything else arrives like a new session.
- A graceful shutdown: draining withdraws queued sessions at once (503 `shutting_down`) and refuses every new
  call; `shut_down` lists the live sessions for the next run and logs each as
  `shutdown`; the next run adopts them and logs them marked `adopted`; ingest joins the two parts.
- A session whose calls all failed is released as `failed`: it holds no budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from basin_pipeline.adapters.gateway_log import read_gateway_log
from basin_pipeline.records import Reject
from basin_runtime.gateway.calls import parse_call
from basin_runtime.gateway.measure import Meter, PromptMemo
from basin_runtime.gateway.restart import LiveSession, LiveSessions, LiveSessionsFile, prefix_digest
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.session_log import LoggedCall, SessionLogRecord
from basin_runtime.task_text import TaskTextRule
from tests.runtime.test_gateway_app import TOKENIZER, Rig, conversation, eventually, rig_for

pytestmark = pytest.mark.asyncio


def restart_rig(tmp_path: Path, *, budget_tokens: int = 1, window_s: float = 600.0,
                **options: Any) -> Any:
    """A rig whose gateway keeps its live-sessions file and session log in `tmp_path`."""
    writer = SessionLogWriter(tmp_path / "log" / "sessions.jsonl", keep_text=True)
    return rig_for(budget_tokens=budget_tokens, gateway_options={
        "live_sessions": LiveSessionsFile(tmp_path / "log" / "sessions.live.json"), "adoption_window_s": window_s,
        "session_log": writer, **options})


def logged(tmp_path: Path) -> list[SessionLogRecord]:
    path = tmp_path / "log" / "sessions.jsonl"
    if not path.exists():
        return []
    return [SessionLogRecord.from_json(line) for line in path.read_text(encoding="utf-8").splitlines()]


def live_session(*contents: str, calls: tuple[LoggedCall, ...] = ()) -> LiveSession:
    """What a previous run knew of a session whose last call sent the conversation of user turns `contents`."""
    memo = PromptMemo()
    Meter(TOKENIZER, TaskTextRule()).first_call(parse_call("chat", json.dumps({"messages": conversation(
        *contents)}).encode()), memo)
    return LiveSession(prefix_digest(memo.keys), len(memo.keys), 1.7e9, 1000.0, 1000.0, len(contents[0]), "m", None,
                       calls)


def list_live(tmp_path: Path, *session_ids: str, is_logged: bool = True, contents: tuple[str, ...] = ("task",)) -> None:
    """What a previous run would have left: these sessions, each last seen sending `contents`, their records logged
    (a graceful shutdown) or not (a kill)."""
    sessions = {sid: live_session(*contents) for sid in session_ids}
    LiveSessionsFile(tmp_path / "log" / "sessions.live.json").write(LiveSessions(sessions, is_logged))


async def finish(rig: Rig) -> None:
    assert rig.gateway.telemetry.session_log is not None
    await asyncio.to_thread(rig.gateway.telemetry.session_log.flush)


# --- the adoption rule ---------------------------------------------------------------------------


async def test_a_session_listed_by_the_previous_run_resumes_without_queueing_and_is_logged_adopted(
        tmp_path: Path) -> None:
    list_live(tmp_path, "old")
    async with restart_rig(tmp_path) as rig:
        await rig.chat("live", "task")  # the one-token budget is now full
        response = await asyncio.wait_for(rig.chat("old", "task", "more"), timeout=2)
        assert response.status_code == 200
        entry = rig.room.registry.get("old")
        assert entry is not None and entry.is_adopted and entry.state == "live"
        assert (await rig.client.post("/basin/sessions/old/end")).status_code == 200
        await finish(rig)
    (record,) = [r for r in logged(tmp_path) if r.session_id == "old"]
    assert record.adopted and record.end_reason == "ended" and len(record.calls) == 1


async def test_a_listed_session_resuming_after_the_window_waits_like_a_new_one(tmp_path: Path) -> None:
    list_live(tmp_path, "old")
    async with restart_rig(tmp_path, window_s=60.0) as rig:
        await rig.chat("live", "task")
        rig.clock.advance(61.0)
        call = asyncio.create_task(rig.chat("old", "task", "more"))
        await eventually(lambda: rig.policy.is_queued("old"))
        assert not rig.room.registry.get("old").is_adopted  # type: ignore[union-attr]
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


async def test_a_listed_id_is_adopted_at_most_once_and_only_with_its_history(tmp_path: Path) -> None:
    list_live(tmp_path, "old", "again")
    async with restart_rig(tmp_path) as rig:
        await rig.chat("live", "task")
        # A call without history under a listed id does not continue the listed conversation: it is a session of
        # its own (under an id of its own) and queues, and the listing stays for its owner (issue 46 item 2).
        fresh = asyncio.create_task(rig.chat("again", "task"))
        await eventually(lambda: any(s.startswith("again~") for s in rig.policy.snapshot().queued))
        fresh.cancel()
        await asyncio.gather(fresh, return_exceptions=True)
        await eventually(lambda: not rig.policy.snapshot().queued)
        late = await asyncio.wait_for(rig.chat("again", "task", "more"), timeout=2)
        assert late.status_code == 200 and rig.room.registry.get("again").is_adopted  # type: ignore[union-attr]
        # "old" is adopted once; ended and back with history, it is a new session and waits.
        assert (await asyncio.wait_for(rig.chat("old", "task", "more"), timeout=2)).status_code == 200
        assert (await rig.client.post("/basin/sessions/old/end")).status_code == 200
        twice = asyncio.create_task(rig.chat("old", "task", "more", "and more"))
        await eventually(lambda: rig.policy.is_queued("old"))
        twice.cancel()
        await asyncio.gather(twice, return_exceptions=True)


async def test_without_a_live_sessions_file_nothing_is_adopted(tmp_path: Path) -> None:
    async with rig_for(budget_tokens=1) as rig:
        assert rig.gateway.restart.file is None
        await rig.chat("live", "task")
        call = asyncio.create_task(rig.chat("old", "task", "more"))
        await eventually(lambda: rig.policy.is_queued("old"))
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "other", "sessions": ["old"]}),
                                     json.dumps({"format": "basin-live-sessions", "sessions": "old"})])
async def test_a_bad_live_sessions_file_adopts_nobody_and_says_so(tmp_path: Path, content: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "log" / "sessions.live.json"
    path.parent.mkdir()
    path.write_text(content, encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        async with restart_rig(tmp_path) as rig:
            assert len(rig.gateway.restart.adoption) == 0
    assert "no session will be adopted" in caplog.text


async def test_the_live_sessions_file_is_owner_only_and_rewritten_only_on_change(tmp_path: Path) -> None:
    live = LiveSessionsFile(tmp_path / "state" / "live.json")
    a, b = live_session("task a"), live_session("task b")
    assert live.write(LiveSessions({"b": b, "a": a}), "ab") and not live.write(LiveSessions({"a": a}), "ab")
    assert live.write(LiveSessions({"a": a}, is_logged=True), "a")
    assert live.read() == LiveSessions({"a": a}, is_logged=True)
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert live.path.stat().st_mode & 0o777 == 0o600


# --- a graceful shutdown -------------------------------------------------------------------------


async def test_draining_withdraws_queued_sessions_and_refuses_every_new_call(tmp_path: Path) -> None:
    # Issue 36 item 2: a live session's next call is refused too (503, it resumes on the replacement, adopted), so a
    # drain ends once the calls in flight have; they run on (tests/runtime/test_gateway_hardening.py, over TCP).
    async with restart_rig(tmp_path) as rig:
        await rig.chat("live", "task")
        queued = asyncio.create_task(rig.chat("waiting", "task two"))
        await eventually(lambda: rig.policy.is_queued("waiting"))

        await rig.gateway.drain()
        withdrawn = await asyncio.wait_for(queued, timeout=2)
        assert withdrawn.status_code == 503 and withdrawn.json()["error"]["type"] == "shutting_down"
        assert withdrawn.headers["retry-after"] == "30"
        new = await rig.chat("new", "task three")
        assert new.status_code == 503 and new.json()["error"]["type"] == "shutting_down"
        again = await rig.chat("live", "task", "more")
        assert again.status_code == 503 and again.json()["error"]["type"] == "shutting_down"
        snapshot = rig.policy.snapshot()
        assert snapshot.live == ("live",) and snapshot.queued == ()
        assert [e.session_id for e in rig.room.registry] == ["live"]


async def test_shutdown_logs_every_live_session_and_the_next_run_adopts_them(tmp_path: Path) -> None:
    sessions = [f"agent-{k}" for k in range(6)]
    async with restart_rig(tmp_path, budget_tokens=1_000_000) as first:
        for session in sessions:
            assert (await first.chat(session, f"task {session}")).status_code == 200
        await first.gateway.drain()
        await first.gateway.shut_down()
        assert len(first.room.registry) == 0 and first.policy.snapshot().live == ()
        await finish(first)
    cut = logged(tmp_path)
    assert sorted(r.session_id for r in cut) == sessions
    assert {r.end_reason for r in cut} == {"shutdown"} and not any(r.adopted for r in cut)
    listed = LiveSessionsFile(tmp_path / "log" / "sessions.live.json").read()
    assert set(listed.sessions) == set(sessions) and listed.is_logged

    async with restart_rig(tmp_path, budget_tokens=1) as second:  # full at once: adoption must not wait
        for session in sessions:
            response = await asyncio.wait_for(second.chat(session, f"task {session}", "more"), timeout=2)
            assert response.status_code == 200
        for session in sessions:
            assert (await second.client.post(f"/basin/sessions/{session}/end")).status_code == 200
        await finish(second)
    resumed = logged(tmp_path)[len(cut):]
    assert sorted(r.session_id for r in resumed) == sessions and all(r.adopted for r in resumed)

    read = list(read_gateway_log(tmp_path / "log" / "sessions.jsonl", "gw"))
    assert not [r for r in read if isinstance(r, Reject)]
    assert sorted(s.session_id for s in read) == sessions  # type: ignore[union-attr]
    assert all(len(s.calls) == 2 for s in read)  # type: ignore[union-attr]


async def test_the_lifespan_ends_what_is_still_held_when_the_app_stops(tmp_path: Path) -> None:
    async with restart_rig(tmp_path, budget_tokens=1_000_000) as rig:
        async with rig.app.router.lifespan_context(rig.app):
            assert (await rig.chat("agent", "task")).status_code == 200
        await finish(rig)
    (record,) = logged(tmp_path)
    assert record.session_id == "agent" and record.end_reason == "shutdown"


# --- sessions none of whose calls was served -----------------------------------------------------


async def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


async def test_a_session_whose_first_call_fails_upstream_holds_no_budget(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    async with restart_rig(tmp_path, budget_tokens=5_000) as rig:
        rig.upstream.handler = refuse
        with caplog.at_level(logging.WARNING, logger="basin_runtime.gateway.gateway"):
            for k in range(3):
                response = await rig.chat(f"s{k}", "x " * 1000)
                assert response.status_code == 502
        snapshot = rig.policy.snapshot()
        assert snapshot.live == () and snapshot.reserved_tokens == 0 and len(rig.room.registry) == 0
        assert caplog.text.count("ended upstream_error") == 3
        await finish(rig)
    assert [(r.end_reason, [c.outcome for c in r.calls]) for r in logged(tmp_path)] == [
        ("failed", ["upstream_error"])] * 3
    rejects = list(read_gateway_log(tmp_path / "log" / "sessions.jsonl", "gw"))
    assert all(isinstance(r, Reject) and "end reason `failed`" in r.reason for r in rejects)


async def test_a_first_call_the_upstream_rejects_releases_the_session_too() -> None:
    async def too_many(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "slow down"}})

    async with rig_for(budget_tokens=5_000) as rig:
        rig.upstream.handler = too_many
        assert (await rig.chat("s", "task")).status_code == 429
        assert len(rig.room.registry) == 0 and rig.policy.snapshot().reserved_tokens == 0


async def test_a_session_that_was_served_once_keeps_its_place_when_a_later_call_fails() -> None:
    async with rig_for(budget_tokens=5_000) as rig:
        assert (await rig.chat("s", "task")).status_code == 200
        rig.upstream.handler = refuse
        assert (await rig.chat("s", "task", "more")).status_code == 502
        entry = rig.room.registry.get("s")
        assert entry is not None and entry.state == "live" and entry.in_flight == 0


async def test_a_failed_call_does_not_release_a_session_with_another_call_in_flight() -> None:
    release = asyncio.Event()

    async def first_slow_then_refused(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["messages"][-1]["content"] == "slow":
            await release.wait()
            return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
        raise httpx.ConnectError("refused", request=request)

    async with rig_for(budget_tokens=5_000) as rig:
        rig.upstream.handler = first_slow_then_refused
        slow = asyncio.create_task(rig.chat("s", "slow"))
        await eventually(lambda: (e := rig.room.registry.get("s")) is not None and e.in_flight == 1)
        assert (await rig.chat("s", "fast")).status_code == 502
        assert rig.room.registry.get("s") is not None  # the slow call may still be served
        release.set()
        assert (await slow).status_code == 200
        assert rig.room.registry.get("s") is not None


# --- issue 36: adoption tied to the conversation; a killed run's sessions logged whole --------------------


async def test_a_listed_id_resuming_another_conversation_is_not_adopted(tmp_path: Path) -> None:
    # Issue 36 item 7: the id alone proved a prior session; now its conversation must continue the one listed.
    list_live(tmp_path, "old", "older")
    async with restart_rig(tmp_path) as rig:
        await rig.chat("live", "task")  # the one-token budget is full
        impostor = asyncio.create_task(rig.chat("old", "another task", "more"))  # history, but not old's
        await eventually(lambda: any(s.startswith("old~") for s in rig.policy.snapshot().queued))  # its own id
        assert rig.room.registry.get("old") is None  # the listed entry is left alone (issue 46 item 2)
        impostor.cancel()
        await asyncio.gather(impostor, return_exceptions=True)
        rewritten = asyncio.create_task(rig.chat("older", "task edited", "more"))  # its first message changed
        await eventually(lambda: any(s.startswith("older~") for s in rig.policy.snapshot().queued))
        rewritten.cancel()
        await asyncio.gather(rewritten, return_exceptions=True)
    list_live(tmp_path, "old")
    async with restart_rig(tmp_path) as rig:
        await rig.chat("live", "task")
        resumed = await asyncio.wait_for(rig.chat("old", "task", "more", "and more"), timeout=2)  # continues it
        assert resumed.status_code == 200 and rig.room.registry.get("old").is_adopted  # type: ignore[union-attr]


async def test_after_a_kill_an_adopted_session_is_logged_whole_and_ingest_reads_it(tmp_path: Path) -> None:
    # Issue 36 item 11: after kill -9 the adopted continuation was logged alone, and ingest rejected it.
    turns = ("fix the parser", "tests fail", "try the other branch", "now run them all")
    async with restart_rig(tmp_path, budget_tokens=1_000_000) as first:
        for k in range(1, 3):
            assert (await first.chat("agent", *turns[:k])).status_code == 200
        await first.gateway.save_live_sessions()  # the last periodic write before the kill
        assert (await first.chat("agent", *turns[:3])).status_code == 200  # a call the file never saw
        seen = [c.prompt_tokens for c in first.room.registry.get("agent").calls]  # type: ignore[union-attr]
        # killed: no drain, no shutdown, nothing logged
    assert logged(tmp_path) == []
    async with restart_rig(tmp_path, budget_tokens=1) as second:  # full: adoption must not wait
        assert (await asyncio.wait_for(second.chat("agent", *turns), timeout=2)).status_code == 200
        assert second.room.registry.get("agent").is_adopted  # type: ignore[union-attr]
        assert (await second.client.post("/basin/sessions/agent/end")).status_code == 200
        await finish(second)
    (record,) = logged(tmp_path)
    assert not record.adopted and record.end_reason == "ended" and record.task_text == "fix the parser"
    assert [c.prompt_tokens for c in record.calls] == [*seen, TOKENIZER.count_prompt(conversation(*turns))]
    assert record.calls[2].ended_at is None  # the call the file never saw: rebuilt from the conversation
    assert record.calls[2].completion_tokens == TOKENIZER.count_completion({"role": "assistant", "content": "answer 3"})
    read = list(read_gateway_log(tmp_path / "log" / "sessions.jsonl", "gw"))
    assert not [r for r in read if isinstance(r, Reject)], read
    (session,) = read
    assert [c.prompt_tokens for c in session.calls] == [c.prompt_tokens for c in record.calls]  # type: ignore[union-attr]

"""The session replayer: conversations sized to the recorded counts, arrival plans, the client against a
fake OpenAI server (finish, cache hits, shed, abort, time scale, unreachable URL), the summary and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from collections.abc import Callable, Container, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from basin_loadgen.replay import (
    ConversationBuilder,
    Message,
    PlannedSession,
    RateSchedule,
    ReplayPlanError,
    plan_sessions,
    reference_line,
)
from basin_loadgen.replay_client import ClientSettings, Replayer, ReplayError, main
from basin_loadgen.replay_summary import CallRecord, SessionRecord, StateSample, Window, summarize, timeline
from basin_runtime.clock import Clock, ManualClock
from basin_runtime.session_table import Call, Session, write_sessions
from basin_runtime.tokenizer import get_tokenizer
from basin_sim.workload.synthetic import generate_corpus
from tests.loadgen.fake_openai import RETRY_AFTER_S, FakeEngine, FakeServer, running_fake
from tests.sim.builders import session

TOKENIZER = get_tokenizer()


def pool_of(n: int = 6, calls: int = 5, gap_s: float = 2.0) -> list[Session]:
    """Sessions of two benchmarks with growing prompts."""
    return [session(f"p{k}", [700 + 40 * k + 350 * i for i in range(calls)], completion=15 + k, gap_s=gap_s,
                    benchmark="bench-a" if k % 2 else "bench-b") for k in range(n)]


def planned(pool: list[Session], tag: str = "t", rate: float = 0.5, duration_s: float = 20.0,
            seed: int = 1) -> list[PlannedSession]:
    return plan_sessions(pool, RateSchedule.steady(rate, duration_s), seed, tag)


def play(builder: ConversationBuilder, p: PlannedSession, answer_words: int = 0) -> list[list[Message]]:
    """Every call's messages of one session, answering each call with `max_tokens` (+ extra) words."""
    conversation = builder.conversation(p)
    calls = [conversation.first_call()]
    while conversation.has_next:
        calls.append(conversation.next_call(" ".join(["done"] * (conversation.max_tokens + answer_words))))
    return calls


# --- conversations ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("corpus", ["hand", "synthetic"])
def test_built_prompts_count_the_recorded_prompt_tokens_within_two_percent(corpus: str) -> None:
    pool = pool_of() if corpus == "hand" else generate_corpus(7, 8)
    builder = ConversationBuilder(pool, TOKENIZER, "t")
    errors: list[float] = []
    for k, s in enumerate(pool):
        p = PlannedSession(f"t-{k:06d}", s, 0.0, tuple(2.0 for _ in s.calls[:-1]))
        conversation = builder.conversation(p)
        messages = conversation.first_call()
        while True:
            built = conversation.prompt_tokens
            if conversation.call_index % 5 == 0 or not conversation.has_next:
                assert TOKENIZER.count_prompt(messages) == built  # the bookkeeping is the tokenizer's count
            errors.append(abs(built - conversation.target_prompt_tokens) / conversation.target_prompt_tokens)
            if not conversation.has_next:
                break
            messages = conversation.next_call("step " * (k % 7) + "answer")
    assert max(errors) <= 0.02
    assert sum(e == 0 for e in errors) >= 0.9 * len(errors)  # almost every prompt is exact


def test_each_call_extends_the_previous_one_and_the_same_plan_gives_the_same_text() -> None:
    pool = pool_of()
    plan = planned(pool)
    first = [play(ConversationBuilder(pool, TOKENIZER, "t"), p) for p in plan[:3]]
    again = [play(ConversationBuilder(pool, TOKENIZER, "t"), p) for p in plan[:3]]
    assert first == again
    for calls in first:
        for before, after in itertools.pairwise(calls):
            assert after[:len(before)] == before
            assert [m["role"] for m in after[len(before):]] == ["assistant", "tool"]


def test_two_replays_of_one_pool_session_share_the_system_prompt_and_task_text_only() -> None:
    pool = pool_of()
    builder = ConversationBuilder(pool, TOKENIZER, "t")
    a, b = (play(builder, PlannedSession(rid, pool[1], 0.0, (2.0,) * 4))[-1] for rid in ("t-000001", "t-000002"))
    assert a[0] == b[0] and a[0]["role"] == "system"
    assert a[1]["content"] == pool[1].task_text + reference_line("t-000001")
    assert b[1]["content"] == pool[1].task_text + reference_line("t-000002")
    assert all(x["content"] != y["content"] for x, y in zip(a[3:], b[3:], strict=True) if x["role"] == "tool")
    other = play(builder, PlannedSession("t-000003", pool[3], 0.0, (2.0,) * 4))[0]
    assert other[0] == a[0]  # same benchmark, same system prompt
    assert play(builder, PlannedSession("t-000004", pool[0], 0.0, (2.0,) * 4))[0][0] != a[0]


def test_a_task_text_too_long_for_the_recorded_first_prompt_is_cut() -> None:
    calls = (Call(120, 10, None, None, 1.0), Call(400, 10))
    long = Session("long", "bench-a", "t", "a", "m", "x", "refactor the storage layer " * 200, "", "t", calls)
    pool = [*pool_of(), long]
    conversation = ConversationBuilder(pool, TOKENIZER, "t").conversation(PlannedSession("t-000009", long, 0.0, (1.0,)))
    user = conversation.first_call()[1]["content"]
    assert user.endswith(reference_line("t-000009")) and long.task_text.startswith(user.split("\n\n(ref")[0])
    assert len(user) < len(long.task_text)
    assert conversation.prompt_tokens <= 120


# --- arrival plans ---------------------------------------------------------------------------------------------


def test_plans_are_seeded_and_follow_the_rate_schedule() -> None:
    pool = pool_of()
    schedule = RateSchedule.steady(1.0, 3000.0, surge=(1000.0, 2000.0, 2.0))
    plan = plan_sessions(pool, schedule, 5, "x")
    assert plan == plan_sessions(pool, schedule, 5, "x")
    assert [p.arrival_s for p in plan] != [p.arrival_s for p in plan_sessions(pool, schedule, 6, "x")]
    assert [p.arrival_s for p in plan] == sorted(p.arrival_s for p in plan)
    assert len({p.run_id for p in plan}) == len(plan)
    pre = sum(p.arrival_s < 1000 for p in plan)
    surge = sum(1000 <= p.arrival_s < 2000 for p in plan)
    post = sum(p.arrival_s >= 2000 for p in plan)
    assert 900 < pre < 1100 and 900 < post < 1100 and 1.8 < surge / pre < 2.2  # Poisson counts, sd ~ 3%
    assert len(plan_sessions(pool, schedule, 5, "x", max_sessions=10)) == 10
    no_gaps = Session("g", "b", "s", "a", "m", "t", "x", "", "t", (Call(100, 5), Call(200, 5), Call(300, 5)))
    assert plan_sessions([no_gaps], RateSchedule.steady(1.0, 5.0), 1, "g", default_gap_s=3.5)[0].gaps_s == (3.5, 3.5)


@pytest.mark.parametrize(("segments", "end_s"), [(((1.0, 1.0),), 5.0), (((0.0, 1.0), (0.0, 2.0)), 5.0),
                                                 (((0.0, 1.0),), 0.0), (((0.0, -1.0),), 5.0)])
def test_a_bad_schedule_is_refused(segments: tuple[tuple[float, float], ...], end_s: float) -> None:
    with pytest.raises(ReplayPlanError):
        RateSchedule(segments, end_s)


def test_a_surge_outside_the_run_is_refused() -> None:
    with pytest.raises(ReplayPlanError, match="surge"):
        RateSchedule.steady(1.0, 100.0, surge=(50.0, 150.0, 2.0))


# --- the client against the fake server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeServer]:
    with running_fake() as server:
        yield server


@pytest.fixture
def engine(fake: FakeServer) -> FakeEngine:
    return fake.engine.reset()


def replayer(fake: FakeServer, pool: list[Session], clock: Clock | None = None, **settings: Any) -> Replayer:
    options: dict[str, Any] = {"time_scale": 50.0, "sample_s": 1.0, **settings}
    return Replayer(ClientSettings(fake.base_url, **options), ConversationBuilder(pool, TOKENIZER, "t"), clock=clock)


def settled(r: Replayer, held: Container[str] = ()) -> Callable[[], bool]:
    """True while no call is in flight but the held ones: then only the clock can move the replay on."""
    return lambda: all(c.end_s is not None or rec.run_id in held for rec in r.records.values() for c in rec.calls)


async def driven(clock: ManualClock, r: Replayer, run: Coroutine[Any, Any, list[SessionRecord]],
                 held: Container[str] = ()) -> list[SessionRecord]:
    """`run` to its end, with `clock` jumping to each next deadline whenever the replay has settled."""
    task = asyncio.ensure_future(run)
    await clock.drive(task, is_settled=settled(r, held))
    return await task


@pytest.mark.asyncio
async def test_sessions_finish_with_the_servers_cached_tokens_and_agent_headers(fake: FakeServer,
                                                                                engine: FakeEngine) -> None:
    pool = pool_of()
    plan = planned(pool)[:4]
    records = await replayer(fake, pool).run(plan)

    assert [r.status for r in records] == ["finished"] * 4
    for p, r in zip(plan, records, strict=True):
        assert r.run_id == p.run_id and r.pool_session_id == p.session.session_id and r.end_s is not None
        assert len(r.calls) == p.session.n_calls
        assert r.calls[0].cached_tokens == 0
        for before, call, recorded in zip(r.calls, r.calls[1:], p.session.calls[1:], strict=False):
            assert call.prompt_tokens == call.built_prompt_tokens == recorded.prompt_tokens  # the server counts alike
            # the fake hits the previous request's messages: its prompt less the generation prompt
            assert before.prompt_tokens is not None
            assert call.cached_tokens == before.prompt_tokens - TOKENIZER.generation_prompt_tokens
        for c in r.calls:
            assert c.first_token_s is not None and c.end_s is not None and c.sent_s <= c.first_token_s <= c.end_s
    seen = [q for q in engine.requests if q["session"] == plan[0].run_id]
    assert len(seen) == plan[0].session.n_calls
    assert {q["workload"] for q in seen} == {plan[0].session.benchmark}
    for q, recorded in zip(seen, plan[0].session.calls, strict=True):
        body = q["body"]
        assert body["user"] == plan[0].run_id and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == recorded.completion_tokens
    assert sorted(engine.ended) == sorted(p.run_id for p in plan)  # each ended at the "gateway"


@pytest.mark.asyncio
async def test_a_shed_session_is_counted_as_shed_with_its_reason(fake: FakeServer, engine: FakeEngine) -> None:
    pool = pool_of()
    plan = planned(pool)[:3]
    engine.shed.add(plan[1].run_id)
    r = replayer(fake, pool)
    records = await r.run(plan)
    summary = summarize(records, r.samples, [Window("all", 0.0, 20.0)], time_scale=50.0, bin_s=5.0)

    shed = records[1]
    assert shed.status == "shed" and shed.retry_after_s == RETRY_AFTER_S
    assert shed.reason == "arrival rate above the completion rate"
    assert len(shed.calls) == 1 and shed.calls[0].error == "HTTP 503" and shed.calls[0].prompt_tokens is None
    assert [records[0].status, records[2].status] == ["finished", "finished"]
    assert shed.run_id not in engine.ended  # a shed session is already gone at the gateway
    assert summary["status_counts"] == {"finished": 2, "shed": 1, "aborted": 0, "error": 0, "unfinished": 0}
    assert summary["failure_reasons"] == {"arrival rate above the completion rate": 1}


@pytest.mark.asyncio
async def test_a_call_held_past_the_max_wait_aborts_its_session(fake: FakeServer, engine: FakeEngine) -> None:
    pool = pool_of()
    plan = planned(pool)[:2]
    engine.held.add(plan[0].run_id)
    clock = ManualClock()
    r = replayer(fake, pool, clock, max_wait_s=0.3)
    records = await driven(clock, r, r.run(plan), held={plan[0].run_id})
    assert not engine.released.is_set()  # the run is over while the answer is still held: it did not wait for it
    engine.released.set()

    assert records[0].status == "aborted" and records[0].reason == "no first token within 0.3 s"
    assert records[0].admission_wait_s is None and records[0].calls[0].error == "no first token"
    held = records[0].calls[0]
    assert held.end_s is not None and held.end_s - held.sent_s == pytest.approx(0.3 * 50.0)  # 0.3 wall s, no more
    assert records[1].status == "finished"


@pytest.mark.asyncio
async def test_the_time_scale_shortens_tool_gaps_on_the_wall(fake: FakeServer, engine: FakeEngine) -> None:
    pool = [session("gappy", [500, 800, 1100, 1400], completion=10, gap_s=10.0)]
    plan = [PlannedSession("t-000000", pool[0], 0.0, (10.0, 10.0, 10.0))]
    clock = ManualClock()
    engine.now = clock.now  # the fake records each request's arrival on the driven clock
    started = clock.now()
    r = replayer(fake, pool, clock, time_scale=100.0)
    records = await driven(clock, r, r.run(plan))

    calls = records[0].calls
    assert len(calls) == 4
    for before, after in itertools.pairwise(calls):
        assert before.end_s is not None and after.sent_s - before.end_s == pytest.approx(10.0)  # model seconds
    sent = [q["time"] for q in engine.requests]
    assert [b - a for a, b in itertools.pairwise(sent)] == pytest.approx([0.1] * 3)  # 10 s / 100 on the wall
    assert sent[0] == started and records[0].end_s == pytest.approx(30.0)  # 30 model s of gaps (0.3 wall s), no more


@pytest.mark.asyncio
async def test_cancelling_a_run_stops_every_session_and_keeps_the_records(fake: FakeServer, engine: FakeEngine) -> None:
    pool = pool_of(gap_s=20.0)
    clock = ManualClock()
    r = replayer(fake, pool, clock, time_scale=20.0)
    run = asyncio.create_task(r.run(planned(pool, rate=2.0)))
    await clock.drive(run, until_s=clock.now() + 0.5, is_settled=settled(r))  # 10 model s: in their first gaps
    assert not run.done() and r.now_s() == pytest.approx(10.0)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    statuses = {x.status for x in r.records.values()}
    assert r.records and statuses == {"unfinished"}
    assert any(c.end_s is not None and c.error is None for x in r.records.values() for c in x.calls)
    assert not r.state().live_sessions and r.samples[-1].live_sessions == 0
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not others  # sessions, sampler and driver are all gone
    assert not engine.ended  # an interrupted session is not ended at the gateway


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.asyncio
async def test_an_unreachable_server_is_a_clear_error_naming_the_url() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    pool = pool_of()
    with pytest.raises(ReplayError, match=f"cannot reach {url}"):
        await Replayer(ClientSettings(url), ConversationBuilder(pool, TOKENIZER, "t")).run(planned(pool))


def test_the_cli_names_an_unreachable_url_without_a_traceback(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "pool.parquet"
    write_sessions(table, pool_of())
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(SystemExit) as exited:
        main(["--base-url", url, "--sessions", str(table), "--rate", "1", "--duration-s", "5",
              "--out", str(tmp_path / "run.json"), "--quiet"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"cannot reach {url}" in err and "Traceback" not in err
    assert not (tmp_path / "run.json").exists()


def test_the_cli_replays_a_surge_and_writes_the_summary_records_and_plot(fake: FakeServer, engine: FakeEngine,
                                                                         tmp_path: Path) -> None:
    table = tmp_path / "pool.parquet"
    write_sessions(table, pool_of(calls=3, gap_s=1.0))
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    clock = ManualClock()  # time moves only while no call is in flight: the machine's load cannot make a session late

    def drive(r: Replayer, run: Coroutine[Any, Any, list[SessionRecord]]) -> Coroutine[Any, Any, list[SessionRecord]]:
        return driven(clock, r, run)

    code = main(["--base-url", fake.base_url, "--sessions", str(table), "--rate", "0.3", "--duration-s", "30",
                 "--surge", "10", "20", "2", "--time-scale", "30", "--seed", "3", "--run-tag", "cli",
                 "--out", str(out), "--plot", str(plot), "--bin-s", "10", "--sample-s", "1", "--quiet"],
                clock=clock, drive=drive)
    document = json.loads(out.read_text())

    assert code == 0 and plot.stat().st_size > 10_000
    summary, sessions = document["summary"], document["sessions"]
    assert set(summary["windows"]) == {"pre", "surge", "post"} and summary["goodput_window"] == "post"
    assert summary["status_counts"]["finished"] == len(sessions) > 0
    assert all(s["run_id"].startswith("cli-") and s["unloaded_s"] > 0 for s in sessions)
    # the fake answers at once, so every session finishes well within 4x its unloaded time on 1p3d-h100
    post = summary["windows"]["post"]
    assert post["sessions_good"] == post["sessions_arrived"] and post["goodput_per_hour"] == pytest.approx(
        post["sessions_arrived"] / (10 / 3600))
    assert 0.4 < summary["windows"]["pre"]["hit_rate"] < 1.0
    assert [row["start_s"] for row in summary["timeline"]][:3] == [0.0, 10.0, 20.0]


# --- the summary -----------------------------------------------------------------------------------------------


def call(index: int, sent: float, end: float, prompt: int, cached: int) -> CallRecord:
    return CallRecord(index, sent, prompt, prompt, 10, sent + 0.1, sent + 0.5, end, prompt, cached, 10)


def test_the_summary_counts_goodput_by_arrival_and_hit_rate_by_call_end() -> None:
    good = SessionRecord("a", "p", "b", 5.0, 2, unloaded_s=10.0, status="finished", end_s=30.0,
                         calls=[call(0, 5.0, 6.0, 1000, 0), call(1, 25.0, 30.0, 2000, 1000)])
    late = SessionRecord("b", "p", "b", 15.0, 2, unloaded_s=10.0, status="finished", end_s=70.0,
                         calls=[call(0, 15.0, 16.0, 1000, 0), call(1, 65.0, 70.0, 2000, 1500)])
    shed = SessionRecord("c", "p", "b", 25.0, 2, unloaded_s=10.0, status="shed", end_s=27.0, reason="full",
                         calls=[CallRecord(0, 25.0, 1000, 1000, 10, end_s=27.0, error="HTTP 503")])
    samples = [StateSample(t, 2, 1, 1, 3000) for t in (0.0, 12.0, 24.0, 36.0)]
    summary = summarize([good, late, shed], samples, [Window("pre", 0.0, 20.0), Window("post", 20.0, 40.0)],
                        time_scale=2.0, bin_s=20.0)

    pre, post = summary["windows"]["pre"], summary["windows"]["post"]
    assert (pre["sessions_arrived"], pre["sessions_good"]) == (2, 1)  # `late` took 55 s > 4 x 10 s
    assert pre["goodput_per_hour"] == pytest.approx(1 / (20 / 3600))
    assert (post["sessions_arrived"], post["sessions_good"]) == (1, 0)
    assert pre["hit_rate"] == 0.0 and post["hit_rate"] == pytest.approx(1000 / 2000)
    assert summary["goodput_window"] == "post" and summary["sessions_good"] == 1
    assert summary["admission_wait_p50_s"] == pytest.approx(0.1)
    assert summary["admission_wait_p50_wall_s"] == pytest.approx(0.05)
    assert summary["status_counts"]["shed"] == 1 and summary["failure_reasons"] == {"full": 1}
    rows = timeline([good, late, shed], samples, 20.0)
    assert [r["start_s"] for r in rows] == [0.0, 20.0, 40.0, 60.0]
    assert [r["hit_rate"] for r in rows] == [0.0, 0.5, None, 0.75]
    assert rows[0]["calls_per_s"] == 2 / 20 and rows[0]["sessions_arrived"] == 2 and rows[1]["live_sessions"] == 2

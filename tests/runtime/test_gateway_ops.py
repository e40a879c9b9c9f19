"""Issue 6 in-process: metrics after a scripted run, usage capture, hit rate to the tick, admin, shadow,
lending hints, and the session log read back by ingest."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from basin_pipeline.ingest import main as ingest_main
from basin_runtime.gateway.admin import Reloader
from basin_runtime.gateway.app import create_app
from basin_runtime.gateway.config import GatewayConfig
from basin_runtime.gateway.lending import LendingTracker
from basin_runtime.gateway.priority import routing_key
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.session_log import SessionLogRecord
from basin_runtime.session_table import read_sessions
from tests.runtime.test_gateway_app import (
    TOKENIZER,
    Handler,
    Rig,
    StubModel,
    conversation,
    eventually,
    held_in_the_queue,
    rig_for,
)

pytestmark = pytest.mark.asyncio
MODEL_FILE = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"


def ops_rig(*, budget_tokens: int = 1_000_000, model: StubModel | None = None, is_shadow: bool = False,
            session_log: SessionLogWriter | None = None, lending: LendingTracker | None = None,
            reloader: Reloader | None = None, reservation_quantile: float | None = None,
            revise_at_calls: tuple[int, ...] | None = (), **policy: Any) -> AbstractAsyncContextManager[Rig]:
    """`test_gateway_app.rig_for` with the issue-6 parts wired in."""
    return rig_for(budget_tokens=budget_tokens, model=model, app_options={"reloader": reloader},
                   reservation_quantile=reservation_quantile, revise_at_calls=revise_at_calls, **policy,
                   gateway_options={"hit_window": HitRateWindow(window_s=60.0, min_prompt_tokens=1), "lending": lending,
                                    "session_log": session_log, "is_shadow": is_shadow})


async def scrape(rig: Rig) -> dict[str, float]:
    """Every sample of `/metrics` by name and labels, e.g. `basin_sessions_ended_total{reason=ended}`."""
    response = await rig.client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            le = sample.labels.get("le")
            key = sample.name + (f"{{{labels}}}" if labels else "") + (f"[le={le}]" if le else "")
            samples[key] = sample.value
    return samples


# --- metrics -------------------------------------------------------------------------------------


async def test_metrics_after_a_scripted_run_have_the_right_names_and_values() -> None:
    model = StubModel({"first task": 5.0, "second task": 100_000.0})
    async with ops_rig(budget_tokens=1, model=model) as rig:
        assert (await rig.chat("a", "first task")).status_code == 200  # live at once (queue empty)
        waiting = asyncio.create_task(rig.chat("b", "second task"))
        await eventually(lambda: rig.policy.is_queued("b"))
        mid = await scrape(rig)
        assert (mid["basin_queued_sessions"], mid["basin_live_sessions"]) == (1, 1)
        assert mid["basin_budget_tokens"] == 1 and mid["basin_sessions_admitted_total"] == 1
        assert mid["basin_working_set_tokens"] == rig.policy.snapshot().working_set_tokens > 0
        assert mid["basin_reserved_tokens"] == rig.policy.snapshot().reserved_tokens > 0

        rig.clock.advance(7.0)
        assert (await rig.client.post("/basin/sessions/a/end")).status_code == 200
        assert (await asyncio.wait_for(waiting, 2)).status_code == 200
        assert (await rig.client.post("/basin/sessions/b/end")).status_code == 200
        end = await scrape(rig)

    assert end["basin_sessions_admitted_total"] == 2 and end["basin_sessions_shed_total"] == 0
    assert (end["basin_queued_sessions"], end["basin_live_sessions"], end["basin_working_set_tokens"]) == (0, 0, 0)
    assert end["basin_sessions_ended_total{reason=ended}"] == 2
    assert end["basin_queue_wait_seconds_count"] == 2 and end["basin_queue_wait_seconds_sum"] == 7.0
    assert end["basin_prefix_hit_ratio"] == pytest.approx(8 / 18)  # two answers of 9 prompt, 4 cached tokens
    assert (end["basin_upstream_prompt_tokens_total"], end["basin_upstream_cached_tokens_total"]) == (18, 8)
    assert end["basin_calls_total{outcome=completed}"] == 2
    prompt = TOKENIZER.count_prompt(conversation("first task"))
    assert end["basin_peak_prediction_ratio_count"] == 2
    assert end["basin_peak_prediction_ratio_sum"] == pytest.approx(prompt / 5.0 + prompt / 100_000.0)
    assert end["basin_sessions_overflowed_total"] == 1  # "first task" ran past its 5-token prediction
    assert end["basin_gateway_added_latency_seconds_count"] == 2
    assert end["basin_shadow_mode"] == 0


class ReservingStub(StubModel):
    """A stub that also carries reservation multipliers, m(q) = 10 q, as a `PeakPredictor` file does."""

    def __init__(self, peaks: dict[str, float]) -> None:
        super().__init__(peaks)
        self.multipliers_asked: list[tuple[float, str | None]] = []

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        self.multipliers_asked.append((q, benchmark))
        return 10 * q


async def test_a_session_reserves_m_q_times_its_prediction_and_overflows_only_past_that(tmp_path: Path) -> None:
    """Predictions 1 and 40 tokens at q = 0.5 (m = 5): reservations 5 and 200. A 10-token conversation
    outgrows the first reservation only; the priority is still the bare prediction's."""
    writer = SessionLogWriter(tmp_path / "sessions.jsonl")
    model = ReservingStub({"first task": 1.0, "second task": 40.0})
    async with ops_rig(model=model, reservation_quantile=0.5, session_log=writer) as rig:
        await rig.chat("a", "first task")
        await rig.chat("b", "second task")
        views = {v["session_id"]: v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]}
        reserved = rig.policy.snapshot().reserved_tokens
        prompt = TOKENIZER.count_prompt(conversation("first task"))
        for sid in ("a", "b"):
            assert (await rig.client.post(f"/basin/sessions/{sid}/end")).status_code == 200
        end = await scrape(rig)
    await asyncio.to_thread(writer.close)

    assert 5 * 1.0 < prompt < 40.0
    assert (views["a"]["predicted_peak_tokens"], views["a"]["reserved_peak_tokens"]) == (1.0, 5.0)
    assert (views["b"]["predicted_peak_tokens"], views["b"]["reserved_peak_tokens"]) == (40.0, 200.0)
    assert reserved == prompt + 200  # a's context is past its 5-token reservation
    assert views["a"]["priority_s"] < views["b"]["priority_s"]
    assert (views["a"]["engine_priority"], views["b"]["engine_priority"]) == (0, 22)  # ranks 0 and 1 of 2, of 4
    assert end["basin_sessions_judged_total"] == 2 and end["basin_sessions_overflowed_total"] == 1
    assert end["basin_peak_prediction_ratio_sum"] == pytest.approx(prompt / 1.0 + prompt / 40.0)
    logged = {r.session_id: r for r in map(SessionLogRecord.from_json,
                                           (tmp_path / "sessions.jsonl").read_text().splitlines())}
    assert (logged["a"].predicted_peak_tokens, logged["a"].reserved_peak_tokens) == (1.0, 5.0)
    assert model.multipliers_asked == [(0.5, None), (0.5, None)]


class FakeOnline:
    """An online model that re-estimates every session at 100 tokens, with m_k(q) = k."""

    slots = (2, 3, 4, 5, 7, 10)  # an `OnlineModel`'s, from its file

    def __init__(self) -> None:
        self.asked: list[tuple[float, list[int], list[int]]] = []

    def predict(self, first_call: float, prompt_tokens: list[int], completion_tokens: list[int]) -> float:
        self.asked.append((first_call, list(prompt_tokens), list(completion_tokens)))
        return 100.0

    def multiplier(self, q: float, k: int) -> float:
        return float(k)


class RevisingStub(ReservingStub):
    def __init__(self, peaks: dict[str, float]) -> None:
        super().__init__(peaks)
        self.online = FakeOnline()


async def test_a_revision_at_call_3_replaces_the_reservation_and_lets_the_waiting_session_in() -> None:
    """Budget 1,000: `big` (prediction 900 x m 1) runs, `next` (200) waits; at big's third call the online
    model re-estimates it at 100 x m_3 = 300, so 300 + 200 fits and `next` is admitted on that step."""
    model = RevisingStub({"big task": 900.0, "next task": 200.0})
    model.multiplier = lambda q, benchmark=None: 1.0  # type: ignore[method-assign]
    async with ops_rig(budget_tokens=1_000, model=model, reservation_quantile=0.9, revise_at_calls=(3,),
                       always_engaged=True) as rig:
        assert (await rig.chat("big", "big task")).status_code == 200
        priority = rig.policy.priority_of("big")
        waiting = asyncio.create_task(rig.chat("next", "next task"))
        await eventually(lambda: rig.policy.is_queued("next"))
        assert (await rig.chat("big", "big task", "two")).status_code == 200  # call 2: no revision
        assert rig.policy.is_queued("next") and model.online.asked == []
        assert (await rig.chat("big", "big task", "two", "three")).status_code == 200
        assert (await asyncio.wait_for(waiting, 2)).status_code == 200
        views = {v["session_id"]: v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]}
        reserved = rig.policy.snapshot().reserved_tokens
        assert rig.policy.priority_of("big") == priority  # fixed at arrival
    [(first, prompts, completions)] = model.online.asked
    assert first == 900.0 and len(prompts) == 3 and completions == [1, 1]  # the stand-in answers 1 token
    assert prompts[0] < prompts[1] < prompts[2]
    assert (views["big"]["predicted_peak_tokens"], views["big"]["reserved_peak_tokens"]) == (900.0, 300.0)
    assert reserved == 300 + 200


async def test_by_default_a_session_is_revised_at_its_online_models_slots_and_with_no_calls_never() -> None:
    """revise_at_calls None (the gateway's default): calls 2, 3, 4, 5 of a session are the online model's
    slots, so it is asked at each; () (`--revise-at-calls` with no number): never, as the paper's Basin."""
    for calls, asked in ((None, [2, 3, 4, 5]), ((), []), ((4,), [4])):
        model = RevisingStub({"task": 900.0})
        async with ops_rig(model=model, reservation_quantile=0.9, revise_at_calls=calls) as rig:
            turns = ["task"]
            for n in range(2, 7):
                turns.append(f"turn {n}")
                assert (await rig.chat("s", *turns[:n])).status_code == 200
            expected = FakeOnline.slots if calls is None else calls
            assert rig.gateway.predictors.revise_calls(None) == frozenset(expected)
        assert [len(prompts) for _, prompts, _ in model.online.asked] == asked, calls


async def test_no_revision_without_an_online_model() -> None:
    model = ReservingStub({"task": 900.0})  # no `online`
    async with ops_rig(model=model, reservation_quantile=0.9, revise_at_calls=(2, 3)) as rig:
        for turns in (["task"], ["task", "b"], ["task", "b", "c"]):
            assert (await rig.chat("s", *turns)).status_code == 200
        views = {v["session_id"]: v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]}
    assert views["s"]["reserved_peak_tokens"] == 9 * 900.0  # m(0.9) = 9 from the stub, unrevised


async def test_the_metrics_of_two_apps_do_not_collide() -> None:
    async with ops_rig() as one, ops_rig() as two:
        await one.chat("a", "task")
        assert (await scrape(one))["basin_calls_total{outcome=completed}"] == 1
        assert "basin_calls_total{outcome=completed}" not in await scrape(two)


async def test_a_shed_session_counts_as_shed() -> None:
    async with ops_rig() as rig:
        await rig.chat("a", "task")
        entry = rig.room.registry.get("a")
        assert entry is not None
        rig.gateway.telemetry.metrics.session_ended(entry, "shed")
        assert (await scrape(rig))["basin_sessions_shed_total"] == 1


# --- usage and the hit rate ----------------------------------------------------------------------


def _sse(*events: dict[str, Any], separator: bytes = b"\n\n") -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + separator for e in events) + b"data: [DONE]" + separator


CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}
USAGE_CHUNK = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 15}}}


@pytest.mark.parametrize("separator", [b"\n\n", b"\r\n\r\n", b"\r\r"], ids=["LF", "CRLF", "CR"])
@pytest.mark.parametrize("asks_for_usage", [False, True])
async def test_a_streamed_call_gets_its_usage_which_a_client_that_did_not_ask_never_sees(asks_for_usage: bool,
                                                                                         separator: bytes) -> None:
    stream = _sse(CHUNK, USAGE_CHUNK, separator=separator)  # every SSE line ending is legal

    async def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream)

    async with ops_rig() as rig:
        rig.upstream.handler = answer
        fields: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if asks_for_usage \
            else {"stream": True}
        response = await rig.chat("s", "task", **fields)
        entry = rig.room.registry.get("s")

    assert rig.upstream.bodies()[0]["stream_options"] == {"include_usage": True}
    assert entry is not None and (entry.calls[0].completion_tokens, entry.calls[0].cached_tokens) == (3, 15)
    assert entry.calls[0].outcome == "completed"
    # Byte for byte what the upstream wrote, less the usage-only chunk the gateway itself asked for.
    assert response.content == (stream if asks_for_usage else _sse(CHUNK, separator=separator))


async def test_a_generate_call_gets_its_cached_tokens_from_meta_info() -> None:
    async def meta(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"text": "x", "meta_info": {"prompt_tokens": 12, "completion_tokens": 2,
                                                                      "cached_tokens": 6}})

    async with ops_rig() as rig:
        rig.upstream.handler = meta
        response = await rig.client.post("/generate", json={"text": "def f():"}, headers={"X-Session-ID": "g"})
        assert response.status_code == 200
        entry = rig.room.registry.get("g")
        assert entry is not None and (entry.calls[0].completion_tokens, entry.calls[0].cached_tokens) == (2, 6)
        assert rig.gateway.hit_rate() == 0.5


async def test_each_tick_gets_the_windowed_hit_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    async with ops_rig() as rig:
        seen: list[float | None] = []
        real_tick = rig.policy.tick

        def tick(now: float, hit_rate: float | None = None, ttft_s: float | None = None) -> list[Any]:
            seen.append(hit_rate)
            return real_tick(now, hit_rate, ttft_s)

        monkeypatch.setattr(rig.policy, "tick", tick)
        await rig.room.tick()
        await rig.chat("s", "task")  # 9 prompt tokens, 4 cached
        await rig.room.tick()
        rig.clock.advance(61.0)
        await rig.room.tick()
    assert seen == [None, pytest.approx(4 / 9), None]


# --- admin ---------------------------------------------------------------------------------------


async def test_state_and_sessions_show_the_policy_and_each_session() -> None:
    async with ops_rig() as rig:
        await rig.chat("s", "task")
        state = (await rig.client.get("/basin/state")).json()
        sessions = (await rig.client.get("/basin/sessions")).json()["sessions"]
    assert state["policy"] == {**rig.policy.snapshot().to_dict()} and state["policy"]["live"] == ["s"]
    assert state["hit_rate"] == pytest.approx(4 / 9) and state["is_shadow"] is False
    assert state["lending"] == {"sessions_by_decode_instance": {"http://d1": 1}, "cached_tokens_by_tier": {},
                                "calls_moved": 0}
    assert [(s["session_id"], s["state"], s["num_calls"], s["served_by"]) for s in sessions] == \
        [("s", "live", 1, "http://d1")]


async def test_a_budget_change_applies_at_once_and_admits_who_now_fits() -> None:
    async with ops_rig(budget_tokens=1, model=StubModel(default=50.0)) as rig:
        await rig.chat("a", "task a")
        waiting = asyncio.create_task(rig.chat("b", "task b"))
        await eventually(lambda: rig.policy.is_queued("b"))
        bad = await rig.client.put("/basin/budget", json={"budget_tokens": 0})
        assert bad.status_code == 400 and "budget_tokens" in bad.text and rig.policy.is_queued("b")
        moved = await rig.client.put("/basin/budget", json={"budget_tokens": 1_000_000})
        assert moved.status_code == 200 and moved.json()["policy"]["reference_budget_tokens"] == 1_000_000
        assert (await asyncio.wait_for(waiting, 2)).status_code == 200
        samples = await scrape(rig)
        assert samples["basin_reference_budget_tokens"] == 1_000_000
        assert samples["basin_budget_tokens"] == rig.policy.snapshot().budget_tokens > 1


async def test_reloads_swap_models_and_apply_the_calibration_budget_or_change_nothing(tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"knee_tokens": 10_000, "cache_capacity_tokens": 50_000}))
    config = GatewayConfig(upstream="http://router", default_model=MODEL_FILE, calibration=calibration)
    async with ops_rig(reloader=Reloader(config)) as rig:
        old = rig.gateway.predictors
        done = await rig.client.post("/basin/reload", json={"models": True, "calibration": True})
        assert done.status_code == 200 and done.json() == {"reloaded": {"models": 1, "budget_tokens": 9000}}
        assert rig.gateway.predictors is not old and rig.policy.snapshot().reference_budget_tokens == 9000

        calibration.write_text("{not json")
        broken = await rig.client.post("/basin/reload", json={"calibration": True})
        assert broken.status_code == 400 and str(calibration) in broken.text
        assert rig.policy.snapshot().reference_budget_tokens == 9000
        assert (await rig.client.post("/basin/reload", json={"models": "yes"})).status_code == 400

        calibration.write_text(json.dumps({"knee_tokens": 20_000, "cache_capacity_tokens": 50_000,
                                           "reservation_ratio": 2.0, "predictor_sha256": "cd" * 32,
                                           "reservation_quantile": 0.9}))
        for body in ({"models": True}, {"calibration": True}):  # r measured for another model file: refused
            kept = rig.gateway.predictors
            refused = await rig.client.post("/basin/reload", json=body)
            assert refused.status_code == 400 and "predictor SHA-256 cdcdcdcdcdcd" in refused.text
            assert rig.gateway.predictors is kept and rig.policy.snapshot().reference_budget_tokens == 9000


async def test_admin_endpoints_need_the_token_when_one_is_set() -> None:
    async with ops_rig() as rig:
        app = create_app(rig.gateway, admin_token="secret")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            for method, path in [("GET", "/basin/state"), ("GET", "/basin/sessions"), ("PUT", "/basin/budget"),
                                 ("POST", "/basin/reload"), ("PUT", "/basin/shadow")]:
                assert (await client.request(method, path, json={})).status_code == 401, path
            ok = await client.get("/basin/state", headers={"Authorization": "Bearer secret"})
            assert ok.status_code == 200


# --- shadow mode ---------------------------------------------------------------------------------


async def test_shadow_mode_decides_and_reports_but_holds_no_one() -> None:
    async with ops_rig(budget_tokens=1, is_shadow=True) as rig:
        await rig.chat("a", "task a")
        response = await asyncio.wait_for(rig.chat("b", "task b"), 2)  # would wait; goes through
        assert response.status_code == 200 and rig.policy.is_queued("b")
        samples = await scrape(rig)
        assert (samples["basin_shadow_would_hold_total"], samples["basin_shadow_mode"]) == (1, 1)
        assert samples["basin_queued_sessions"] == 1

        assert (await rig.client.put("/basin/shadow", json={"enabled": False})).json() == {"is_shadow": False}
        held = asyncio.create_task(rig.chat("c", "task c"))
        await held_in_the_queue(rig, "c")
        assert not held.done()  # out of shadow mode, a queued session waits again
        await rig.client.post("/basin/sessions/c/end")
        assert (await asyncio.wait_for(held, 2)).status_code == 409


# --- lending -------------------------------------------------------------------------------------


def _generate_answer(worker: str, tiers: dict[str, int]) -> Handler:
    """A `/generate` answer from decode worker `worker` reporting `tiers` as SGLang's cached_tokens_details."""
    async def handler(request: httpx.Request) -> httpx.Response:
        meta = {"prompt_tokens": 900, "completion_tokens": 10, "cached_tokens": sum(tiers.values()),
                "cached_tokens_details": {**tiers, "storage_backend": "HiCacheFile"}}
        return httpx.Response(200, json={"text": "ok", "meta_info": meta}, headers={"x-smg-routed-worker-id": worker})

    return handler


async def test_the_tracker_keeps_what_engines_report_and_counts_a_move_between_decode_instances() -> None:
    lending = LendingTracker()
    async with ops_rig(lending=lending) as rig:
        rig.upstream.handler = _generate_answer("http://d1", {"device": 0, "host": 0, "storage": 512})
        assert (await rig.client.post("/generate", json={"text": "task", "user": "s"})).status_code == 200
        rig.upstream.handler = _generate_answer("http://d2", {"device": 640, "host": 0, "storage": 0})
        assert (await rig.client.post("/generate", json={"text": "task and more", "user": "s"})).status_code == 200
        kv = lending.of("s")
        assert kv is not None and (kv.served_by, kv.calls_moved) == ("http://d2", 1)
        assert kv.cached_tiers == {"device": 640, "host": 0, "storage": 0}
        samples = await scrape(rig)
        assert samples["basin_upstream_cached_tier_tokens_total{tier=storage}"] == 512
        assert samples["basin_upstream_cached_tier_tokens_total{tier=device}"] == 640
        assert samples["basin_decode_instance_moves_total"] == 1
        await rig.client.post("/basin/sessions/s/end")
    assert lending.of("s") is None and lending.to_dict()["cached_tokens_by_tier"] == {"device": 640, "host": 0,
                                                                                    "storage": 512}


async def test_no_write_back_hint_is_sent_and_a_client_routing_key_is_replaced_by_the_sessions() -> None:
    async with ops_rig() as rig:
        await rig.chat("s", "task", headers={"x-smg-routing-key": "forged"})
        await rig.chat("s", "task", "next")
        first, second = rig.upstream.requests
    assert not any(k.lower() == "x-basin-writeback" for k in [*first.headers, *second.headers])
    assert first.headers["x-smg-routing-key"] == second.headers["x-smg-routing-key"] == routing_key("s")
    assert [json.loads(r.content)["rid"] for r in (first, second)] == [f"{routing_key('s')}_t0",
                                                                      f"{routing_key('s')}_t1"]


# --- the session log -----------------------------------------------------------------------------


def _ingest(tmp_path: Path, src: Path) -> tuple[int, Path]:
    out = tmp_path / "out.parquet"
    code = ingest_main(["--format", "gateway-log", "--benchmark", "live", "--out", str(out), "--quiet", str(src)])
    return code, out


async def test_finished_sessions_are_logged_and_read_back_by_ingest(tmp_path: Path) -> None:
    writer = SessionLogWriter(tmp_path / "log" / "sessions.jsonl", keep_text=True)
    async with ops_rig(session_log=writer, model=StubModel(default=321.0)) as rig:
        await rig.chat("s", "fix the bug")
        rig.clock.advance(2.0)
        await rig.chat("s", "fix the bug", "more")
        await rig.client.post("/basin/sessions/s/end")
    await asyncio.to_thread(writer.close)

    lines = (tmp_path / "log" / "sessions.jsonl").read_text().splitlines()
    record = SessionLogRecord.from_json(lines[0])
    assert len(lines) == 1 and (record.session_id, record.model, record.end_reason) == ("s", "m", "ended")
    assert record.task_text == "fix the bug" and record.predicted_peak_tokens == 321.0
    assert [(c.completion_tokens, c.cached_tokens) for c in record.calls] == [(1, 4), (1, 4)]
    code, out = _ingest(tmp_path, tmp_path / "log")
    sessions = read_sessions(out)
    assert code == 0 and [s.session_id for s in sessions] == ["s"]
    assert [(c.prompt_tokens, c.completion_tokens, c.cached_tokens) for c in sessions[0].calls] == \
        [(c.prompt_tokens, 1, 4) for c in record.calls]
    assert sessions[0].task_text == "fix the bug" and sessions[0].calls[0].gap_s == pytest.approx(2.0)


async def test_the_log_rotates_keeps_the_newest_files_and_ingest_reads_the_folder(tmp_path: Path) -> None:
    writer = SessionLogWriter(tmp_path / "sessions.jsonl", max_bytes=600, keep_files=2, keep_text=True)
    async with ops_rig(session_log=writer) as rig:
        for k in range(6):
            await rig.chat(f"s{k}", f"task number {k}")
            await rig.client.post(f"/basin/sessions/s{k}/end")
    await asyncio.to_thread(writer.close)

    rotated = writer.rotated_files()
    assert len(rotated) == 2 and all(p.stat().st_size <= 600 for p in [*rotated, writer.path])
    kept = [SessionLogRecord.from_json(line).session_id
            for p in [*rotated, writer.path] for line in p.read_text().splitlines()]
    assert kept == [f"s{k}" for k in range(6 - len(kept), 6)] and len(kept) < 6  # the oldest files were deleted
    code, out = _ingest(tmp_path, tmp_path)
    assert code == 0 and sorted(s.session_id for s in read_sessions(out)) == sorted(kept)


async def test_text_free_logging_keeps_counts_only_and_ingest_rejects_it_for_text_models(tmp_path: Path) -> None:
    writer = SessionLogWriter(tmp_path / "sessions.jsonl")  # the default: no raw text unless asked
    async with ops_rig(session_log=writer) as rig:
        await rig.chat("s", "secret task text")
        await rig.client.post("/basin/sessions/s/end")
    await asyncio.to_thread(writer.close)

    raw = (tmp_path / "sessions.jsonl").read_text()
    record = SessionLogRecord.from_json(raw)
    assert "secret" not in raw and record.task_text is None and record.task_chars == len("secret task text")
    out = tmp_path / "out.parquet"
    ingest_main(["--format", "gateway-log", "--benchmark", "live", "--out", str(out), "--quiet",
                 "--max-reject-fraction", "1", str(tmp_path / "sessions.jsonl")])
    rejects = (tmp_path / "out.rejects.jsonl").read_text()
    assert "text-free" in rejects


async def test_appending_after_close_raises(tmp_path: Path) -> None:
    writer = SessionLogWriter(tmp_path / "sessions.jsonl")
    await asyncio.to_thread(writer.close)
    with pytest.raises(RuntimeError, match="closed"):
        writer.append(SessionLogRecord("s", "m", "t", None, 0, 0.0, 1.0, "ended", ()))


async def test_a_record_that_does_not_encode_is_skipped_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    writer = SessionLogWriter(tmp_path / "sessions.jsonl")
    writer.append(SessionLogRecord("bad", "m\ud800", "t", None, 0, 0.0, 1.0, "ended", ()))  # a lone surrogate
    writer.append(SessionLogRecord("good", "m", "t", None, 0, 0.0, 1.0, "ended", ()))
    await asyncio.to_thread(writer.flush)
    writer.append(SessionLogRecord("later", "m", "t", None, 0, 0.0, 1.0, "ended", ()))
    await asyncio.to_thread(writer.close)
    ids = [SessionLogRecord.from_json(line).session_id for line in writer.path.read_text().splitlines()]
    assert ids == ["good", "later"] and (writer.num_written, writer.num_failed) == (2, 1)


async def test_the_writers_line_reads_back_as_the_records_own_json(tmp_path: Path) -> None:
    """The writer encodes with orjson; what it writes must read back exactly as `to_json`'s line does."""
    from basin_runtime.session_log import LoggedCall

    calls = (LoggedCall(1.5, 2.25, 1200, 80, 1000, "completed"), LoggedCall(3.0, 1e16, 2**40, 0, None, "client_gone"))
    record = SessionLogRecord("s-é", "qwen", "qwen3.6", "fix the 日本語 bug \"quoted\"\n", 25, 0.1, 1e9 + 0.5,
                              "ended", calls, workload="tb", predicted_peak_tokens=12345.678,
                              reserved_peak_tokens=2.5e7)
    writer = SessionLogWriter(tmp_path / "sessions.jsonl", keep_text=True)
    writer.append(record)
    await asyncio.to_thread(writer.close)
    (line,) = writer.path.read_text(encoding="utf-8").splitlines()
    assert json.loads(line) == json.loads(record.to_json())
    assert SessionLogRecord.from_json(line) == SessionLogRecord.from_json(record.to_json()) == record


async def test_the_log_is_owner_only_and_a_torn_last_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    path = tmp_path / "log" / "sessions.jsonl"
    writer = SessionLogWriter(path)
    writer.append(SessionLogRecord("a", "m", "t", None, 0, 0.0, 1.0, "ended", ()))
    await asyncio.to_thread(writer.close)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    with path.open("ab") as handle:
        handle.write(b'{"session_id": "torn", "mod')  # a crash mid-append
    writer = SessionLogWriter(path)
    writer.append(SessionLogRecord("b", "m", "t", None, 0, 0.0, 1.0, "ended", ()))
    await asyncio.to_thread(writer.close)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1].startswith('{"session_id": "torn"')
    assert [SessionLogRecord.from_json(lines[k]).session_id for k in (0, 2)] == ["a", "b"]


# --- deploy files --------------------------------------------------------------------------------


async def test_the_alert_rules_and_the_dashboard_use_only_metrics_the_gateway_exports() -> None:
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    rules = yaml.safe_load((deploy / "prometheus-alerts.yaml").read_text())
    dashboard = json.loads((deploy / "grafana-dashboard.json").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    async with ops_rig() as rig:
        await rig.chat("s", "task")
        await rig.client.post("/basin/sessions/s/end")  # a labelled counter has samples once a label is used
        exported = {re.sub(r"\{.*", "", key.split("[")[0]) for key in await scrape(rig)}
    used = {name for expr in exprs for name in re.findall(r"\bbasin_[a-z_]+", expr)}
    assert used and used <= exported, sorted(used - exported)


async def test_the_issue_6_options_come_from_the_file_and_bad_values_name_the_key(tmp_path: Path) -> None:
    from basin_runtime.gateway.config import ConfigError, load_config

    good = tmp_path / "good.yaml"
    good.write_text("upstream: http://r\nmodel: m.onnx\nbudget_tokens: 5\nshadow: true\nsession_log: log/s.jsonl\n"
                    "session_log_keep_text: false\nengine_priority_levels: 8\nrouting_key_header: x-key\n"
                    "hit_rate_window_s: 30\n")
    config = load_config({"config": str(good)})
    assert (config.shadow, config.session_log, config.session_log_keep_text) == (True, tmp_path / "log/s.jsonl", False)
    assert (config.engine_priority_levels, config.routing_key_header, config.hit_rate_window_s) == (8, "x-key", 30.0)
    for bad, key in [("engine_priority_levels: 0", "engine_priority_levels"),
                     ("engine_priority_levels: 65", "engine_priority_levels"),
                     ("engine_preemption_threshold: -1", "engine_preemption_threshold"),
                     ("routing_key_header: 'a b'", "routing_key_header"), ("shadow: 1", "shadow")]:
        path = tmp_path / "bad.yaml"
        path.write_text(f"upstream: http://r\nmodel: m.onnx\n{bad}\n")
        with pytest.raises(ConfigError, match=key):
            load_config({"config": str(path)})


async def test_calls_in_flight_counts_forwarded_calls_until_they_end() -> None:
    release = asyncio.Event()

    async def held(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return httpx.Response(200, json={"id": "x", "choices": [], "usage": {"prompt_tokens": 9}})

    async with ops_rig() as rig:
        rig.upstream.handler = held
        calls = [asyncio.create_task(rig.chat(name, "task")) for name in ("a", "b")]
        await eventually(lambda: len(rig.upstream.requests) == 2)
        assert (await scrape(rig))["basin_calls_in_flight"] == 2
        release.set()
        assert [(await call).status_code for call in calls] == [200, 200]
        assert (await scrape(rig))["basin_calls_in_flight"] == 0

"""The gateway's request path, driven in-process: a mock upstream (`httpx.MockTransport`), a scripted clock.

`Rig` wires a real `Gateway` (real tokenizer, real policy) to a stub predictor and a recording fake
upstream. Most calls go through `httpx.ASGITransport`; tests that must see bytes as they are sent or
make the client vanish drive the ASGI app directly (`RawCall`), since ASGITransport buffers answers.
The `rig` and `full` fixtures (`conftest.py`) are rigs made by `rig_for`.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from starlette.applications import Starlette

from basin_runtime.clock import ManualClock
from basin_runtime.gateway.app import create_app
from basin_runtime.gateway.build import assemble
from basin_runtime.gateway.gateway import Gateway, GatewaySettings
from basin_runtime.gateway.measure import Meter
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.predictors import Predictors
from basin_runtime.gateway.priority import routing_key
from basin_runtime.gateway.proxy import CallEnd, Upstream, UpstreamResponse
from basin_runtime.gateway.telemetry import Telemetry
from basin_runtime.gateway.upstream import UpstreamClient
from basin_runtime.gateway.waiting import WaitingRoom
from basin_runtime.policy import Policy, PolicyConfig
from basin_runtime.session_keys import SessionKeys
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer
from tests.runtime.httpx_upstream import HttpxUpstreamClient

pytestmark = pytest.mark.asyncio

TOKENIZER = get_tokenizer("qwen3.6")
CHAT = "/v1/chat/completions"
ANSWER = {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
          "content": "done"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 9, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}}
Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


class StubModel:
    """Predicts a fixed peak per task text and remembers what it was asked."""

    def __init__(self, peaks: dict[str, float] | None = None, default: float = 1000.0) -> None:
        self.peaks = peaks or {}
        self.default = default
        self.asked: list[tuple[str, int]] = []

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        self.asked.append((task_text, first_prompt_tokens))
        return self.peaks.get(task_text, self.default)


@dataclass
class FakeUpstream:
    """Answers like an SGLang router and records every request; `handler` replaces the answer."""

    requests: list[httpx.Request] = field(default_factory=list)
    handler: Handler | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.handler is not None:
            return await self.handler(request)
        if request.method == "GET":
            return httpx.Response(200, json={"path": request.url.path, "query": request.url.query.decode()})
        return httpx.Response(200, json=ANSWER, headers={"date": "upstream's", "x-smg-routed-worker-id": "http://d1"})

    def bodies(self, path: str = CHAT) -> list[dict[str, Any]]:
        """JSON bodies of the POSTs to `path`, in order."""
        return [json.loads(r.content) for r in self.requests if r.method == "POST" and r.url.path == path]


@dataclass
class Rig:
    """A gateway wired to a fake upstream, a stub predictor and a manual clock."""

    gateway: Gateway
    app: Starlette
    clock: ManualClock
    upstream: FakeUpstream
    model: StubModel
    client: httpx.AsyncClient

    @property
    def room(self) -> WaitingRoom:
        return self.gateway.room

    @property
    def policy(self) -> Policy:
        return self.gateway.room.policy

    async def chat(self, session: str | None, *contents: str, headers: dict[str, str] | None = None,
                   **fields: Any) -> httpx.Response:
        """A chat call whose user turns are `contents` (assistant turns in between)."""
        sent = dict(headers or {})
        if session is not None:
            sent["X-Session-ID"] = session
        return await self.client.post(CHAT, json={"model": "m", "messages": conversation(*contents), **fields},
                                      headers=sent)


def conversation(*contents: str, system: str | None = None) -> list[dict[str, str]]:
    """User turns `contents` with an assistant answer after each but the last."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    for k, content in enumerate(contents):
        if k:
            messages.append({"role": "assistant", "content": f"answer {k}"})
        messages.append({"role": "user", "content": content})
    return messages


TELEMETRY_PARTS = ("hit_window", "lending", "session_log", "engine_sessions", "task_memory")
ASSEMBLY_ARGUMENTS = ("live_sessions", "adoption_window_s")


@asynccontextmanager
async def rig_for(*, budget_tokens: int = 1_000_000, model: StubModel | None = None, admin_token: str | None = None,
                  workload_models: dict[str, StubModel] | None = None, gateway_options: dict[str, Any] | None = None,
                  app_options: dict[str, Any] | None = None, reservation_quantile: float | None = None,
                  revise_at_calls: tuple[int, ...] | None = (), upstream_client: UpstreamClient | None = None,
                  clock: ManualClock | None = None, **policy: Any) -> AsyncIterator[Rig]:
    """A fresh rig; everything it opened is closed on exit (`gateway_options`: `GatewaySettings` fields, `Telemetry`
    parts and `assemble` arguments; `app_options`: extra create_app arguments; `upstream_client`: a real client
    instead of the fake upstream, which then sees nothing)."""
    clock = clock or ManualClock()
    upstream = FakeUpstream()
    model = model or StubModel()
    mock_client = httpx.AsyncClient(transport=httpx.MockTransport(upstream), base_url="http://router")
    options = dict(gateway_options or {})
    parts = {name: options.pop(name) for name in TELEMETRY_PARTS if name in options}
    wiring = {name: options.pop(name) for name in ASSEMBLY_ARGUMENTS if name in options}
    telemetry = Telemetry(clock, GatewayMetrics(), tokenizer_name=TOKENIZER.name, **parts)
    settings = GatewaySettings(session_keys=SessionKeys(admin_token), **options)
    gateway = assemble(settings, clock, Meter(TOKENIZER, TaskTextRule()),
                       Predictors(model, workload_models, reservation_quantile, revise_at_calls),
                       Upstream(upstream_client or HttpxUpstreamClient(mock_client)), telemetry, retry_after_s=30,
                       policy=Policy(PolicyConfig(budget_tokens=budget_tokens, **policy)), **wiring)
    app = create_app(gateway, admin_token=admin_token, **(app_options or {}))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
    try:
        yield Rig(gateway, app, clock, upstream, model, client)
    finally:
        await client.aclose()
        await mock_client.aclose()


async def eventually(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait (in real time, bounded) until `condition()` holds."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


async def held_in_the_queue(rig: Rig, *session_ids: str, waiters: int = 1) -> None:
    """Prove calls are held, not slow, without sleeping: every call of each session waits on the session's open
    decision (which only the room resolves), and a minute on the clock with a tick of the policy resolves none."""
    def waiting() -> bool:
        entries = [rig.room.registry.get(s) for s in session_ids]
        return all(e is not None and e.waiters == waiters for e in entries)

    await eventually(waiting)
    rig.clock.advance(60)
    await rig.room.tick()
    for session_id in session_ids:
        entry = rig.room.registry.get(session_id)
        assert entry is not None and entry.state == "queued" and not entry.decision.done()
        assert entry.waiters == waiters


class RawCall:
    """One request driven straight into the ASGI app: every message it sends is seen, and the client can leave."""

    def __init__(self, app: Starlette, body: dict[str, Any], session: str, path: str = CHAT) -> None:
        self.app = app
        self.data = json.dumps(body).encode()
        self.path = path
        self.headers = [(b"content-type", b"application/json"), (b"x-session-id", session.encode())]
        self.sent: list[MutableMapping[str, Any]] = []
        self.leave = asyncio.Event()
        self.got_body = asyncio.Event()
        self._body_sent = False

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                 "query_string": b"", "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 5000),
                 "server": ("gateway", 80)}
        await self.app(scope, self._receive, self._send)

    async def _receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.data, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.got_body.set()

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.sent if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def body_chunks(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body" and m.get("body")]


# --- forwarding, priority, rid -------------------------------------------------------------------


async def test_health_is_answered_by_the_gateway_itself(rig: Rig) -> None:
    response = await rig.client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert rig.upstream.requests == []


async def test_a_call_is_forwarded_with_the_session_priority_a_rid_and_the_client_authorization(rig: Rig) -> None:
    response = await rig.chat("s1", "fix the bug", headers={"Authorization": "Bearer client-key"})

    assert response.status_code == 200
    assert response.json() == ANSWER
    assert response.headers["x-session-id"] == "s1"
    assert response.headers["x-smg-routed-worker-id"] == "http://d1"
    assert response.headers.get("date") != "upstream's"
    assert rig.room.registry.get("s1").calls[0].served_by == "http://d1"  # type: ignore[union-attr]
    (sent,) = rig.upstream.requests
    assert sent.headers["authorization"] == "Bearer client-key"
    assert sent.headers["accept-encoding"] == "identity"
    body = json.loads(sent.content)
    assert body["priority"] == 0  # the only session held: the most urgent level
    key = routing_key("s1")
    assert sent.headers["x-smg-routing-key"] == key and body["rid"] == f"{key}_t0"
    assert body["messages"] == conversation("fix the bug")


async def test_the_gateway_owns_rid_and_priority_a_client_cannot_choose_them(rig: Rig) -> None:
    # Issue 36 item 10: a client's rid (SGLang keys a request's state and abort on it, smg its routing) is replaced,
    # as its priority is, however it spells the key; the rest of its bytes go on as they were.
    raw = (b'{"model": "m", "r\\u0069d": "other-session_t0", "messages": [{"role": "user", "content": "task"}], '
           b'"priority": 999, "rid": "client-rid-7", "temperature": 0.5}')
    response = await rig.client.post(CHAT, content=raw, headers={"X-Session-ID": "s1", "X-SMG-Routing-Key": "theirs",
                                                                  "content-type": "application/json"})
    assert response.status_code == 200
    (sent,) = rig.upstream.requests
    key = routing_key("s1")
    assert sent.content == (b'{"model": "m","messages": [{"role": "user", "content": "task"}],"temperature": 0.5,'
                            b'"priority":0,"rid":"' + key.encode() + b'_t0"}')
    assert sent.headers.get_list("x-smg-routing-key") == [key]  # the client's key is replaced
    assert rig.room.registry.get("s1").calls[0].rid == f"{key}_t0"  # type: ignore[union-attr]


async def test_a_batch_prompt_gets_the_priority_and_loses_a_client_rid(rig: Rig) -> None:
    for body in ({"prompt": ["a", "b"], "user": "u"}, {"prompt": ["a", "b"], "user": "u", "rid": ["x", "y"]}):
        response = await rig.client.post("/v1/completions", json=body)
        assert response.status_code == 200
    for body in rig.upstream.bodies("/v1/completions"):
        assert "rid" not in body and isinstance(body["priority"], int)  # SGLang makes one rid per item


async def test_priority_levels_follow_the_basin_order_not_the_arrival_order() -> None:
    model = StubModel({"big task": 30_000, "small task": 300})
    async with rig_for(model=model) as rig:
        await rig.chat("big", "big task")  # p = 1000 + 30000/30 = 2000; alone: level 0
        rig.clock.advance(5.5)
        await rig.chat("small", "small task")  # p = 1005.5 + 300/30 = 1015.5: ahead of big, level 0 of 4
        rig.clock.advance(100)
        await rig.chat("big", "big task", "and more")  # now second of two: level 2 of 4, 2 x 11
        priorities = [(b["messages"][0]["content"], b["priority"]) for b in rig.upstream.bodies()]
    assert priorities == [("big task", 0), ("small task", 0), ("big task", 22)]


async def test_later_calls_go_straight_through_and_tell_the_policy_their_prompt_size(rig: Rig) -> None:
    await rig.chat("s1", "task")
    rig.clock.advance(3)
    response = await rig.chat("s1", "task", "run the tests", "now fix it")

    assert response.status_code == 200
    grown = conversation("task", "run the tests", "now fix it")
    assert rig.policy.snapshot().working_set_tokens == TOKENIZER.count_prompt(grown)
    assert len(rig.model.asked) == 1  # predicted once, at the first call
    entry = rig.room.registry.get("s1")
    assert entry is not None
    assert [c.prompt_tokens for c in entry.calls] == [TOKENIZER.count_prompt(conversation("task")),
                                                      TOKENIZER.count_prompt(grown)]
    assert [c.outcome for c in entry.calls] == ["completed", "completed"]
    assert [b["rid"][-3:] for b in rig.upstream.bodies()] == ["_t0", "_t1"]


# --- session identity ----------------------------------------------------------------------------


async def test_identity_comes_from_the_header_then_the_user_field(rig: Rig) -> None:
    await rig.chat("from-header", "task", user="ignored-user")
    await rig.chat(None, "task", user="alice")
    assert rig.policy.snapshot().live == ("from-header", "alice")


async def test_identity_falls_back_to_a_hash_of_the_first_messages(rig: Rig) -> None:
    first = await rig.client.post(CHAT, json={"messages": conversation("task A", system="sys")})
    later = await rig.client.post(CHAT, json={"messages": conversation("task A", "go on", system="sys")})
    other = await rig.client.post(CHAT, json={"messages": conversation("task B", system="sys")})

    session = first.headers["x-session-id"]
    assert session.startswith("conv-")
    assert later.headers["x-session-id"] == session != other.headers["x-session-id"]
    assert rig.policy.snapshot().live == (session, other.headers["x-session-id"])
    assert len(rig.room.registry.get(session).calls) == 2  # type: ignore[union-attr]


async def test_a_raw_prompt_without_identity_is_a_session_of_its_own_that_ends_with_its_call(rig: Rig) -> None:
    response = await rig.client.post("/generate", json={"text": "def f():", "sampling_params": {}})
    assert response.status_code == 200
    assert len(rig.upstream.bodies("/generate")) == 1
    assert len(rig.room.registry) == 0
    assert rig.policy.snapshot().live == ()


async def test_the_session_header_name_is_configurable() -> None:
    async with rig_for(gateway_options={"session_header": "X-Agent-Run"}) as rig:
        response = await rig.client.post(CHAT, json={"messages": conversation("t")}, headers={"X-Agent-Run": "r9"})
        assert response.headers["x-agent-run"] == "r9"
        assert rig.policy.snapshot().live == ("r9",)


async def test_the_workload_header_picks_the_model_and_unknown_workloads_get_the_default() -> None:
    swe = StubModel(default=6000)
    async with rig_for(workload_models={"swe": swe}) as rig:
        await rig.chat("a", "task a", headers={"X-Basin-Workload": "swe"})
        await rig.chat("b", "task b", headers={"X-Basin-Workload": "unknown-bench"})
        entry_a, entry_b = rig.room.registry.get("a"), rig.room.registry.get("b")
    assert [t for t, _ in swe.asked] == ["task a"]
    assert [t for t, _ in rig.model.asked] == ["task b"]
    assert entry_a is not None and entry_b is not None
    assert (entry_a.predicted_peak_tokens, entry_a.workload) == (6000, "swe")
    assert (entry_b.predicted_peak_tokens, entry_b.workload) == (1000, "unknown-bench")


async def test_two_first_calls_of_one_new_session_at_once_make_one_session(rig: Rig) -> None:
    responses = await asyncio.gather(rig.chat("twin", "task"), rig.chat("twin", "task"))
    assert [r.status_code for r in responses] == [200, 200]
    assert rig.policy.snapshot().live == ("twin",)
    assert len(rig.room.registry.get("twin").calls) == 2  # type: ignore[union-attr]


# --- conversations that arrive with history (the restart-adoption rule: test_gateway_restart.py) ------


async def test_a_first_call_with_history_is_predicted_and_arrives_like_any_new_session(rig: Rig) -> None:
    messages = conversation("the task", "tests fail", "try again")
    response = await rig.client.post(CHAT, json={"messages": messages}, headers={"X-Session-ID": "old"})

    assert response.status_code == 200
    entry = rig.room.registry.get("old")
    assert entry is not None and not entry.is_adopted and entry.state == "live"
    whole = TOKENIZER.count_prompt(messages)
    assert rig.model.asked == [("the task", whole)]  # what the engine will hold: the history too (issue 36 item 1)
    assert rig.policy.snapshot().working_set_tokens == whole


async def test_fabricated_histories_cannot_skip_the_queue(full: Rig) -> None:
    """20 sessions whose first call carries a made-up assistant turn: one runs, the rest wait their turn."""
    await full.chat("live", "task")
    calls = [asyncio.create_task(full.chat(f"fake-{k}", f"task {k}", "more")) for k in range(20)]
    await eventually(lambda: len(full.policy.snapshot().queued) == 20)
    await held_in_the_queue(full, *(f"fake-{k}" for k in range(20)))

    assert not any(c.done() for c in calls)
    assert len(full.upstream.bodies()) == 1 and full.policy.snapshot().live == ("live",)
    for task in calls:
        task.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


# --- the waiting room ----------------------------------------------------------------------------


async def test_with_a_full_budget_a_second_session_waits_and_runs_once_the_first_ends(full: Rig) -> None:
    await full.chat("first", "task one")
    second = asyncio.create_task(full.chat("second", "task two"))
    await eventually(lambda: full.policy.is_queued("second"))
    await held_in_the_queue(full, "second")

    assert not second.done()
    assert len(full.upstream.bodies()) == 1
    ended = await full.client.post("/basin/sessions/first/end")
    assert ended.json() == {"session_id": "first", "was": "live", "calls": 1}
    response = await asyncio.wait_for(second, timeout=2)

    assert response.status_code == 200
    assert full.policy.snapshot().live == ("second",)
    assert [b["messages"][0]["content"] for b in full.upstream.bodies()] == ["task one", "task two"]


async def test_a_client_that_disconnects_while_queued_is_withdrawn(full: Rig) -> None:
    await full.chat("first", "task one")
    call = RawCall(full.app, {"messages": conversation("task two")}, session="second")
    task = asyncio.create_task(call.run())
    await eventually(lambda: full.policy.is_queued("second"))

    call.leave.set()
    await asyncio.wait_for(task, timeout=2)

    assert call.status == 499
    assert full.policy.snapshot().queued == ()
    assert full.room.registry.get("second") is None
    assert len(full.upstream.bodies()) == 1


async def test_a_cancelled_queued_call_is_withdrawn_and_the_next_session_goes_in(full: Rig) -> None:
    await full.chat("first", "task one")
    second = asyncio.create_task(full.chat("second", "task two"))
    await eventually(lambda: full.policy.is_queued("second"))
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second

    assert full.policy.snapshot().queued == ()
    await full.client.post("/basin/sessions/first/end")
    response = await asyncio.wait_for(full.chat("third", "task three"), timeout=2)
    assert response.status_code == 200
    assert full.policy.snapshot().live == ("third",)


async def test_a_shed_session_gets_503_with_retry_after_and_the_reason() -> None:
    async with rig_for(budget_tokens=1, peak_completion_rate_per_s=1e-4, shed_wait_s=10) as rig:
        await rig.chat("first", "task one")
        second = asyncio.create_task(rig.chat("second", "task two"))
        await eventually(lambda: rig.policy.is_queued("second"))
        rig.clock.advance(5)
        assert await rig.room.tick() == []  # the head has not waited long enough yet
        rig.clock.advance(6)
        events = await rig.room.tick()
        response = await asyncio.wait_for(second, timeout=2)

    assert [type(e).__name__ for e in events] == ["Shed"]
    assert response.status_code == 503
    assert response.headers["retry-after"] == "30"
    error = response.json()["error"]
    assert error["type"] == "session_shed"
    assert error["reason"] == events[0].reason and "arrival rate" in error["reason"]  # type: ignore[union-attr]
    assert error["session_id"] == "second" and error["retry_after_s"] == 30
    assert rig.room.registry.get("second") is None


async def test_a_session_ended_while_its_first_call_waits_gets_409(full: Rig) -> None:
    await full.chat("first", "task one")
    second = asyncio.create_task(full.chat("second", "task two"))
    await eventually(lambda: full.policy.is_queued("second"))
    ended = await full.client.post("/basin/sessions/second/end")
    response = await asyncio.wait_for(second, timeout=2)
    assert ended.json()["was"] == "queued"
    assert response.status_code == 409
    assert response.json()["error"]["type"] == "session_ended"


async def test_a_second_call_of_a_queued_session_waits_with_the_first(full: Rig) -> None:
    await full.chat("first", "task one")
    calls = [asyncio.create_task(full.chat("second", "task two")) for _ in range(2)]
    await eventually(lambda: full.policy.is_queued("second"))
    await held_in_the_queue(full, "second", waiters=2)
    assert not any(c.done() for c in calls)
    await full.client.post("/basin/sessions/first/end")
    responses = await asyncio.wait_for(asyncio.gather(*calls), timeout=2)
    assert [r.status_code for r in responses] == [200, 200]


# --- sessions ending -----------------------------------------------------------------------------


async def test_ending_an_unknown_session_is_404(rig: Rig) -> None:
    response = await rig.client.post("/basin/sessions/nobody/end")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "session_not_found"


async def test_the_admin_token_guards_the_basin_endpoints() -> None:
    async with rig_for(admin_token="s3cret") as rig:
        await rig.chat("s1", "task")
        missing = await rig.client.post("/basin/sessions/s1/end")
        wrong = await rig.client.post("/basin/sessions/s1/end", headers={"Authorization": "Bearer nope"})
        right = await rig.client.post("/basin/sessions/s1/end", headers={"Authorization": "Bearer s3cret"})
    assert [missing.status_code, wrong.status_code, right.status_code] == [401, 401, 200]
    assert missing.headers["www-authenticate"] == "Bearer"


async def test_an_idle_session_ends_after_the_timeout_but_not_while_a_call_is_in_flight(rig: Rig) -> None:
    await rig.chat("quiet", "task")
    release = asyncio.Event()
    rig.upstream.handler = lambda request: _slow_answer(release)
    busy = asyncio.create_task(rig.chat("busy", "task"))
    await eventually(lambda: len(rig.upstream.requests) == 2)

    rig.clock.advance(599)
    assert await rig.room.sweep_idle(600) == []
    rig.clock.advance(1)
    assert await rig.room.sweep_idle(600) == ["quiet"]
    release.set()
    await busy
    rig.clock.advance(599)
    assert await rig.room.sweep_idle(600) == []  # idle time counts from the end of the last call
    rig.clock.advance(1)
    assert await rig.room.sweep_idle(600) == ["busy"]
    assert rig.policy.snapshot().live == ()


async def test_the_timers_run_on_the_injected_clock(rig: Rig) -> None:
    await rig.chat("s1", "task")
    timers = asyncio.create_task(rig.room.run_timers(tick_interval_s=1.0, idle_timeout_s=60.0))
    try:
        await asyncio.sleep(0)
        for _ in range(70):
            rig.clock.advance(1.0)
            await asyncio.sleep(0)
        await eventually(lambda: rig.policy.snapshot().live == ())  # ended by the idle timer
        ticked_s = rig.policy.snapshot().now_s
        assert ticked_s is not None and ticked_s >= rig.clock.now() - 1  # and the tick timer kept the policy's time
    finally:
        timers.cancel()
        await asyncio.wait({timers})


async def _slow_answer(release: asyncio.Event) -> httpx.Response:
    await release.wait()
    return httpx.Response(200, json=ANSWER)


# --- streaming -----------------------------------------------------------------------------------


def _sse_upstream(release: asyncio.Event, closed: list[bool]) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                yield b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
                await release.wait()
                yield b'data: {"choices":[{"delta":{"content":"llo"}}]}\n\n'
                yield b"data: [DONE]\n\n"
            finally:
                closed.append(True)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    return handler


async def test_a_streamed_answer_passes_through_as_it_arrives_and_the_call_ends_with_it(rig: Rig) -> None:
    release, closed = asyncio.Event(), list[bool]()
    rig.upstream.handler = _sse_upstream(release, closed)
    call = RawCall(rig.app, {"messages": conversation("task"), "stream": True}, session="s1")
    task = asyncio.create_task(call.run())

    await asyncio.wait_for(call.got_body.wait(), timeout=2)  # the first event is out while the upstream waits
    entry = rig.room.registry.get("s1")
    assert entry is not None and entry.in_flight == 1 and entry.calls[0].ended_at is None
    assert call.body_chunks == [b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n']
    assert not rig.gateway.telemetry._awaiting_first_byte  # its first token is heard at the first event, not at the end
    release.set()
    await asyncio.wait_for(task, timeout=2)

    assert call.status == 200
    assert b"".join(call.body_chunks).endswith(b"data: [DONE]\n\n")
    assert (entry.in_flight, entry.calls[0].outcome, entry.calls[0].is_stream) == (0, "completed", True)
    assert entry.calls[0].ended_at is not None and closed == [True]


def _sse_events(*events: bytes) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return httpx.Response(200, headers={"content-type": "text/event-stream", "x-smg-routed-worker-id": "http://d1"},
                              content=chunks())

    return handler


# What smg 1.13 streams when the decode engine dies mid-answer (seen in tests/e2e/test_load_faults.py).
SMG_STREAM_ERROR = (b'data: {"error":{"message":"Stream error: error decoding response body: error reading a body '
                    b'from connection: unexpected EOF during chunk size line","type":"stream_error"}}\n\n')


async def test_an_error_event_in_the_stream_is_passed_on_and_ends_the_call_as_an_upstream_error(rig: Rig) -> None:
    assert (await rig.chat("s1", "task")).status_code == 200  # served once: a failed call does not release it
    rig.upstream.handler = _sse_events(b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n', SMG_STREAM_ERROR,
                                       b"data: [DONE]\n\n")
    rig.gateway.telemetry.lending.session_ended("s1")
    call = RawCall(rig.app, {"messages": conversation("task", "more"), "stream": True}, session="s1")
    await asyncio.wait_for(call.run(), timeout=2)

    assert call.status == 200 and SMG_STREAM_ERROR in b"".join(call.body_chunks)  # the client reads the failure
    entry = rig.room.registry.get("s1")
    assert entry is not None and (entry.in_flight, entry.calls[1].outcome) == (0, "upstream_error")
    assert rig.gateway.telemetry.lending.of("s1") is None  # a failed call reports nothing of the session's KV
    assert b'basin_calls_total{outcome="upstream_error"} 1.0' in rig.gateway.telemetry.metrics.render()
    assert rig.policy.is_live("s1")  # the session lives on; only the call failed


async def test_the_word_error_inside_streamed_text_is_not_an_error_event(rig: Rig) -> None:
    rig.upstream.handler = _sse_events(b'data: {"choices":[{"delta":{"content":"an \\"error\\": none"}}]}\n\n',
                                       b"data: [DONE]\n\n")
    call = RawCall(rig.app, {"messages": conversation("task"), "stream": True}, session="s1")
    await asyncio.wait_for(call.run(), timeout=2)

    entry = rig.room.registry.get("s1")
    assert call.status == 200 and entry is not None and entry.calls[0].outcome == "completed"


FIRST = b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def _failing_stream(*events: bytes, fails: Exception | None = None, content_type: str = "text/event-stream",
                    status: int = 200) -> Handler:
    """An upstream that streams `events`, then raises `fails` (a transport failure) or just ends."""
    async def handler(request: httpx.Request) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            for event in events:
                yield event
            if fails is not None:
                raise fails

        return httpx.Response(status, headers={"content-type": content_type}, content=chunks())

    return handler


async def _failing_call(rig: Rig, handler: Handler, *, is_stream: bool = True) -> RawCall:
    """Session s1's second call, answered by `handler` (the first was served: a failed call leaves it live)."""
    assert (await rig.chat("s1", "task")).status_code == 200
    rig.gateway.telemetry.lending.session_ended("s1")
    rig.upstream.handler = handler
    call = RawCall(rig.app, {"messages": conversation("task", "more"), "stream": is_stream}, session="s1")
    await asyncio.wait_for(call.run(), timeout=2)
    return call


def _second_call_outcome(rig: Rig) -> tuple[int, str | None]:
    entry = rig.room.registry.get("s1")
    assert entry is not None and len(entry.calls) == 2
    return entry.in_flight, entry.calls[1].outcome


def _error_of(body: bytes) -> dict[str, Any]:
    """The one SSE error event in `body`, which must end with it and `[DONE]`."""
    assert body.endswith(DONE) and body.count(b'data: {"error"') == 1, body
    event = body[:-len(DONE)].rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    error: dict[str, Any] = json.loads(event.removeprefix(b"data: "))["error"]
    return error


@pytest.mark.parametrize(("events", "fails", "kind", "code", "words"), [
    ((FIRST,), None, "upstream_stream_error", 502, "ended its stream without `data: [DONE]`"),
    ((FIRST, b'data: {"unfini'), None, "upstream_stream_error", 502,
     "its unfinished last event was dropped: b'data: {\"unfini'"),
    ((FIRST,), httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
     "upstream_stream_error", 502, "broke off mid-answer: RemoteProtocolError: peer closed connection"),
    ((FIRST,), httpx.ReadTimeout("timed out"), "upstream_timeout", 504, "sent nothing for 5 s mid-answer"),
])
async def test_a_stream_the_upstream_does_not_finish_gets_an_error_event_then_done_and_ends_as_an_upstream_error(
        rig: Rig, caplog: pytest.LogCaptureFixture, events: tuple[bytes, ...], fails: Exception | None, kind: str,
        code: int, words: str) -> None:
    call = await _failing_call(rig, _failing_stream(*events, fails=fails))

    body = b"".join(call.body_chunks)
    assert call.status == 200 and body.startswith(FIRST)
    assert body.count(b"\n\n") == 3  # the first event, the error, [DONE]: an unfinished event is not passed on
    error = _error_of(body)
    assert (error["type"], error["code"]) == (kind, code) and words in error["message"], error
    assert call.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}  # ended, not cut
    assert _second_call_outcome(rig) == (0, "upstream_error")
    assert b'basin_calls_total{outcome="upstream_error"} 1.0' in rig.gateway.telemetry.metrics.render()
    assert any(words in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)  # the reason is logged
    assert rig.gateway.telemetry.lending.of("s1") is None and rig.policy.is_live("s1")


@pytest.mark.parametrize("tail", [b"", b'data: {"unfini'], ids=["ends-there", "then-an-unfinished-event"])
async def test_an_upstream_error_event_without_done_gets_done_and_no_second_error(rig: Rig, tail: bytes) -> None:
    call = await _failing_call(rig, _failing_stream(FIRST, SMG_STREAM_ERROR, tail))

    assert b"".join(call.body_chunks) == FIRST + SMG_STREAM_ERROR + DONE
    assert _second_call_outcome(rig) == (0, "upstream_error")


@pytest.mark.parametrize("done", [DONE, b"data: [DONE]", DONE + b"\n"], ids=["whole", "no-blank-line", "extra-LF"])
async def test_a_stream_ending_at_done_is_passed_on_as_written_and_completes(rig: Rig, done: bytes) -> None:
    call = await _failing_call(rig, _failing_stream(FIRST, done))

    assert b"".join(call.body_chunks) == FIRST + done
    assert _second_call_outcome(rig) == (0, "completed")


async def test_a_break_after_done_loses_nothing_and_the_call_completes(rig: Rig) -> None:
    call = await _failing_call(rig, _failing_stream(FIRST, DONE, fails=httpx.RemoteProtocolError("no final chunk")))

    assert b"".join(call.body_chunks) == FIRST + DONE
    assert _second_call_outcome(rig) == (0, "completed")


# What smg 1.13 answers a streamed call whose decode worker answered 429 (tests/e2e/test_faults_smg.py): the
# worker's status and Content-Length over a longer SSE body, so the event arrives cut, without [DONE].
SMG_CUT_429 = b'data: {"error":{"message":{"object":"error","message":"rate limited","type":"BadRequestError'


async def test_a_4xx_stream_that_is_not_json_comes_back_as_json_with_its_status_and_ends_rejected(rig: Rig) -> None:
    # Issue 36 item 8: every refusal the gateway relays is JSON with a stable `type`; this one's words are quoted.
    call = await _failing_call(rig, _failing_stream(SMG_CUT_429, status=429))

    error = json.loads(b"".join(call.body_chunks))["error"]
    assert call.status == 429 and (error["type"], error["code"], error["upstream_status"]) == ("upstream_rejected",
                                                                                                429, 429)
    assert error["upstream_body"] == SMG_CUT_429.decode()
    assert _second_call_outcome(rig) == (0, "rejected")


async def test_a_2xx_answer_that_says_json_and_is_not_is_a_502_quoting_it(rig: Rig) -> None:
    async def garbage(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>oops", headers={"content-type": "application/json"})

    call = await _failing_call(rig, garbage, is_stream=False)

    assert call.status == 502
    error = json.loads(b"".join(call.body_chunks))["error"]
    assert error["type"] == "upstream_bad_answer" and "with a body that is not JSON: b'<html>oops'" in error["message"]
    assert _second_call_outcome(rig) == (0, "upstream_error")


async def test_a_streamed_plain_body_that_is_not_its_json_passes_but_ends_as_an_upstream_error(rig: Rig) -> None:
    call = await _failing_call(rig, _failing_stream(b"<html>", b"oops", content_type="application/json"),
                               is_stream=False)

    assert (call.status, b"".join(call.body_chunks)) == (200, b"<html>oops")  # its head was already sent
    assert not any(m.get("more_body") is False for m in call.sent if m["type"] == "http.response.body")  # issue 46
    assert _second_call_outcome(rig) == (0, "upstream_error")


async def test_a_plain_body_cut_mid_way_stays_cut_and_ends_as_an_upstream_error(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    call = await _failing_call(rig, _failing_stream(b'{"id": "c1", "choi', fails=httpx.ReadError("connection reset"),
                                                    content_type="application/json"), is_stream=False)

    assert call.status == 200 and call.body_chunks == [b'{"id": "c1", "choi']  # no event can go in a JSON body
    assert not any(m.get("more_body") is False for m in call.sent if m["type"] == "http.response.body")
    assert _second_call_outcome(rig) == (0, "upstream_error")
    assert any("connection reset" in r.getMessage() for r in caplog.records)


class ReplayedAnswer:
    """An upstream SSE answer replaying fixed chunks (the `UpstreamAnswer` protocol), for the relay alone."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks
        self.status_code, self.reason, self.url = 200, "OK", "http://router/v1/chat/completions"
        self.headers = {"content-type": "text/event-stream"}

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk

    async def read(self, limit: int) -> bytes:
        raise AssertionError("an SSE answer is never read whole")

    async def aclose(self) -> None:
        pass


async def test_a_huge_event_without_a_blank_line_is_relayed_in_linear_time_holding_a_bounded_amount() -> None:
    # Issue 16, item 12: re-splitting `pending + chunk` made this quadratic (63 MB: 5.9 s of CPU, +226 MiB).
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * (16 << 20) + b'"}}]}\n\n'
    chunks = [event[k:k + (16 << 10)] for k in range(0, len(event), 16 << 10)] + [b'data: {"usage": {"prompt_to',
                                                                                    b'kens": 7}}\n\n', DONE]
    got, ends = bytearray(), list[CallEnd]()

    async def send(message: MutableMapping[str, Any]) -> None:
        got.extend(message.get("body", b""))

    async def on_end(end: CallEnd) -> None:
        ends.append(end)

    response = UpstreamResponse(ReplayedAnswer(chunks), on_end)  # type: ignore[arg-type]
    tracemalloc.start()
    started = time.process_time()
    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, _never_disconnects, send)
    cpu_s = time.process_time() - started
    _, peak_bytes = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert bytes(got) == b"".join(chunks) and ends[0].outcome == "completed"
    assert ends[0].usage is not None and ends[0].usage.prompt_tokens == 7  # the events after it are still read
    assert cpu_s < 1.0, cpu_s
    assert peak_bytes - len(got) < 8 << 20, peak_bytes  # what the client got aside, about 1 MiB is held at most


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_a_client_leaving_mid_stream_ends_the_call_and_closes_the_upstream(rig: Rig) -> None:
    release, closed = asyncio.Event(), list[bool]()
    rig.upstream.handler = _sse_upstream(release, closed)
    call = RawCall(rig.app, {"messages": conversation("task"), "stream": True}, session="s1")
    task = asyncio.create_task(call.run())
    await asyncio.wait_for(call.got_body.wait(), timeout=2)

    call.leave.set()
    await asyncio.wait_for(task, timeout=2)

    entry = rig.room.registry.get("s1")
    assert entry is not None and (entry.in_flight, entry.calls[0].outcome) == (0, "client_gone")
    assert closed == [True]
    assert rig.policy.is_live("s1")  # the session lives on; only the call ended


async def test_a_client_leaving_before_the_answer_starts_cancels_the_upstream_request(rig: Rig) -> None:
    cancelled = asyncio.Event()

    async def never_answers(request: httpx.Request) -> httpx.Response:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    rig.upstream.handler = never_answers
    call = RawCall(rig.app, {"messages": conversation("task")}, session="s1")
    task = asyncio.create_task(call.run())
    await eventually(lambda: len(rig.upstream.requests) == 1)

    call.leave.set()
    await asyncio.wait_for(task, timeout=2)

    assert cancelled.is_set() and call.status == 499
    entry = rig.room.registry.get("s1")
    assert entry is not None and (entry.in_flight, entry.calls[0].outcome) == (0, "client_gone")


# --- failures ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [
        (CHAT, b"{not json", "not valid JSON"),
        (CHAT, b"[1, 2]", "must be a JSON object"),
        (CHAT, b'{"model": "m"}', "no `messages`"),
        (CHAT, b'{"messages": []}', "no `messages`"),
        (CHAT, b'{"messages": [{"content": "no role"}]}', "messages[0]"),
        (CHAT, b'{"messages": [{"role": "wizard", "content": "x"}]}', "cannot read the messages"),
        ("/v1/completions", b'{"model": "m"}', "no `prompt`"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', "`prompt` must be"),
        ("/generate", b'{"sampling_params": {}}', "no `text` or `input_ids`"),
        # a lone surrogate anywhere, as issue 16 found it: never counted, never a plain-text 500
        (CHAT, b'{"model": "fake", "stop": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
         "`stop` holds a lone UTF-16 surrogate"),
        (CHAT, b'{"model": "m\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "`model` holds"),
        (CHAT, b'{"user": "u\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "`user` holds"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', "`messages[0].content` holds"),
        # a body that is not UTF-8 JSON text, or holds numbers JSON has not (issue 16 item 7)
        (CHAT, b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8 text (byte 46"),
        (CHAT, b'{"max_tokens": NaN, "messages": [{"role": "user", "content": "x"}]}', "NaN is not a JSON number"),
        (CHAT, b'{"temperature": 1e999, "messages": [{"role": "user", "content": "x"}]}', "1e999 is too large"),
        (CHAT, b'{"max_tokens": ' + b"9" * 5000 + b', "messages": [{"role": "user", "content": "x"}]}',
         "not valid JSON"),
        # well-formed JSON of the wrong shape where the gateway reads it (issue 16 item 7): each was a 500
        (CHAT, b'{"messages": [{"role": "user", "content": 42}]}', "`messages[0].content` must be a string"),
        (CHAT, b'{"messages": [{"role": "user", "content": true}]}', "got true"),
        (CHAT, b'{"messages": [{"role": "user", "content": {"text": "x"}}]}', "got an object"),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"text": "no type"}]}]}',
         "`messages[0].content[0]` must be a content part"),
        (CHAT, b'{"messages": [{"role": "user", "content": ["bare"]}]}', "got a string"),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
         "`messages[0].content[0].text` must be a string"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null, '
               b'"tool_calls": [{"id": "1", "function": "bash"}]}, {"role": "user", "content": "y"}]}',
         "`messages[1].tool_calls[0].function` must be an object"),
        (CHAT, b'{"messages": [{"role": "assistant", "tool_calls": {"function": {}}}]}',
         "`messages[0].tool_calls` must be a list"),
        (CHAT, b'{"messages": [{"role": "assistant", "tool_calls": [7]}]}', "`messages[0].tool_calls[0]` must be"),
        (CHAT, b'{"tools": [1], "messages": [{"role": "user", "content": "x"}]}', "`tools[0]` must be an object"),
        (CHAT, b'{"tools": "bash", "messages": [{"role": "user", "content": "x"}]}', "`tools` must be a list"),
        (CHAT, b'{"stream": "yes", "messages": [{"role": "user", "content": "x"}]}', "`stream` must be true or false"),
        (CHAT, b'{"stream": true, "stream_options": "usage", "messages": [{"role": "user", "content": "x"}]}',
         "`stream_options` must be an object"),
        (CHAT, b'{"stream": true, "stream_options": {"include_usage": 1}, "messages": [{"role": "user", '
               b'"content": "x"}]}', "`stream_options.include_usage` must be true or false"),
        (CHAT, b'{"user": ["u"], "messages": [{"role": "user", "content": "x"}]}', "`user` must be a string"),
        ("/v1/completions", b'{"prompt": "x", "stream": 1}', "`stream` must be true or false"),
        ("/generate", b'{"input_ids": [1, true]}', "`input_ids` must be"),
    ],
)
async def test_a_malformed_call_is_400_with_a_json_error(rig: Rig, path: str, raw: bytes, fragment: str) -> None:
    response = await rig.client.post(path, content=raw, headers={"X-Session-ID": "s1"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert rig.upstream.requests == [] and len(rig.room.registry) == 0


async def test_a_call_that_fails_inside_the_gateway_after_it_was_counted_is_ended_and_frees_its_session(
        rig: Rig) -> None:
    # Any failure after the call was counted in flight (here an unexpected error from the upstream client)
    # must end the call once, so the session can still be released and idle-swept.
    async def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("a bug below the proxy")

    assert (await rig.chat("s1", "task")).status_code == 200  # served once, so the failure does not release it
    rig.upstream.handler = broken
    response = await rig.chat("s1", "task", "more")
    error = response.json()["error"]  # JSON, never Starlette's plain-text 500
    assert (response.status_code, error["type"]) == (500, "internal_error") and "RuntimeError" in error["message"]
    entry = rig.room.registry.get("s1")
    assert entry is not None and (entry.in_flight, entry.calls[1].outcome) == (0, "gateway_error")
    assert rig.gateway.telemetry.metrics.calls_in_flight._value.get() == 0
    assert (await rig.client.post("/basin/sessions/s1/end")).status_code == 200
    snapshot = rig.policy.snapshot()
    assert (snapshot.live, snapshot.reserved_tokens) == ((), 0)  # its budget is back
    first = await rig.chat("s2", "task")  # a first call failing so: released
    assert (first.status_code, first.json()["error"]["type"]) == (500, "internal_error")
    assert rig.room.registry.get("s2") is None and rig.policy.snapshot().reserved_tokens == 0


@pytest.mark.parametrize(("headers", "fields", "where"), [
    ({"X-Session-ID": "s" * 257}, {}, "X-Session-ID header"),
    ({}, {"user": "u" * 5_000}, "`user` field"),
])
async def test_a_session_id_longer_than_256_characters_is_a_400_and_nothing_is_held(
        rig: Rig, headers: dict[str, str], fields: dict[str, str], where: str) -> None:
    response = await rig.client.post(CHAT, json={"model": "m", "messages": conversation("task"), **fields},
                                     headers=headers)
    assert response.status_code == 400 and where in response.json()["error"]["message"]
    assert rig.upstream.requests == [] and len(rig.room.registry) == 0
    ok = await rig.chat("s" * 256, "task")  # the longest id accepted, echoed back
    assert ok.status_code == 200 and ok.headers["x-session-id"] == "s" * 256


async def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


async def _time_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


async def _crash(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, text="scheduler crashed: KV cache pool exhausted")


@pytest.mark.parametrize(
    ("handler", "status", "kind", "words"),
    [
        (_refuse, 502, "upstream_unavailable", "Connection refused"),
        (_crash, 502, "upstream_error", "scheduler crashed: KV cache pool exhausted"),
        (_time_out, 504, "upstream_timeout", "ReadTimeout: timed out"),
    ],
)
async def test_upstream_failures_are_502_or_504_with_the_upstream_words(rig: Rig, handler: Handler, status: int,
                                                                        kind: str, words: str) -> None:
    rig.upstream.handler = handler
    response = await rig.chat("s1", "task")

    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == kind and words in error["message"]
    assert rig.room.registry.get("s1") is None  # nothing of it was served: released, holding no budget
    metrics = rig.gateway.telemetry.metrics.render()
    assert b'basin_calls_total{outcome="upstream_error"} 1.0' in metrics
    assert b'basin_sessions_ended_total{reason="failed"} 1.0' in metrics


async def test_an_upstream_5xx_reports_its_status_and_body(rig: Rig) -> None:
    rig.upstream.handler = _crash
    error = (await rig.chat("s1", "task")).json()["error"]
    assert (error["upstream_status"], error["upstream_body"]) == (500, "scheduler crashed: KV cache pool exhausted")


SGLANG_400 = {"object": "error", "message": "temperature must be >= 0", "type": "BadRequestError", "param": None,
              "code": 400}  # SGLang's ErrorResponse (srt/entrypoints/openai/protocol.py)


async def test_an_upstream_4xx_in_json_with_a_type_passes_through_unchanged(rig: Rig) -> None:
    async def reject(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json=SGLANG_400)

    rig.upstream.handler = reject
    response = await rig.chat("s1", "task", temperature=-1)
    assert response.status_code == 400
    assert response.json() == SGLANG_400
    assert rig.room.registry.get("s1") is None  # refused upstream: not served work, nothing held, nothing to lend
    assert b'basin_calls_total{outcome="rejected"} 1.0' in rig.gateway.telemetry.metrics.render()
    assert rig.gateway.telemetry.lending.of("s1") is None


# --- pass-through --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/qwen/qwen3", "/server_info", "/get_model_info",
                                  "/v1/loads"])
async def test_models_and_info_endpoints_pass_through_with_the_authorization(rig: Rig, path: str) -> None:
    response = await rig.client.get(path, params={"include": "all"}, headers={"Authorization": "Bearer k"})
    assert response.status_code == 200
    assert response.json() == {"path": path, "query": "include=all"}
    (sent,) = rig.upstream.requests
    assert sent.headers["authorization"] == "Bearer k"
    assert len(rig.room.registry) == 0



@pytest.mark.parametrize("raw_path", [b"/v1/models/../../workers", b"/v1/models/%2e%2e/%2e%2e/get_loads",
                                      b"/v1/models/..%2f..%2fworkers", b"/v1/models/a/./b", b"/v1/models//x",
                                      b"/v1/models/..%5c..%5cworkers"])
async def test_a_pass_through_path_that_leaves_the_list_is_refused_and_never_forwarded(rig: Rig,
                                                                                        raw_path: bytes) -> None:
    # Sent as-is (curl --path-as-is): the ASGI scope carries the raw path, dots and escapes untouched.
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {"type": "http", "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": unquote(raw_path.decode()), "raw_path": raw_path, "root_path": "", "query_string": b"",
             "headers": [(b"host", b"gateway")], "client": ("127.0.0.1", 1), "server": ("gateway", 80)}
    await rig.app(scope, receive, send)
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    assert start["status"] == 404 and json.loads(body)["error"]["type"] in ("not_found", "invalid_request_error")
    assert rig.upstream.requests == []


async def test_the_first_token_window_hears_each_answer_and_counts_calls_still_waiting_and_feeds_the_tick() -> None:
    async with rig_for(latency_gate_s=0.2) as rig:
        for k in range(5):  # five quick answers: the engines keep up
            assert (await rig.chat(f"quick{k}", "task")).status_code == 200
        assert rig.gateway.ttft_s() == 0.0 and not rig.gateway.telemetry._awaiting_first_byte  # no time passed
        release = asyncio.Event()

        async def stuck(request: httpx.Request) -> httpx.Response:
            await release.wait()  # engines that stopped answering: no first byte comes back
            return httpx.Response(200, json=ANSWER)

        rig.upstream.handler = stuck
        calls = [asyncio.create_task(rig.chat(f"stuck{k}", "task")) for k in range(6)]
        await eventually(lambda: len(rig.gateway.telemetry._awaiting_first_byte) == 6)
        rig.clock.advance(0.3)
        assert rig.gateway.ttft_s() == pytest.approx(0.3)  # 6 waits of 0.3 s outnumber 5 answers at once
        await rig.room.tick()
        assert rig.policy.is_pressed is True  # the tick gave the policy the windowed latency
        assert b"basin_engine_ttft_seconds" in rig.gateway.telemetry.metrics.render()
        release.set()
        assert [c.status_code for c in await asyncio.gather(*calls)] == [200] * 6
        assert not rig.gateway.telemetry._awaiting_first_byte  # every call heard its first byte or its end
        heard = sorted(rig.gateway.telemetry.latency_window.values(rig.clock.now()))
        assert heard == [0.0] * 5 + [pytest.approx(0.3)] * 6  # each first byte timed on the clock since forwarding

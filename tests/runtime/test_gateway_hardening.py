"""Issue 36, the gateway's second hardening pass: what an outside attacker found, each through a real server.

Every test serves a rig's gateway with uvicorn as the CLI does (`served.serving`: the gateway's own HTTP protocol
and options, its own HTTP/1.1 client to a real aiohttp upstream) and talks to it over TCP, most with raw bytes:
- paths: any byte sequence in a pass-through path gets a JSON 4xx (item 6);
- answers that were not JSON: a trailing slash, an upstream's plain-text or empty refusal, a request llhttp cannot
  parse (item 8);
- heads: a request head past `max_header_bytes` or with more than `max_headers` headers gets a JSON 431, and an
  upstream answer head past `max_header_bytes` a JSON 502, never passed on (item 9).
Tests of what happens inside the app drive it in-process (`rig_for`), as test_gateway_app.py does:
- item counts: the issue's 38 MB body of 500,000 tool schemas and 600,000 tiny messages are refused (413 naming
  `max_json_items`) before they are parsed; each item limit is an option named in its 413 (item 4);
- large bodies in flight hold a budget (`max_body_bytes_in_flight`): past it, a JSON 503 (item 5; the memory each
  request takes is measured by benchmarks/bench_hostile_bodies.py, not timed here).
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from aiohttp import web

from basin_runtime.clock import ManualClock
from basin_runtime.gateway.limits import Limits
from basin_runtime.gateway.server import CUT_GRACE_S
from tests.runtime.served import RawAnswer, Served, raw_exchange, serving
from tests.runtime.test_gateway_app import ANSWER, CHAT, TOKENIZER, conversation, eventually, rig_for

pytestmark = pytest.mark.asyncio


def error_of(answer: RawAnswer | None) -> dict[str, object]:
    """The gateway's JSON error in `answer` (which must be JSON with a string `type` and its own status as `code`)."""
    assert answer is not None, "the connection closed without an answer"
    assert answer.headers.get("content-type") == "application/json", (answer.status, answer.headers, answer.body)
    error = json.loads(answer.body)["error"]
    assert isinstance(error["type"], str) and error["code"] == answer.status, error
    return dict(error)


def get(path: bytes, *headers: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: gateway\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


def post(body: bytes, session: bytes = b"s", path: bytes = b"/v1/chat/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: gateway\r\nX-Session-ID: " + session + b"\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


# --- item 6: paths ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [b"/v1/models/%ff", b"/v1/models/%C3%28", b"/v1/models/%zz", b"/v1/models/%",
                                  b"/v1/models/a%00b", b"/v1/models/%e2%82"])
async def test_a_pass_through_path_of_any_bytes_gets_a_json_4xx_and_is_never_forwarded(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        error = error_of(answer)
        assert answer is not None and 400 <= answer.status < 500, (answer.status, error)
        assert served.received == []
        health = await raw_exchange(served.port, get(b"/health"))
        assert health is not None and health.status == 200


async def test_a_pass_through_path_goes_upstream_as_the_client_encoded_it() -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(b"/v1/models/Qwen%20Qwen3%C3%A9?x=a%20b"))
        assert answer is not None and answer.status == 200
        assert [(m, p) for m, p, _ in served.received] == [("GET", "/v1/models/Qwen%20Qwen3%C3%A9?x=a%20b")]


@pytest.mark.parametrize("path", [b"/v1/models/\xff", b"/v1/models/a b", b"/v1/\x7fmodels"])
async def test_a_raw_byte_the_url_may_not_hold_gets_a_json_400(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        assert error_of(answer)["type"] == "invalid_request_error" and served.received == []


# --- item 8: every answer the gateway makes or relays is JSON with a stable type ----------------


@pytest.mark.parametrize("path", [b"/health/", b"/v1/models/", b"/basin/state/", b"/v1/chat/completions/"])
async def test_a_trailing_slash_is_a_json_404_not_a_bare_redirect(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        error = error_of(answer)
        assert answer is not None and answer.status in (404, 405) and "location" not in answer.headers, error


@pytest.mark.parametrize("status,body,content_type", [
    (404, b"Not Found", "text/plain"), (400, b"", "text/plain"), (422, b'{"detail": "Not Found"}', "application/json"),
    (429, b"<html>slow down</html>", "text/html")])
async def test_an_upstream_refusal_that_is_not_json_with_a_type_comes_back_as_json_with_its_status(
        status: int, body: bytes, content_type: str) -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, body=body, content_type=content_type)

    async with serving() as served:
        served.handler = refuse
        for request in (get(b"/v1/models/m"), post(b'{"messages": [{"role": "user", "content": "task 1"}]}')):
            answer = await raw_exchange(served.port, request)
            error = error_of(answer)
            assert answer is not None and answer.status == status
            assert (error["type"], error["upstream_status"]) == ("upstream_rejected", status)
            assert error["upstream_body"] == body.decode() or (not body and error["upstream_body"])


async def test_an_upstream_redirect_is_a_json_502_and_its_location_is_not_passed_on() -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={"Location": "http://10.0.0.7:30000/internal"})

    async with serving() as served:
        served.handler = redirect
        answer = await raw_exchange(served.port, get(b"/v1/models"))
        assert error_of(answer)["type"] == "upstream_bad_answer"
        assert answer is not None and answer.status == 502 and "location" not in answer.headers


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS to plain HTTP
    b"GET /health HTTP/1.1\r\nHo st: x\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: zz\r\n\r\n"])
async def test_a_request_that_is_not_valid_http_gets_a_json_400_not_uvicorns_plain_text(request_bytes: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, request_bytes)
        error = error_of(answer)
        assert answer is not None and answer.status == 400 and error["type"] == "invalid_request_error"
        assert "not valid HTTP/1.1" in str(error["message"]) and answer.headers.get("connection") == "close"


# --- item 9: heads ---------------------------------------------------------------------------------


async def test_a_request_head_past_the_limit_gets_a_json_431_naming_it_and_is_never_forwarded() -> None:
    async with serving(max_header_bytes=8192, max_headers=20) as served:
        big = get(b"/v1/models", b"X-Big: " + b"a" * 1_000_000)
        cases = {
            "one 1 MB header, in one write": (big,),
            "one 1 MB header, in 4 KiB writes": tuple(big[k:k + 4096] for k in range(0, len(big), 4096)),
            "a 1 MB URL": (get(b"/v1/models/" + b"m" * 1_000_000),),
            "10,000 small headers": (get(b"/v1/models", *(b"X-H%d: v" % k for k in range(10_000))),),
            "21 headers": (get(b"/v1/models", *(b"X-H%d: v" % k for k in range(20))),),
        }
        for name, pieces in cases.items():
            error = error_of(await raw_exchange(served.port, *pieces))
            limit = "max_headers" if "headers" in name and "small" not in name and "21" in name else None
            assert error["type"] == "headers_too_large" and error["code"] == 431, (name, error)
            assert error["limit"] in ((limit,) if limit else ("max_header_bytes", "max_headers")), (name, error)
        fits = await raw_exchange(served.port, get(b"/v1/models", *(b"X-H%d: v" % k for k in range(19))))
        assert fits is not None and fits.status == 200
        assert [p for _, p, _ in served.received] == ["/v1/models"]  # only the head within the limits went on


async def test_an_upstream_answer_head_past_the_limit_is_a_json_502_and_never_reaches_the_client() -> None:
    async def huge_header(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"ok": True}, headers={"X-Huge": "h" * 5_000_000})

    async with serving(max_header_bytes=65536) as served:
        served.handler = huge_header
        answer = await raw_exchange(served.port, get(b"/v1/models"))
        error = error_of(answer)
        assert answer is not None and (answer.status, error["type"]) == (502, "upstream_bad_answer")
        assert "x-huge" not in answer.headers and "max_header_bytes" in str(error["message"])


# --- item 4: item counts, refused before the body is parsed -----------------------------------------


def tools_body(num_tools: int) -> bytes:
    """A chat body with `num_tools` small tool schemas: 500,000 of them make the issue's 38 MB body."""
    tool = b'{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}'
    return (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ['
            + b", ".join([tool] * num_tools) + b"]}")


TWO_PARTS = b'{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}'


def tiny_messages_body(num_messages: int) -> bytes:
    return b'{"model": "m", "messages": [' + b", ".join([b'{"role": "user", "content": "x"}'] * num_messages) + b"]}"


async def test_the_issues_hostile_bodies_are_refused_naming_the_item_limit_before_they_are_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from basin_runtime.gateway import calls

    parsed: list[int] = []
    parse_slowly = calls._read_json_object_slowly
    monkeypatch.setattr(calls, "_read_json_object_slowly", lambda raw, depth: parsed.append(len(raw)) or parse_slowly(
        raw, depth))
    async with rig_for() as rig:
        for name, body in (("500k tools", tools_body(500_000)), ("600k messages", tiny_messages_body(600_000))):
            response = await rig.client.post(CHAT, content=body, headers={"X-Session-ID": name,
                                                                          "content-type": "application/json"})
            error = response.json()["error"]
            assert (response.status_code, error["type"], error["limit"]) == (413, "too_many_items", "max_json_items")
            assert error["limit_value"] == 500_000 and "--max-json-items" in error["message"], name
        assert parsed == [] and rig.upstream.requests == [] and len(rig.room.registry) == 0


@pytest.mark.parametrize("limit,body", [
    ("max_messages", tiny_messages_body(21)),
    ("max_tools", tools_body(6)),
    ("max_content_parts", b'{"messages": [' + b", ".join([TWO_PARTS] * 4) + b"]}"),
    ("max_json_items", tiny_messages_body(10)),  # 1 + 1 + 10 x 3 = 32 values
])
async def test_each_item_limit_is_an_option_named_in_its_413(limit: str, body: bytes) -> None:
    lowered = {"max_messages": 20, "max_tools": 5, "max_content_parts": 7, "max_json_items": 31}
    limits = Limits(**{limit: lowered[limit]})
    async with rig_for(gateway_options={"limits": limits}) as rig:
        response = await rig.client.post(CHAT, content=body, headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert (response.status_code, error["type"], error["limit"]) == (413, "too_many_items", limit), error
        assert error["limit_value"] == getattr(limits, limit) and error["option"] == "--" + limit.replace("_", "-")
        assert rig.upstream.requests == []


async def test_a_resent_conversation_is_held_to_the_same_item_limits() -> None:
    # A known session's resent body is read from its new part on (`resend.py`): the limits count the whole call.
    limits = Limits(max_messages=40)
    filler = "x" * 70_000  # past RESEND_MIN_BYTES, so the next call is read from its new messages on
    async with rig_for(gateway_options={"limits": limits}) as rig:
        history = conversation(filler, *[f"turn {k}" for k in range(18)])  # 37 messages
        assert (await rig.chat("s", filler, *[f"turn {k}" for k in range(18)])).status_code == 200
        assert rig.room.registry.get("s").memo.counts.prefix is not None  # type: ignore[union-attr]
        grown = [*history, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"},
                 {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]  # 41 messages
        response = await rig.client.post(CHAT, json={"model": "m", "messages": grown}, headers={"X-Session-ID": "s"})
        error = response.json()["error"]
        assert (response.status_code, error["limit"]) == (413, "max_messages"), error


async def test_an_admin_body_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from basin_runtime.gateway import admin

    threads: list[str] = []
    read = admin.read_json_object
    monkeypatch.setattr(admin, "read_json_object", lambda *a: threads.append(threading.current_thread().name) or read(
        *a))
    async with rig_for() as rig:
        small = await rig.client.put("/basin/budget", json={"budget_tokens": 5000})
        large = await rig.client.put("/basin/budget", content=b'{"budget_tokens": 6000' + b" " * (1 << 17) + b"}")
        assert (small.status_code, large.status_code) == (200, 200)
    assert threads[0] == threading.current_thread().name != threads[1]


# --- item 5: memory for large bodies, in all ------------------------------------------------------------


async def test_large_bodies_in_flight_past_their_budget_get_a_json_503_with_retry_after_and_the_budget_comes_back(
        ) -> None:
    release = asyncio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        if len(request.content) > 1 << 20:  # the large calls wait for the test to let them go
            await release.wait()
        return httpx.Response(200, json=ANSWER)

    big = ("word " * (300 << 10))[:(1536 << 10) - 100]  # ~1.5 MiB: a large body
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes_in_flight=2 << 20)}) as rig:
        rig.upstream.handler = slow
        first = asyncio.create_task(rig.chat("one", big))
        await eventually(lambda: len(rig.upstream.requests) == 1)
        assert rig.gateway.bodies.held_bytes > 1 << 20
        refused = await rig.chat("two", big)
        error = refused.json()["error"]
        assert (refused.status_code, error["type"], error["limit"]) == (503, "too_many_large_bodies",
                                                                         "max_body_bytes_in_flight")
        assert refused.headers["retry-after"] == "1" and rig.room.registry.get("two") is None
        small = await rig.chat("three", "a small call")  # small bodies are not counted: served while it is full
        assert small.status_code == 200
        release.set()
        assert (await first).status_code == 200
        assert rig.gateway.bodies.held_bytes == 0
        assert (await rig.chat("two", big)).status_code == 200
        assert rig.gateway.bodies.held_bytes == 0


async def test_a_chunked_large_body_is_counted_as_it_arrives() -> None:
    from tests.runtime.test_gateway_limits import Driven

    async with rig_for(gateway_options={"limits": Limits(max_body_bytes_in_flight=2 << 20)}) as rig:
        rig.gateway.bodies.held_bytes = 1 << 20  # another large body holds half the budget
        call = await Driven({"x-session-id": b"s"}, [b" " * (512 << 10)] * 4, leaves=False).run(rig.app)
        assert (call.status, call.error["type"]) == (503, "too_many_large_bodies")
        assert call.num_received <= 3  # refused as it passed the budget, not after reading it all
        assert rig.gateway.bodies.held_bytes == 1 << 20


async def test_a_large_body_in_large_reads_is_not_taken_for_a_head() -> None:
    # The bytes of an open head are counted as they arrive; a body's reads (the last one ends the request, which
    # once reopened the count) never are.
    async with serving(max_header_bytes=4096) as served:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * 600_000}]}).encode()
        answer = await raw_exchange(served.port, post(body), post(b'{"messages": [{"role": "user", "content": "b"}]}',
                                                                  b"s2"))
        assert answer is not None and answer.status == 200, answer


async def test_the_predictor_reads_at_most_its_text_limit_of_a_huge_task() -> None:
    # Its featurizer took ~23x a text's size in memory: a 60 MB first message made the gateway 1.4 GB larger.
    from basin_runtime.gateway.predictors import PREDICTED_TEXT_CHARS

    async with rig_for() as rig:
        task = "fix " * (PREDICTED_TEXT_CHARS // 2)
        assert (await rig.chat("s", task)).status_code == 200
        ((asked_text, _),) = rig.model.asked
        assert asked_text == task[:PREDICTED_TEXT_CHARS] and len(task) > PREDICTED_TEXT_CHARS
        assert rig.room.registry.get("s").task_text == task  # type: ignore[union-attr]  # the log keeps it whole


# --- item 1: a reservation never below the context; the predictor reads what the engine will hold ----------------


class ClampingModel:
    """Predicts as the exported model does for a short task: a small peak, never below the first prompt it is told."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.online = TinyOnline()

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        self.asked.append(first_prompt_tokens)
        return float(max(first_prompt_tokens, 1412))


class TinyOnline:
    """An online re-estimate that keeps guessing small, whatever the calls (the issue's 2,780 for a 150k context)."""

    def predict(self, first_call_peak: float, prompt_tokens: object, completion_tokens: object) -> float:
        return 1544.0

    def multiplier(self, q: float, k: int) -> float:
        return 1.8


async def test_a_made_up_history_reserves_what_the_engine_holds_on_its_first_call_and_every_later_one() -> None:
    filler = "word " * 3000  # ~3k tokens a turn: a first call of ~30k tokens in made-up turns
    made_up = [{"role": "user", "content": "task"}]
    for _ in range(5):
        made_up += [{"role": "assistant", "content": filler}, {"role": "user", "content": filler}]
    honest = [{"role": "user", "content": "task " + " ".join(m["content"] for m in made_up[1:])}]
    model = ClampingModel()
    async with rig_for(model=model, reservation_quantile=None, revise_at_calls=(3,)) as rig:  # type: ignore[arg-type]
        for session, messages in (("made-up", made_up), ("honest", honest)):
            assert (await rig.client.post(CHAT, json={"messages": messages},
                                          headers={"X-Session-ID": session})).status_code == 200
        context = TOKENIZER.count_prompt(made_up)
        assert model.asked[0] == context  # not the 2-token task before its first assistant turn
        views = {v["session_id"]: v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]}
        for view in views.values():
            record = rig.policy.record_of(view["session_id"])
            assert view["reserved_tokens"] >= view["last_prompt_tokens"] == record.context_tokens
        assert views["made-up"]["reserved_tokens"] >= context
        grown = list(made_up)
        for turn in range(3):  # calls 2 to 4; call 3 revises the peak down to a tiny 1,544 x 1.8
            grown += [{"role": "assistant", "content": filler}, {"role": "user", "content": f"go on {turn}"}]
            assert (await rig.client.post(CHAT, json={"messages": grown},
                                          headers={"X-Session-ID": "made-up"})).status_code == 200
            view = next(v for v in (await rig.client.get("/basin/sessions")).json()["sessions"]
                        if v["session_id"] == "made-up")
            assert view["reserved_tokens"] >= view["last_prompt_tokens"] == TOKENIZER.count_prompt(grown)
        assert view["reserved_peak_tokens"] < view["last_prompt_tokens"]  # the revision was small: the context holds
        assert rig.policy.snapshot().reserved_tokens == sum(v["reserved_tokens"] for v in (
            await rig.client.get("/basin/sessions")).json()["sessions"])


async def test_first_calls_with_long_made_up_histories_never_take_the_working_set_past_the_budget() -> None:
    # The issue's attack scaled down: ~30k-token made-up histories against a 45k budget, each predicted small.
    filler = "word " * 3000
    made_up = [{"role": "user", "content": "task"}]
    for _ in range(5):
        made_up += [{"role": "assistant", "content": filler}, {"role": "user", "content": filler}]
    context = TOKENIZER.count_prompt(made_up)
    budget = context * 3 // 2
    async with rig_for(model=ClampingModel(), budget_tokens=budget) as rig:  # type: ignore[arg-type]
        assert (await rig.client.post(CHAT, json={"messages": made_up},
                                      headers={"X-Session-ID": "h0"})).status_code == 200
        waiting = [asyncio.create_task(rig.client.post(CHAT, json={"messages": made_up},
                                                       headers={"X-Session-ID": f"h{k}"})) for k in range(1, 8)]
        await eventually(lambda: len(rig.policy.snapshot().queued) == 7)
        snapshot = rig.policy.snapshot()
        assert snapshot.live == ("h0",) and snapshot.working_set_tokens == context <= budget
        assert len(rig.upstream.bodies()) == 1  # the queued calls were not forwarded
        assert (await rig.client.post("/basin/sessions/h0/end")).status_code == 200
        done, pending = await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and next(iter(done)).result().status_code == 200  # the head goes in alone
        snapshot = rig.policy.snapshot()
        assert len(snapshot.live) == 1 and len(snapshot.queued) == 6 and snapshot.working_set_tokens <= budget
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


# --- item 2: a graceful shutdown (SIGTERM) ---------------------------------------------------------------------


def chat_body(content: str, *, stream: bool = False) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": content}]}).encode()


async def sigterm(served: Served) -> None:
    """What uvicorn does on SIGTERM (`Server.handle_exit`), then wait for the drain to begin."""
    served.server.should_exit = True
    await eventually(lambda: served.rig.gateway.room.is_draining, timeout_s=5)


async def test_while_draining_the_listener_stays_open_new_calls_get_503_and_calls_in_flight_finish() -> None:
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        await request.read()
        await release.wait()
        return web.json_response(ANSWER)

    async with serving(drain_timeout_s=10) as served:
        served.handler = slow
        in_flight = asyncio.create_task(raw_exchange(served.port, post(chat_body("task a"), b"a")))
        await eventually(lambda: len(served.received) == 1)
        await sigterm(served)
        for name, request in (("a new session", post(chat_body("task b"), b"b")),
                              ("a live session's next call", post(chat_body("task a, again"), b"a")),
                              ("a health check", get(b"/health"))):
            answer = await raw_exchange(served.port, request)  # connected: the listener is still open
            error = error_of(answer)
            assert answer is not None and (answer.status, error["type"]) == (503, "shutting_down"), name
            assert answer.headers["retry-after"] == "30", name
        assert len(served.received) == 1 and not in_flight.done()
        release.set()
        answer = await asyncio.wait_for(in_flight, 5)
        assert answer is not None and answer.status == 200 and json.loads(answer.body) == ANSWER
        await asyncio.wait_for(served.wait_stopped(), 5)  # nothing left in flight: the shutdown goes on at once


async def test_calls_in_flight_past_the_drain_get_a_json_503_or_a_stream_an_error_event_then_done() -> None:
    first_event = b'data: {"choices": [{"index": 0, "delta": {"content": "he"}}]}\n\n'

    async def hung(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            await asyncio.sleep(60)  # never answers within the drain
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(first_event)
        await asyncio.sleep(60)  # the rest never comes within the drain
        return response

    clock = ManualClock()  # the drain's: its timeout passes only as the test moves it
    async with serving(drain_timeout_s=0.5, drain_clock=clock) as served:
        served.handler = hung
        gateway = served.rig.gateway
        waiting = asyncio.create_task(raw_exchange(served.port, post(chat_body("task w"), b"w")))
        streaming = asyncio.create_task(raw_exchange(served.port, post(chat_body("task s", stream=True), b"s")))
        await eventually(lambda: len(served.received) == 2)
        # the stream's first event is passed on: only the other call still waits for its first byte
        await eventually(lambda: len(gateway.telemetry._awaiting_first_byte) == 1)
        started = clock.now()
        await sigterm(served)
        await eventually(lambda: clock.next_deadline() is not None)  # the drain polls on its clock
        clock.advance(0.45)
        await clock.settle()
        assert not gateway.is_cut and gateway.num_active_calls == 2  # the drain looked at 0.45 s: nothing cut
        # past the drain timeout the calls are cut; time stands while they write their last bytes
        await clock.drive(asyncio.ensure_future(served.wait_stopped()),
                          is_settled=lambda: not gateway.is_cut or not gateway.num_active_calls)
        waited, streamed = await asyncio.wait_for(asyncio.gather(waiting, streaming), 60)
        error = error_of(waited)
        assert waited is not None and (waited.status, error["type"]) == (503, "shutting_down")
        assert "drain_timeout_s" in str(error["message"])
        assert streamed is not None and streamed.status == 200 and streamed.body.startswith(first_event)
        events = [e for e in streamed.body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["type"] == "shutting_down"
        await asyncio.wait_for(served.wait_stopped(), 60)
        # cut at the drain timeout, then stopped as soon as the cut calls had ended (not at the grace's end)
        assert 0.5 <= clock.now() - started < 0.5 + CUT_GRACE_S / 2

"""Issue 16 in-process: the input limits (body size while reading, JSON depth, session ids), JSON answers for
routing errors and unexpected exceptions, the forwarded body, and big bodies handled off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette

from basin_runtime.gateway import gateway as gateway_module
from basin_runtime.gateway.gateway import OFF_LOOP_BODY_BYTES
from basin_runtime.gateway.limits import Limits
from basin_runtime.gateway.measure import Meter, PromptMemo
from basin_runtime.gateway.sessions import session_id_for
from basin_stack.stack import free_port
from tests.runtime.test_gateway_app import CHAT, TOKENIZER, Rig, conversation, rig_for

pytestmark = pytest.mark.asyncio


class Driven:
    """One request driven straight into the ASGI app with a scripted body: what was read, what came back.

    After the body the client stays until the answer is complete (then `http.disconnect`, as servers
    send in-process), unless it `leaves` right after its chunks.
    """

    def __init__(self, headers: dict[str, bytes], chunks: list[bytes], *, endless_chunk: bytes | None = None,
                 leaves: bool = False, method: str = "POST", path: str = CHAT) -> None:
        self.headers = [(k.encode(), v) for k, v in headers.items()]
        self.chunks = list(chunks)
        self.endless_chunk = endless_chunk  # after `chunks`, this one for ever (a body that never ends)
        self.leaves = leaves  # after `chunks`, the client disconnects instead of ending the body
        self.method, self.path = method, path
        self.num_received = 0
        self.sent: list[MutableMapping[str, Any]] = []
        self._answered = asyncio.Event()

    async def run(self, app: Starlette) -> Driven:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 5000), "server": ("gw", 80)}
        await app(scope, self._receive, self._send)
        return self

    async def _receive(self) -> dict[str, Any]:
        self.num_received += 1
        if self.chunks:
            chunk = self.chunks.pop(0)
            more = bool(self.chunks) or self.endless_chunk is not None or self.leaves
            return {"type": "http.request", "body": chunk, "more_body": more}
        if self.endless_chunk is not None:
            return {"type": "http.request", "body": self.endless_chunk, "more_body": True}
        if not self.leaves:  # a client that stays: disconnected once the answer is complete
            await self._answered.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._answered.set()

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.sent if m["type"] == "http.response.start"))

    @property
    def error(self) -> dict[str, Any]:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        error: dict[str, Any] = json.loads(body)["error"]
        return error


def body_of(size: int) -> bytes:
    """A chat body of exactly `size` bytes."""
    head = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}).encode()
    filler = size - len(head)
    assert filler >= 0
    return head.replace(b'"content": ""', b'"content": "' + b"x" * filler + b'"')


def assert_nothing_held(rig: Rig) -> None:
    assert rig.upstream.requests == [] and len(rig.room.registry) == 0


# --- body size -----------------------------------------------------------------------------------


async def test_a_declared_content_length_over_the_limit_is_413_before_a_byte_is_read() -> None:
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=1000)}) as rig:
        call = await Driven({"content-length": b"1001", "x-session-id": b"s1"}, [b"{" * 1001]).run(rig.app)
        assert (call.status, call.num_received) == (413, 0)
        error = call.error
        assert (error["type"], error["code"], error["limit"], error["limit_value"], error["option"]) == (
            "request_too_large", 413, "max_body_bytes", 1000, "--max-body-bytes")
        assert "1001 bytes" in error["message"]
        assert_nothing_held(rig)


async def test_a_body_without_a_length_is_refused_the_moment_it_passes_the_limit_and_never_held_whole() -> None:
    # 100-byte chunks for ever: the 11th passes the 1,000-byte limit, and nothing after it is read.
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=1000)}) as rig:
        call = await Driven({"x-session-id": b"s1"}, [], endless_chunk=b" " * 100).run(rig.app)
        assert (call.status, call.num_received, call.error["type"]) == (413, 11, "request_too_large")
        assert_nothing_held(rig)


async def test_a_body_exactly_at_the_limit_is_served_in_chunks() -> None:
    raw = body_of(1000)
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=1000)}) as rig:
        chunks = [raw[k:k + 64] for k in range(0, len(raw), 64)]
        call = await Driven({"x-session-id": b"s1", "content-length": b"1000"}, chunks).run(rig.app)
        assert call.status == 200
        assert json.loads(rig.upstream.requests[0].content)["messages"] == json.loads(raw)["messages"]


@pytest.mark.parametrize(("length", "fragment"), [(b"50", "is 1000 bytes but its Content-Length says 50"),
                                                  (b"5000", "is 1000 bytes but its Content-Length says 5000"),
                                                  (b"12abc", "must be a whole number of bytes"),
                                                  (b"\xb2", "must be a whole number of bytes"),  # '²' isdigit()
                                                  (b"9" * 5000, "is a 5000-digit number of bytes")])
async def test_a_content_length_that_is_not_the_body_size_is_refused(length: bytes, fragment: str) -> None:
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=10_000)}) as rig:
        call = await Driven({"x-session-id": b"s1", "content-length": length}, [body_of(1000)]).run(rig.app)
        assert call.status in (400, 413) and fragment in call.error["message"]
        assert_nothing_held(rig)


async def test_a_client_leaving_while_it_sends_its_body_is_499_and_nothing_is_held() -> None:
    async with rig_for() as rig:
        call = await Driven({"x-session-id": b"s1"}, [b'{"messages": '], leaves=True).run(rig.app)
        assert (call.status, call.error["type"]) == (499, "client_closed_request")
        assert_nothing_held(rig)


async def test_through_uvicorn_an_upload_over_the_limit_is_413_and_the_server_goes_on_serving() -> None:
    # (uvicorn reads and drops the rest of a refused body to keep the connection; the gateway holds none of it)
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=1 << 20)}) as rig:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(rig.app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            async def chunked() -> AsyncIterator[bytes]:  # 8 MiB in 64 KiB chunks, without a Content-Length
                for _ in range(128):
                    yield b" " * (1 << 16)

            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                refused = await client.post(CHAT, content=chunked(), headers={"X-Session-ID": "s1"})
                declared = await client.post(CHAT, content=b" " * (2 << 20), headers={"X-Session-ID": "s1"})
                health = await client.get("/health")
            assert (refused.status_code, refused.json()["error"]["type"]) == (413, "request_too_large")
            assert (declared.status_code, health.status_code) == (413, 200)
            assert_nothing_held(rig)
        finally:
            server.should_exit = True
            await serving


async def test_admin_bodies_are_read_within_the_same_limits() -> None:
    async with rig_for(gateway_options={"limits": Limits(max_body_bytes=10_000)}) as rig:
        response = await rig.client.put("/basin/budget", content=b'{"budget_tokens": ' + b" " * 10_000 + b"5}")
        assert (response.status_code, response.json()["error"]["type"]) == (413, "request_too_large")
        deep = await rig.client.put("/basin/budget", content=b"[" * 4000 + b"]" * 4000)
        assert (deep.status_code, deep.json()["error"]["type"]) == (400, "json_too_deep")


# --- JSON depth ----------------------------------------------------------------------------------


def nested_schema(levels: int) -> dict[str, Any]:
    """A tool parameter schema of `levels` nested object properties."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"inner": schema}}
    return schema


def tools_body(levels: int) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "deep", "parameters": nested_schema(levels)}}
    return {"model": "m", "messages": conversation("task"), "tools": [tool]}


def depth_of(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


async def test_json_deeper_than_the_limit_is_400_naming_where_and_the_limit() -> None:
    async with rig_for(gateway_options={"limits": Limits(max_json_depth=19)}) as rig:
        fits, too_deep = tools_body(7), tools_body(8)
        assert (depth_of(fits), depth_of(too_deep)) == (19, 21)  # body, tools, tool, function, 2 per schema level
        ok = await rig.client.post(CHAT, json=fits, headers={"X-Session-ID": "fits"})
        assert ok.status_code == 200
        refused = await rig.client.post(CHAT, json=too_deep, headers={"X-Session-ID": "deep"})
        error = refused.json()["error"]
        assert (refused.status_code, error["type"], error["limit"], error["limit_value"]) == (
            400, "json_too_deep", "max_json_depth", 19)
        assert error["message"].startswith("`tools[0].function.parameters.properties.inner.properties")
        assert rig.room.registry.get("deep") is None and len(rig.upstream.requests) == 1


async def test_the_default_depth_takes_a_deep_real_tool_schema_and_refuses_a_nesting_bomb(rig: Rig) -> None:
    ok = await rig.client.post(CHAT, json=tools_body(40), headers={"X-Session-ID": "s1"})  # 85 levels
    assert ok.status_code == 200
    bomb = await rig.client.post(CHAT, content=b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 headers={"X-Session-ID": "s2"})
    assert (bomb.status_code, bomb.json()["error"]["type"]) == (400, "json_too_deep")  # no RecursionError 500
    assert rig.room.registry.get("s2") is None


# --- session ids ---------------------------------------------------------------------------------


async def test_a_session_id_over_the_configured_length_names_the_limit() -> None:
    async with rig_for(gateway_options={"limits": Limits(max_session_id_chars=8)}) as rig:
        response = await rig.chat("s" * 9, "task")
        error = response.json()["error"]
        assert (response.status_code, error["type"], error["limit"], error["option"]) == (
            400, "session_id_too_long", "max_session_id_chars", "--max-session-id-chars")
        assert "X-Session-ID header is 9 characters" in error["message"]
        assert_nothing_held(rig)
        assert (await rig.chat("s" * 8, "task")).status_code == 200


@pytest.mark.parametrize(("value", "fragment"), [
    ("café".encode(), "must be printable ASCII"),  # arrives as latin-1 text 'cafÃ©'
    (b"run\x01id", "must be printable ASCII"),
    (b"run\x7fid", "must be printable ASCII"),
])
async def test_a_header_session_id_must_be_printable_ascii(value: bytes, fragment: str) -> None:
    async with rig_for() as rig:
        call = await Driven({"x-session-id": value}, [body_of(200)]).run(rig.app)
        assert call.status == 400 and fragment in call.error["message"]
        assert "X-Session-ID header" in call.error["message"]
        assert_nothing_held(rig)


@pytest.mark.parametrize("session_id", [".", "..", "a/../b", "./x", "x/."])
async def test_a_session_id_with_a_dot_segment_is_400_as_no_client_could_end_it(rig: Rig, session_id: str) -> None:
    # Found by the fuzz suite: a session "." was held, but POST /basin/sessions/./end reaches /basin/sessions/end.
    for response in (await rig.chat(session_id, "task"),
                     await rig.client.post(CHAT, json={"messages": conversation("task"), "user": session_id})):
        assert response.status_code == 400 and "`.` or `..` path segment" in response.json()["error"]["message"]
    assert_nothing_held(rig)
    assert (await rig.chat("a.b/..c/.d", "task")).status_code == 200  # dots inside a segment are fine


@pytest.mark.parametrize("user", ["u\x00", "line\nbreak", "tab\there", "c1\x85"])
async def test_a_user_field_session_id_with_a_control_character_is_400(rig: Rig, user: str) -> None:
    response = await rig.client.post(CHAT, json={"messages": conversation("task"), "user": user})
    assert response.status_code == 400
    assert "`user` field holds a control character" in response.json()["error"]["message"]
    assert_nothing_held(rig)


@pytest.mark.parametrize("user", ["José 🙂", "rtl\u202eevil", "zero\u200bwidth"])
async def test_a_non_ascii_user_field_is_a_session_id_but_is_not_echoed(rig: Rig, user: str) -> None:
    response = await rig.client.post(CHAT, json={"messages": conversation("task"), "user": user})
    assert response.status_code == 200 and "x-session-id" not in response.headers
    assert rig.policy.snapshot().live == (user,)


# --- headers ------------------------------------------------------------------------------------


async def test_a_header_the_upstream_client_cannot_send_is_not_forwarded_and_the_call_is_served() -> None:
    # Found by the fuzz suite: a non-ASCII workload header made the upstream client raise: a 500 after the
    # call was counted.
    async with rig_for() as rig:
        headers = {"x-session-id": b"s1", "x-basin-workload": "caf\u00e9".encode(), "x-note": b"a\x01b",
                   "x-fine": b"ok value\twith tab", "bad name": b"v", "content-type": b"application/json"}
        call = await Driven(headers, [body_of(200)]).run(rig.app)
        assert call.status == 200
        (sent,) = rig.upstream.requests
        assert sent.headers["x-fine"] == "ok value\twith tab"
        assert not {"x-basin-workload", "x-note", "bad name"} & set(sent.headers)
        assert rig.room.registry.get("s1").workload == "cafÃ©"  # type: ignore[union-attr]  # as decoded (latin-1)


# --- every answer is JSON ------------------------------------------------------------------------


async def test_an_unknown_route_is_a_json_404_and_a_wrong_method_a_json_405(rig: Rig) -> None:
    missing = await rig.client.get("/v2/nothing-here")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "not_found")
    assert "GET /v2/nothing-here" in missing.json()["error"]["message"]
    wrong = await rig.client.get(CHAT)
    error = wrong.json()["error"]
    assert (wrong.status_code, error["type"], wrong.headers["allow"]) == (405, "method_not_allowed", "POST")
    assert rig.upstream.requests == []


async def test_an_unexpected_exception_before_a_call_is_counted_is_a_json_500_and_is_logged(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    def broken(task_text: str, first_prompt_tokens: int) -> float:
        raise ZeroDivisionError("a bug in a predictor")

    rig.model.predict = broken  # type: ignore[method-assign]
    response = await rig.chat("s1", "task")
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["code"]) == (500, "internal_error", 500)
    assert "ZeroDivisionError" in error["message"] and "a bug in a predictor" not in error["message"]
    (logged,) = [r for r in caplog.records if "answered 500 internal_error" in r.getMessage()]
    assert logged.exc_info is not None and logged.exc_info[0] is ZeroDivisionError
    assert_nothing_held(rig)


# --- big bodies off the event loop ---------------------------------------------------------------


class ThreadRecordingMeter(Meter):
    """A meter that remembers on which thread each later call was counted."""

    threads: list[str]

    def prompt_tokens(self, call: Any, memo: PromptMemo) -> int:
        self.threads.append(threading.current_thread().name)
        return super().prompt_tokens(call, memo)


async def test_a_large_later_call_is_counted_off_the_event_loop_and_a_small_one_inline() -> None:
    async with rig_for() as rig:
        meter = ThreadRecordingMeter(TOKENIZER, rig.gateway.meter._rule)
        meter.threads = []
        rig.gateway.meter = meter
        big = "word " * (OFF_LOOP_BODY_BYTES // 5)
        assert (await rig.chat("s1", "task")).status_code == 200
        meter.threads.clear()  # the first call is measured in a thread anyway (`_arrive`)
        assert (await rig.chat("s1", "task", "small")).status_code == 200
        assert (await rig.chat("s1", "task", "small", big)).status_code == 200
        loop_thread = threading.current_thread().name
        assert meter.threads[0] == loop_thread and meter.threads[1] != loop_thread
        assert rig.room.registry.get("s1").calls[-1].prompt_tokens == TOKENIZER.count_prompt(  # type: ignore[union-attr]
            conversation("task", "small", big))


async def test_a_large_call_without_a_session_id_is_identified_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Its id is a hash of its first messages: re-serialising a 23 MB first message took ~100 ms on the loop.
    threads: list[str] = []

    def recording(*args: Any) -> tuple[str, bool]:
        threads.append(threading.current_thread().name)
        return session_id_for(*args)

    monkeypatch.setattr(gateway_module, "session_id_for", recording)
    async with rig_for() as rig:
        big = "word " * (OFF_LOOP_BODY_BYTES // 5)
        assert (await rig.client.post(CHAT, json={"messages": conversation("small task")})).status_code == 200
        assert (await rig.client.post(CHAT, json={"messages": conversation(big)})).status_code == 200
        assert threads[0] == threading.current_thread().name != threads[1]
        assert len(rig.policy.snapshot().live) == 2

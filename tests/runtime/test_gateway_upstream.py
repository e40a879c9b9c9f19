"""The gateway's upstream client (`http1.py`, behind `upstream.UpstreamClient`) against a small aiohttp server
on loopback: bodies whole and streamed chunk by chunk, refused / timed-out / 5xx mapped to the gateway's
errors, cancellation, and streams that fail after their head (hang, keep-alive comments only, reset, cut
short): a stream that stalls is timed on a `ManualClock` the test drives, on which the server's pings come."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from basin_runtime.clock import Clock, ManualClock, MonotonicClock
from basin_runtime.gateway.errors import UpstreamRefusedError, UpstreamStatusError, UpstreamTimeoutError
from basin_runtime.gateway.http1 import Http1UpstreamClient
from basin_runtime.gateway.proxy import CallEnd, Upstream
from basin_runtime.gateway.upstream import UpstreamClient
from basin_stack.stack import free_port

pytestmark = pytest.mark.asyncio


class Server:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock  # the faulty streams' pace
        self.release_second_chunk = asyncio.Event()
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.gone = asyncio.Event()
        self.slow_began = asyncio.Event()
        self.first_event_relayed = asyncio.Event()  # set by the test's client
        self.num_pings = 0

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path_qs, dict(request.headers), body))
        return web.json_response({"got": body.decode()}, headers={"x-smg-routed-worker-id": "w1"})

    async def sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await self.release_second_chunk.wait()
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    async def slow(self, request: web.Request) -> web.Response:
        self.slow_began.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.gone.set()
            raise
        return web.Response(text="late")

    async def broken(self, request: web.Request) -> web.Response:
        return web.Response(status=503, text="scheduler crashed")

    async def faulty_sse(self, request: web.Request) -> web.StreamResponse:
        """One event, then the fault the path names: hang, pings (comments only), reset, cut (no [DONE])."""
        fault = request.match_info["fault"]
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(FIRST_EVENT)
        if fault == "reset":
            assert request.transport is not None
            await self.first_event_relayed.wait()  # read: a reset can discard unread bytes
            request.transport.abort()  # mid chunked body: the client sees the connection break
            return response
        if fault == "cut":
            await response.write_eof()  # a clean end, without [DONE]
            return response
        try:
            while True:
                await self.clock.sleep(0.05)
                if fault == "pings":
                    await response.write(b": ping\n\n")  # what smg writes while a worker is silent
                    self.num_pings += 1
        except (asyncio.CancelledError, ConnectionError):
            self.gone.set()
            raise


FIRST_EVENT = b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'


@asynccontextmanager
async def serving(read_s: float = 5.0, clock: Clock | None = None) -> AsyncIterator[tuple[Server, UpstreamClient]]:
    clock = clock or MonotonicClock()
    server = Server(clock)
    app = web.Application(handler_args={"handler_cancellation": True})
    app.add_routes([web.post("/echo", server.echo), web.get("/echo", server.echo), web.get("/sse", server.sse),
                    web.post("/slow", server.slow), web.post("/broken", server.broken),
                    web.post("/sse/{fault}", server.faulty_sse)])
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    client = Http1UpstreamClient(f"http://127.0.0.1:{port}", connect_s=2.0, read_s=read_s, clock=clock)
    await client.start()
    try:
        yield server, client
    finally:
        await client.aclose()
        await runner.cleanup()


async def never() -> dict[str, str]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def test_a_body_and_query_go_through_and_the_answer_comes_back() -> None:
    async with serving() as (server, client):
        answer = await client.send("POST", "/echo", {"x-session-id": "s1"}, b"hello", "a=1&b=2")
        try:
            assert answer.status_code == 200 and answer.headers["x-smg-routed-worker-id"] == "w1"
            assert await answer.read(1 << 20) == b'{"got": "hello"}'
        finally:
            await answer.aclose()
            await answer.aclose()
        method, path_qs, headers, body = server.seen[0]
        assert (method, path_qs, body, headers["x-session-id"]) == ("POST", "/echo?a=1&b=2", b"hello", "s1")


async def test_sse_arrives_chunk_by_chunk() -> None:
    async with serving() as (server, client):
        answer = await client.send("GET", "/sse", {}, None)
        chunks = answer.chunks()
        try:
            first = await asyncio.wait_for(chunks.__anext__(), 5)  # the second chunk is not written yet
            assert first == b"data: one\n\n"
            server.release_second_chunk.set()
            rest = b"".join([chunk async for chunk in chunks])
            assert rest == b"data: two\n\n"
        finally:
            await answer.aclose()


async def test_refused_timeout_and_5xx_map_to_the_gateway_errors() -> None:
    async with serving(read_s=0.2) as (_server, client):
        upstream = Upstream(client)
        with pytest.raises(UpstreamTimeoutError, match="did not answer in time"):
            await upstream.forward("POST", "/slow", {}, b"{}", never)
        with pytest.raises(UpstreamStatusError, match="scheduler crashed"):
            await upstream.forward("POST", "/broken", {}, b"{}", never)
    refused = Http1UpstreamClient(f"http://127.0.0.1:{free_port()}", connect_s=1.0, read_s=1.0)
    await refused.start()
    try:
        with pytest.raises(UpstreamRefusedError, match="cannot reach upstream"):
            await refused.send("GET", "/echo", {}, None)
    finally:
        await refused.aclose()
    assert refused.is_closed


async def test_cancelling_a_send_releases_the_connection() -> None:
    async with serving() as (server, client):
        task = asyncio.ensure_future(client.send("POST", "/slow", {}, b"{}"))
        await asyncio.wait_for(server.slow_began.wait(), 60)  # the request reached the upstream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.gone.wait(), 5)  # the upstream saw the connection go
        answer = await client.send("POST", "/echo", {}, b"again")
        try:
            assert answer.status_code == 200
        finally:
            await answer.aclose()


async def relay(upstream: Upstream, path: str, server: Server, clock: ManualClock,
                is_driven: bool) -> tuple[int, bytes, CallEnd, float]:
    """Forward a POST and send its answer to a client that reads everything, driving the clock once the first
    event is relayed if `is_driven` (each ping the server wrote relayed before time moves on): status, body,
    end, seconds on the clock."""
    ends: list[CallEnd] = []
    sent: list[MutableMapping[str, Any]] = []

    async def on_end(end: CallEnd) -> None:
        ends.append(end)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if FIRST_EVENT in message.get("body", b""):
            server.first_event_relayed.set()

    def body() -> bytes:
        return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    started = clock.now()
    response = await upstream.forward("POST", path, {}, b"{}", never, on_end=on_end)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": path}
    relaying = asyncio.ensure_future(response(scope, never, send))
    if is_driven:
        await asyncio.wait_for(server.first_event_relayed.wait(), 60)  # a guard against a hang only
        await clock.drive(relaying, until_s=started + 5.0,
                          is_settled=lambda: body().count(b": ping") == server.num_pings)
        assert relaying.done(), "the stream did not end within 5 s on the clock"
    await asyncio.wait_for(relaying, timeout=60)
    (end,) = ends
    return sent[0]["status"], body(), end, clock.now() - started


def error_events(body: bytes) -> list[dict[str, Any]]:
    events = [json.loads(e[len(b"data: "):]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    return [e["error"] for e in events if "error" in e]


@pytest.mark.parametrize(("fault", "error_type", "code", "words"), [
    ("hang", "upstream_timeout", 504, "sent nothing for 0.3 s mid-answer"),
    ("pings", "upstream_timeout", 504, "sent nothing but SSE comments for 0.3 s mid-answer"),
    ("reset", "upstream_stream_error", 502, "broke off mid-answer"),
    ("cut", "upstream_stream_error", 502, "ended its stream without `data: [DONE]`"),
])
async def test_a_stream_that_fails_after_its_head_ends_with_an_error_event_and_done(
        fault: str, error_type: str, code: int, words: str) -> None:
    clock = ManualClock()
    async with serving(read_s=0.3, clock=clock) as (server, client):
        is_stalled = fault in ("hang", "pings")
        status, body, end, took_s = await relay(Upstream(client, clock), f"/sse/{fault}", server, clock, is_stalled)
        if fault in ("hang", "pings"):
            await asyncio.wait_for(server.gone.wait(), 5)  # the upstream request was dropped, not left hanging

    assert status == 200 and body.startswith(FIRST_EVENT) and body.endswith(b"data: [DONE]\n\n")
    (error,) = error_events(body)
    assert (error["type"], error["code"]) == (error_type, code) and words in error["message"], error
    assert end.outcome == "upstream_error"
    if fault == "pings":
        assert b": ping\n\n" in body  # keep-alives pass on, but do not count as progress
    if fault == "hang":
        assert took_s == pytest.approx(0.3)  # at the read timeout (upstream_timeout_s), on the clock
    elif fault == "pings":  # bounded by the read timeout even with pings coming: ended at the first ping past it
        assert 0.3 - 1e-9 <= took_s <= 0.35 + 1e-9 and body.count(b": ping") == server.num_pings
    else:
        assert took_s == 0.0  # no time passed: a reset or a cut ends the stream at once

"""Issue 46, the gateway's third pass, against a real server (`served.serving`: uvicorn with the CLI's protocol and
options, a real aiohttp upstream), raw bytes over TCP:
- item 3: slow clients: a head or body slower than its timeout gets a JSON 408 and the connection is closed; a
  connection that never sends a byte is closed; the open connections and each client's idle ones are capped;
  `max_body_bytes_in_flight` counts bytes received, not declared, so slow clients declaring 64 MiB bodies do not
  keep a normal 2 MiB body out;
- item 5: a non-streamed answer cut after its head ends the connection without completing the answer: the client
  sees a broken answer, never a 200 whose body parses as complete; the streamed path keeps its error event.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from tests.runtime.served import raw_exchange, serving
from tests.runtime.test_gateway_app import eventually
from tests.runtime.test_gateway_hardening import chat_body, post, sigterm

pytestmark = pytest.mark.asyncio


# --- item 5: a non-streamed answer cut after its head -----------------------------------------------------------


async def test_a_non_streamed_answer_cut_after_its_head_breaks_the_connection_never_a_complete_200() -> None:
    half = b'{"id": "x", "choices": [{"message": {"content": "he'

    async def cut_short(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await response.write(half)
        await asyncio.sleep(60)  # the rest never comes within the drain
        return response

    async with serving(drain_timeout_s=0.5) as served:
        served.handler = cut_short
        waiting = asyncio.create_task(raw_exchange(served.port, post(chat_body("task"), b"w")))
        await eventually(lambda: len(served.received) == 1)
        # the answer's head and first bytes are passed on: the call no longer waits for its first byte
        await eventually(lambda: served.rig.gateway.num_active_calls == 1
                         and not served.rig.gateway.telemetry._awaiting_first_byte)
        await sigterm(served)
        answer = await asyncio.wait_for(waiting, 10)
        assert answer is not None and answer.status == 200 and answer.body == half
        assert not answer.is_complete  # the client reads a broken answer, not a whole one
        await asyncio.wait_for(served.wait_stopped(), 5)


async def test_a_non_streamed_answer_the_upstream_stops_sending_breaks_the_connection() -> None:
    half = b'{"id": "x", "choices": [{"message": {"content": "he'

    async def stalls(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await response.write(half)
        await asyncio.sleep(60)  # past the gateway's upstream_timeout_s
        return response

    async with serving(upstream_read_s=0.3) as served:
        served.handler = stalls
        answer = await asyncio.wait_for(raw_exchange(served.port, post(chat_body("task"), b"w")), 10)
        assert answer is not None and answer.status == 200 and answer.body == half and not answer.is_complete


async def test_a_non_streamed_json_answer_the_upstream_ends_short_is_not_passed_on_as_a_complete_200() -> None:
    half = b'{"id": "x", "choices": [{"message": {"content": "he'

    async def ends_short(request: web.Request) -> web.StreamResponse:  # e.g. a router whose worker timed out
        await request.read()
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await response.write(half)
        await response.write_eof()  # a well-framed end: the body it ends is not the JSON it claims
        return response

    async with serving() as served:
        served.handler = ends_short
        answer = await asyncio.wait_for(raw_exchange(served.port, post(chat_body("task"), b"w")), 10)
        assert answer is not None and answer.status == 200 and answer.body == half
        assert not answer.is_complete  # the connection is broken off: the client sees an error
        metrics = served.rig.gateway.telemetry.metrics
        await eventually(lambda: b'basin_calls_total{outcome="upstream_error"} 1.0' in metrics.render())
        assert served.rig.room.registry.get("w") is None  # its only call failed: released, no budget held


# --- item 3: slow clients -----------------------------------------------------------------------------------------


async def open_slow(port: int, head: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if head:
        writer.write(head)
        await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    return await asyncio.wait_for(reader.read(), timeout_s)


def declares(num_bytes: int, session: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Session-ID: " + session +
            b"\r\nContent-Type: application/json\r\nContent-Length: " + str(num_bytes).encode() + b"\r\n\r\n{")


async def test_slow_clients_declaring_64_mib_bodies_do_not_keep_a_normal_2_mib_body_out() -> None:
    # The attack: 4 connections declare 64 MiB each (the default budget in flight is 4 x 64 MiB) and trickle.
    async with serving() as served:
        slow = [await open_slow(served.port, declares(64 << 20, f"slow{k}".encode())) for k in range(4)]
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
        answer = await raw_exchange(served.port, post(big, b"normal"))
        assert answer is not None and answer.status == 200, answer
        assert served.rig.gateway.bodies.held_bytes == 0
        for _, writer in slow:
            writer.close()


async def test_a_connection_without_a_byte_is_closed_and_a_slow_head_gets_a_json_408() -> None:
    async with serving(connection_limits={"header_timeout_s": 0.3}) as served:
        silent = [await open_slow(served.port) for _ in range(50)]
        reader, writer = await open_slow(served.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gate")
        answer = await closed_by_server(reader, 5)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert (error["type"], error["limit"], error["option"]) == ("request_timeout", "header_timeout_s",
                                                                     "--header-timeout-s")
        assert [await closed_by_server(r, 5) for r, _ in silent] == [b""] * 50  # closed without an answer
        for _, w in [*silent, (reader, writer)]:
            w.close()
        assert served.received == []


async def test_a_slow_body_gets_a_json_408_naming_its_timeout_and_holds_no_budget_after() -> None:
    async with serving(connection_limits={"body_timeout_s": 0.3}) as served:
        reader, writer = await open_slow(served.port, declares(2 << 20, b"slow"))
        writer.write(b"x" * (1 << 20))  # half of it, then nothing
        await writer.drain()
        answer = await closed_by_server(reader, 5)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"]["limit"] == "body_timeout_s"
        await eventually(lambda: served.rig.gateway.bodies.held_bytes == 0)
        assert served.received == [] and served.rig.room.registry.get("slow") is None
        writer.close()


async def test_open_connections_are_capped_by_closing_the_oldest_idle_one() -> None:
    async with serving(connection_limits={"max_connections": 5}) as served:
        first = [await open_slow(served.port) for _ in range(5)]
        answer = await raw_exchange(served.port, post(chat_body("task"), b"s"))  # the 6th: the oldest idle goes
        assert answer is not None and answer.status == 200
        assert await closed_by_server(first[0][0], 5) == b""
        for _, writer in first:
            writer.close()


async def test_a_clients_idle_connections_are_capped_by_closing_its_oldest() -> None:
    async with serving(connection_limits={"max_idle_connections_per_client": 3}) as served:
        idle = [await open_slow(served.port) for _ in range(4)]
        assert await closed_by_server(idle[0][0], 5) == b""  # the 4th idle one closed the oldest
        answer = await raw_exchange(served.port, post(chat_body("task"), b"s"))
        assert answer is not None and answer.status == 200
        for _, writer in idle:
            writer.close()

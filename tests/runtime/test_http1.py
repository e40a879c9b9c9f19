"""The gateway's own HTTP/1.1 client (`basin_runtime/gateway/http1.py`) against a scripted raw-socket server.

What the shared client suite (`test_gateway_upstream.py`) cannot script: connection reuse and when it must
not happen, a reused connection the server closed, bodies framed every way HTTP/1.1 allows, HEAD, an
encoding applied anyway, invalid HTTP, and flow control on a large body. Connections age on a `ManualClock`
the tests move; a test waits for a state (`until`), never a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from basin_runtime.clock import ManualClock
from basin_runtime.gateway import http1
from basin_runtime.gateway.errors import UpstreamRefusedError
from basin_runtime.gateway.http1 import Http1UpstreamClient
from basin_runtime.gateway.upstream import UpstreamBrokenError

pytestmark = pytest.mark.asyncio
Script = Callable[[bytes, int], bytes | None]  # (request head, its number on the connection) -> raw answer; None: close


class ScriptedServer:
    """Reads one request at a time per connection and writes what `script` says; counts connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = 0  # connections the client closed (or the server ended)
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = self.script(head, number)
                number += 1
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"\r\nconnection: close\r\n" in answer.split(b"\r\n\r\n")[0] + b"\r\n":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def until(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` holds (the timeout guards against a hang only)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.002)


@asynccontextmanager
async def scripted(script: Script, read_s: float = 5.0,
                   clock: ManualClock | None = None) -> AsyncIterator[tuple[ScriptedServer, Http1UpstreamClient]]:
    server = ScriptedServer(script)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = Http1UpstreamClient(f"http://127.0.0.1:{port}/prefix", connect_s=2.0, read_s=read_s,
                                 clock=clock or ManualClock())
    await client.start()
    try:
        yield server, client
    finally:
        await client.aclose()
        listener.close()
        await listener.wait_closed()


def ok(body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


async def get(client: Http1UpstreamClient, method: str = "POST", body: bytes | None = b"{}") -> tuple[int, bytes]:
    answer = await client.send(method, "/v1/x", {"x-a": "1"}, body, "q=1")
    try:
        return answer.status_code, await answer.read(1 << 24)
    finally:
        await answer.aclose()


async def test_one_connection_serves_call_after_call_with_the_base_path_host_and_length() -> None:
    async with scripted(lambda head, n: ok(b"answer %d" % n)) as (server, client):
        got = [await get(client) for _ in range(5)]
    assert got == [(200, b"answer %d" % n) for n in range(5)]
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /prefix/v1/x?q=1 HTTP/1.1\r\n")
    assert b"\r\nx-a: 1\r\n" in first and b"\r\ncontent-length: 2\r\n" in first and first.endswith(b"\r\n\r\n{}")
    assert b"\r\nhost: 127.0.0.1:" in first


async def test_connection_close_or_an_unread_body_means_a_new_connection() -> None:
    async with scripted(lambda head, n: ok(b"x", "connection: close")) as (server, client):
        await get(client)
        await get(client)
    assert server.connections == 2
    half = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"y" * 50  # the rest not sent yet
    answers = [half, ok(b"z")]
    async with scripted(lambda head, n: answers.pop(0)) as (server, client):
        answer = await client.send("POST", "/v1/x", {}, b"{}")
        assert await answer.read(10) == b"y" * 10
        await answer.aclose()  # 50 bytes still to come: the connection cannot carry another answer
        assert await get(client) == (200, b"z")
    assert server.connections == 2
    async with scripted(lambda head, n: ok(b"y" * 100)) as (server, client):
        answer = await client.send("POST", "/v1/x", {}, b"{}")
        assert await answer.read(10) == b"y" * 10
        await answer.aclose()  # all 100 bytes had arrived: the connection is clean and is reused
        assert await get(client) == (200, b"y" * 100)
    assert server.connections == 1


async def test_a_reused_connection_the_server_closed_is_retried_once_on_a_new_one() -> None:
    async with scripted(lambda head, n: ok(b"first") if n == 0 else None) as (server, client):
        assert await get(client) == (200, b"first")
        assert await get(client) == (200, b"first")  # the second request met the close; sent again, answered
    assert server.connections == 2


async def test_a_new_connection_closed_before_any_answer_is_refused_not_retried() -> None:
    async with scripted(lambda head, n: None) as (server, client):
        with pytest.raises(UpstreamRefusedError, match="closed the connection"):
            await get(client)
    assert server.connections == 1


async def test_idle_connections_past_the_keep_alive_are_dropped() -> None:
    clock = ManualClock()
    async with scripted(lambda head, n: ok(b"x"), clock=clock) as (server, client):
        await get(client)
        clock.advance(http1.KEEPALIVE_S - 0.01)
        await get(client)
        assert server.connections == 1  # idle just under the keep-alive: reused
        clock.advance(http1.KEEPALIVE_S)
        await get(client)
    assert server.connections == 2


async def test_connections_idle_past_the_keep_alive_are_closed_when_the_pool_is_next_used() -> None:
    clock = ManualClock()
    release = asyncio.Event()
    opened: list[int] = []

    async def slow_get() -> tuple[int, bytes]:
        answer = await client.send("POST", "/v1/x", {}, b"{}")
        opened.append(answer.status_code)
        await release.wait()  # all three answers are open at once: three connections
        try:
            return answer.status_code, await answer.read(100)
        finally:
            await answer.aclose()

    async with scripted(lambda head, n: ok(b"x"), clock=clock) as (server, client):
        calls = [asyncio.ensure_future(slow_get()) for _ in range(3)]
        await until(lambda: len(opened) == 3)
        release.set()
        assert await asyncio.gather(*calls) == [(200, b"x")] * 3
        assert server.connections == 3 and server.closed == 0  # kept for reuse
        clock.advance(http1.KEEPALIVE_S)
        await get(client)  # takes a fresh connection; the three stale ones are closed
        await until(lambda: server.closed >= 3)  # the server hears the closes
        assert server.connections == 4 and server.closed == 3


@pytest.mark.parametrize(("raw", "body"), [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", b"abcde"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", b""),
    (b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the close", b"until the close"),
    (b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n", b"zipped anyway"),
])
async def test_every_body_framing_and_a_gzip_encoding_read_back_exactly(raw: bytes, body: bytes) -> None:
    if b"gzip" in raw:
        packed = gzip.compress(body)
        raw = raw % len(packed) + packed

    def script(head: bytes, n: int) -> bytes:
        return raw

    async with scripted(script) as (_server, client):
        assert await get(client) == (200, body)


async def test_an_encoding_it_cannot_undo_is_a_broken_answer() -> None:
    async with scripted(lambda head, n: ok(b"\x00\x01", "content-encoding: br")) as (_server, client):
        answer = await client.send("POST", "/v1/x", {}, b"{}")
        with pytest.raises(UpstreamBrokenError, match="cannot undo: 'br'"):
            await answer.read(100)
        await answer.aclose()


async def test_a_head_answer_has_no_body_and_does_not_hang() -> None:
    async with scripted(lambda head, n: b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n") as (_server, client):
        assert await asyncio.wait_for(get(client, "HEAD", None), 2) == (200, b"")


async def test_invalid_http_is_refused_before_the_head_and_broken_after_it() -> None:
    async with scripted(lambda head, n: b"NOT HTTP AT ALL\r\n\r\n") as (_server, client):
        with pytest.raises(UpstreamRefusedError, match=r"not valid HTTP/1\.1"):
            await get(client)
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nZZ\r\n"
    async with scripted(lambda head, n: chunked) as (_server, client):
        answer = await client.send("POST", "/v1/x", {}, b"{}")
        with pytest.raises(UpstreamBrokenError, match=r"not valid HTTP/1\.1"):
            await answer.read(100)
        await answer.aclose()


async def test_a_large_body_pauses_reading_and_arrives_whole_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "HIGH_WATER_BYTES", 64 << 10)
    monkeypatch.setattr(http1, "LOW_WATER_BYTES", 16 << 10)
    payload = bytes(range(256)) * (16 << 10)  # 4 MiB
    big_request = b"r" * (1 << 20)  # written beside its head, not joined to it
    paused: list[bool] = []
    pause = http1._Connection.on_body

    def on_body(self: http1._Connection, body: bytes) -> None:
        pause(self, body)
        paused.append(self._is_paused)

    monkeypatch.setattr(http1._Connection, "on_body", on_body)
    async with scripted(lambda head, n: ok(payload)) as (server, client):
        answer = await client.send("POST", "/v1/x", {}, big_request)
        conn = answer._conn
        assert conn is not None
        await until(lambda: conn._is_paused)  # the client stops reading at the high water
        assert conn.transport is not None and not conn.transport.is_reading()
        assert conn.buffered < 1 << 20  # not all 4 MiB: reading paused
        got = b"".join([chunk async for chunk in answer.chunks()])
        await answer.aclose()
    assert got == payload and any(paused)
    assert server.requests[0].endswith(big_request)


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
Writes = Callable[[asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def timed_answer(writes: Writes) -> AsyncIterator[Http1UpstreamClient]:
    """A client of a server that reads one request, then lets `writes` write the answer, when it likes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(request.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        await writes(writer)
        writer.close()
        await writer.wait_closed()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    client = Http1UpstreamClient(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}", connect_s=2.0, read_s=5.0)
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()
        listener.close()
        await listener.wait_closed()


@pytest.mark.parametrize("is_terminator_late", [False, True])
async def test_the_relay_sends_the_last_event_with_the_end_only_once_the_whole_body_has_arrived(
        is_terminator_late: bool) -> None:
    """A body wholly received: its last event (`[DONE]`) and the answer's end go in one ASGI message (one write).
    A terminator still to come: `[DONE]` goes at once, the end when the upstream ends (nothing is held back)."""
    from basin_runtime.gateway.proxy import CallEnd, UpstreamResponse

    events = [b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', b"data: [DONE]\n\n"]
    terminator_written, done_sent = asyncio.Event(), asyncio.Event()

    async def writes(writer: asyncio.StreamWriter) -> None:
        if is_terminator_late:
            writer.write(SSE_HEAD + _chunked(*events))
            await writer.drain()
            with contextlib.suppress(TimeoutError):  # [DONE] held back: the terminator comes, and the test fails
                await asyncio.wait_for(done_sent.wait(), 10)
        writer.write((b"" if is_terminator_late else SSE_HEAD + _chunked(*events)) + b"0\r\n\r\n")
        terminator_written.set()
        await writer.drain()

    sent: list[tuple[dict[str, object], bool]] = []  # (message, was the terminator written by then)
    ends: list[CallEnd] = []

    async def send(message: dict[str, object]) -> None:
        sent.append((message, terminator_written.is_set()))
        body = message.get("body")
        if isinstance(body, bytes) and body.endswith(events[-1]):
            done_sent.set()

    async def on_end(end: CallEnd) -> None:
        ends.append(end)

    async def never_disconnects() -> dict[str, object]:
        await asyncio.Event().wait()
        return {}

    async with timed_answer(writes) as client:
        answer = await client.send("POST", "/v1/chat/completions", {}, b"{}")
        if not is_terminator_late:
            await until(lambda: answer.is_received)  # the whole answer is buffered before the relay starts
        await UpstreamResponse(answer, on_end)({"type": "http"}, never_disconnects, send)  # type: ignore[arg-type]

    bodies = [(m["body"], m["more_body"], written) for m, written in sent if m["type"] == "http.response.body"]
    assert b"".join(body for body, _, _ in bodies) == b"".join(events) and ends[0].outcome == "completed"
    if is_terminator_late:
        done = next(k for k, (body, _, _) in enumerate(bodies) if body.endswith(events[-1]))
        assert bodies[done][1:] == (True, False)  # sent at once, before the upstream's end came
        assert bodies[-1] == (b"", False, True)
    else:
        assert bodies[-1][0].endswith(events[-1]) and bodies[-1][1] is False  # [DONE] and the end: one message
        assert all(more for _, more, _ in bodies[:-1])


async def test_http_chunks_received_together_come_out_as_one_piece_and_later_ones_as_they_come() -> None:
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    answer_sent = asyncio.Event()

    async def writes(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + _chunked(*events[:2]))  # two HTTP chunks in one write
        await writer.drain()
        await answer_sent.wait()
        writer.write(_chunked(events[2]) + b"0\r\n\r\n")
        await writer.drain()

    async with timed_answer(writes) as client:
        answer = await client.send("POST", "/v1/chat/completions", {}, b"{}")
        pieces = []
        async for piece in answer.chunks():
            pieces.append(piece)
            answer_sent.set()  # the last event is written only once the first piece is out
        await answer.aclose()
    assert pieces == [events[0] + events[1], events[2]]

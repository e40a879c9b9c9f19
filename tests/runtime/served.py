"""A rig's gateway served for real: uvicorn with the CLI's server configuration on a loopback port, in front of a
small aiohttp upstream on another, and a raw client that sends whatever bytes a test writes.

`serving(...)` yields a `Served`: the rig (its gateway and policy, as in test_gateway_app.py), the gateway's port,
the upstream's handler (replace it per test) and what the upstream received. The server runs as a task of the
test's own event loop (so a test reads the gateway's state directly) and is stopped as SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httptools
from aiohttp import web

from basin_runtime.clock import Clock
from basin_runtime.gateway.http1 import Http1UpstreamClient
from basin_runtime.gateway.limits import DEFAULT_MAX_HEADER_BYTES
from basin_runtime.gateway.server import ConnectionLimits, DrainingServer, server_config
from basin_stack.stack import free_port
from tests.runtime.test_gateway_app import ANSWER, Rig, rig_for

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def answer_json(request: web.Request) -> web.StreamResponse:
    """What an SGLang router answers a chat call (and any other request): a small JSON body."""
    await request.read()
    return web.json_response(ANSWER if request.method == "POST" else {"path": request.path})


@dataclass
class Served:
    """A rig's app behind a real server, and its upstream."""

    rig: Rig
    port: int
    server: DrainingServer
    received: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # method, path_qs, headers
    handler: Handler = answer_json

    stopped: asyncio.Task[None] | None = None  # the server's task

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_stopped(self) -> None:
        """Until the server has shut down (after `server.should_exit`, as SIGTERM sets it)."""
        assert self.stopped is not None
        await asyncio.shield(self.stopped)

    async def upstream(self, request: web.Request) -> web.StreamResponse:
        self.received.append((request.method, request.raw_path, dict(request.headers)))
        return await self.handler(request)


@asynccontextmanager
async def serving(*, max_header_bytes: int | None = None, max_headers: int | None = None,
                  drain_timeout_s: float = 5.0, connection_limits: dict[str, Any] | None = None,
                  upstream_read_s: float = 10.0, drain_clock: Clock | None = None,
                  **rig_options: Any) -> AsyncIterator[Served]:
    """The rig of `rig_for(**rig_options)` served by uvicorn as the CLI serves it, its upstream a real aiohttp
    server reached with the gateway's own HTTP/1.1 client (`drain_clock`: the clock a shutdown's drain runs on;
    the real one unless a test drives it)."""
    upstream_port, port = free_port(), free_port()
    limits = {k: v for k, v in (("max_header_bytes", max_header_bytes), ("max_headers", max_headers)) if v is not None}
    client = Http1UpstreamClient(f"http://127.0.0.1:{upstream_port}", connect_s=5, read_s=upstream_read_s,
                                 max_head_bytes=limits.get("max_header_bytes", DEFAULT_MAX_HEADER_BYTES))
    async with rig_for(upstream_client=client, **rig_options) as rig:
        server = DrainingServer(server_config(rig.app, host="127.0.0.1", port=port, keep_alive_s=5,
                                              limits=ConnectionLimits(**limits, **(connection_limits or {}))),
                                rig.gateway, drain_timeout_s=drain_timeout_s, clock=drain_clock)
        server.config.log_level = "warning"
        served = Served(rig, port, server)
        # aiohttp refuses bodies over 1 MiB by default, and lets a handler run on when its client has gone
        app = web.Application(client_max_size=1 << 30, handler_args={"handler_cancellation": True})
        app.router.add_route("*", "/{tail:.*}", served.upstream)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", upstream_port).start()
        task = served.stopped = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(10):
                while not server.started:
                    await asyncio.sleep(0.01)
            yield served
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 30)
            await runner.cleanup()


@dataclass
class RawAnswer:
    """An HTTP/1.1 answer as it came off the wire."""

    status: int
    headers: dict[str, str]
    body: bytes
    is_complete: bool = True  # the answer's framing ended it (False: the connection closed mid-body)


class _AnswerParser:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.is_complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.is_complete = True


async def raw_exchange(port: int, *pieces: bytes, timeout_s: float = 10.0) -> RawAnswer | None:
    """Write `pieces` to a new connection (stopping early if the server closes it), read one answer; None if the
    connection closed without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    parsed = _AnswerParser()
    parser = httptools.HttpResponseParser(parsed)
    try:
        async with asyncio.timeout(timeout_s):
            for piece in pieces:
                try:
                    writer.write(piece)
                    await writer.drain()
                except ConnectionError:
                    break
            while not parsed.is_complete:
                try:
                    data = await reader.read(1 << 16)
                except ConnectionError:
                    data = b""
                if not data:
                    break
                parser.feed_data(data)
    finally:
        writer.close()
    if parsed.headers == {} and not parsed.body:
        return None
    return RawAnswer(parser.get_status_code(), parsed.headers, bytes(parsed.body), parsed.is_complete)

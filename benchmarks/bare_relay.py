"""A bare relay: what forwarding alone costs in Python, for `bench_gateway.py --gateway bare-asgi|bare-protocol`.

Not a gateway: no sessions, no policy, no parsing, no counting, no metrics, no log. It reads a POST's body,
sends it to the upstream with the gateway's own HTTP/1.1 client (`basin_runtime.gateway.http1`) and streams
the answer's chunks back as they arrive; a POST to `/basin/sessions/.../end` is answered `{}` at once and
`GET /health` `{"status": "ok"}`. Its CPU per call is the floor under the gateway's on the same stack:

- `asgi`: uvicorn (httptools, as the gateway runs it) and a raw ASGI app: the HTTP server the gateway uses.
- `protocol`: an asyncio protocol on httptools' request parser writing to the socket itself: no ASGI server.

    python benchmarks/bare_relay.py --mode asgi|protocol --upstream http://127.0.0.1:PORT --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import httptools  # noqa: E402

from basin_runtime.gateway.http1 import Http1UpstreamClient  # noqa: E402

NOT_FORWARDED = {b"host", b"content-length", b"connection", b"transfer-encoding", b"accept-encoding"}
NOT_RETURNED = {"transfer-encoding", "content-length", "connection", "date", "server", "keep-alive"}
HEALTH = b'{"status": "ok"}'


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() not in NOT_FORWARDED}
    kept["accept-encoding"] = "identity"
    return kept


def _answer_head(status: int, headers: dict[str, str] | None = None, *, chunked: bool, length: int = 0) -> bytes:
    lines = [f"HTTP/1.1 {status} OK\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in (headers or {}).items() if k.lower() not in NOT_RETURNED]
    lines.append("transfer-encoding: chunked\r\n\r\n" if chunked else f"content-length: {length}\r\n\r\n")
    return "".join(lines).encode("latin-1")


def asgi_app(client: Http1UpstreamClient) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                  send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await client.start()
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if scope["method"] == "GET" or path.startswith("/basin/"):
            body = HEALTH if scope["method"] == "GET" else b"{}"
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        answer = await client.send("POST", path, _headers(scope["headers"]), b"".join(chunks))
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
                   if k.lower() not in NOT_RETURNED]
        await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
        try:
            async for chunk in answer.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await answer.aclose()
        await send({"type": "http.response.body", "body": b""})

    return app


class RelayProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, relay each POST, write the answer itself."""

    def __init__(self, client: Http1UpstreamClient) -> None:
        self.client = client
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.url = b""
        self.queue: asyncio.Queue[tuple[str, str, list[tuple[bytes, bytes]], bytes]] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not asyncio's class
        self.worker = asyncio.get_running_loop().create_task(self.serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.headers, self.body, self.url = [], [], b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self.queue.put_nowait((method, self.url.decode("latin-1"), self.headers, b"".join(self.body)))

    async def serve(self) -> None:
        transport = self.transport
        assert transport is not None
        while True:
            method, path, headers, body = await self.queue.get()
            if method == "GET" or path.startswith("/basin/"):
                data = HEALTH if method == "GET" else b"{}"
                transport.write(_answer_head(200, {"content-type": "application/json"}, chunked=False,
                                             length=len(data)) + data)
                continue
            answer = await self.client.send("POST", path, _headers(headers), body)
            head = _answer_head(answer.status_code, dict(answer.headers), chunked=True)
            try:
                async for chunk in answer.chunks():
                    transport.write(head + b"%x\r\n%b\r\n" % (len(chunk), chunk))
                    head = b""
            finally:
                await answer.aclose()
            transport.write(head + b"0\r\n\r\n")


async def serve_protocol(client: Http1UpstreamClient, port: int) -> None:
    await client.start()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RelayProtocol(client), "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("asgi", "protocol"), required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    client = Http1UpstreamClient(args.upstream, connect_s=10.0, read_s=600.0)
    if args.mode == "protocol":
        import uvloop  # the loop uvicorn picks for the gateway when it is installed

        uvloop.run(serve_protocol(client, args.port))
        return
    import uvicorn

    uvicorn.run(asgi_app(client), host="127.0.0.1", port=args.port, log_level="warning", http="httptools",
                proxy_headers=False, access_log=False, backlog=2048)


if __name__ == "__main__":
    main()

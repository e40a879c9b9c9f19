"""Where a request's prefill and decode halves meet: the prefill server's bootstrap port, plain HTTP.

Protocol (one room per request; the router puts the same `bootstrap_room` in both halves):
  POST http://{bootstrap_host}:{bootstrap_port}/kv/{room}   body {"ready_unix_s": t[, "decode_prefix_len": n]}
    The decode side sends it once the request's memory is reserved: the room is then ready for the
    KV, which is what the prefill half waits for before it may queue (SGLang's prefill holds a
    request in its bootstrap queue until decode has pre-allocated; `decode_prefix_len`: what a decode
    radix cache holds of it, so only the rest moves). The answer comes when the KV has arrived: 200
    {"room", "prompt_tokens", "cached_tokens", "device_hit_tokens", "host_hit_tokens",
    "storage_hit_tokens", "computed_tokens", "cached_tokens_details", "transfer_done_unix_s"};
    409 {"error"} if the prefill half failed; 504 {"error"} if nothing was published within the timeout.
  POST /kv/{room}/abort   body {"reason": text}
    The decode side refused the request before reserving (bad or too large): the prefill half stops
    waiting and fails at once instead of at its timeout. Answered 200 at once.
  GET /health: 200. Any bare TCP connect is accepted (smg probes the port).

Rules:
- Either half may arrive first: a room is created by whichever comes first. The decode's POST
  removes it once answered; any room is removed `2 x timeout_s` after its creation at the latest,
  so a failure published by the prefill half still reaches a decode half that comes late.
- The prefill half waits for "ready" at most `timeout_s` (then `BootstrapError`); the decode half's
  POST waits for the result at most `timeout_s`; the decode side gives its POST `timeout_s` +
  CLIENT_MARGIN_S, an abort ABORT_TIMEOUT_S. All are wall seconds on the server's injected clock
  (`basin_runtime.clock`: the real one, unless a test drives it), as is a room's expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from basin_emulate.errors import BootstrapError
from basin_runtime.clock import Clock, Deadline, Timer

CLIENT_MARGIN_S = 5.0  # the decode's HTTP timeout beyond the server's own wait
ABORT_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 1.0  # on shutdown, pending long-polls are cut after this


@dataclass(eq=False)
class Room:
    """The meeting point of one request's two halves."""

    room_id: str
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ready_unix_s: float = 0.0
    decode_prefix_len: int = 0
    abort_reason: str | None = None
    result: asyncio.Future[dict[str, Any]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    expiry: Timer | None = None


class Rooms:
    """The prefill side's table of rooms, and its bootstrap HTTP server."""

    def __init__(self, timeout_s: float, clock: Clock) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._rooms: dict[str, Room] = {}
        self.num_waiting_ready = 0
        self._runner: web.AppRunner | None = None

    def get(self, room_id: str) -> Room:
        """The room, created if neither half has come yet."""
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room(room_id)
            room.expiry = self.clock.call_at(self.clock.now() + 2 * self.timeout_s, lambda: self.discard(room))
        return room

    def discard(self, room: Room) -> None:
        """Forget a room (if the table still holds this one)."""
        if self._rooms.get(room.room_id) is room:
            del self._rooms[room.room_id]
        if room.expiry is not None:
            room.expiry.cancel()

    def __len__(self) -> int:
        return len(self._rooms)

    async def wait_ready(self, room: Room) -> float:
        """Until the decode half has reserved its memory; the unix time (`Clock.wall`) it did."""
        self.num_waiting_ready += 1
        try:
            async with Deadline(self.clock, self.timeout_s):
                await room.ready.wait()
        except TimeoutError:
            raise BootstrapError(f"no decode server connected to bootstrap room {room.room_id} within "
                                 f"{self.timeout_s:g} s") from None
        finally:
            self.num_waiting_ready -= 1
        if room.abort_reason is not None:
            raise BootstrapError(f"the decode half of bootstrap room {room.room_id} refused the request: "
                                 f"{room.abort_reason}")
        return room.ready_unix_s

    @staticmethod
    def publish(room: Room, payload: dict[str, Any]) -> None:
        """Hand the request's KV (its outcome), or {"error": ...}, to the decode half."""
        if not room.result.done():
            room.result.set_result(payload)

    # --- the HTTP server -------------------------------------------------------------------------------

    async def serve(self, host: str, port: int) -> None:
        """Listen on the bootstrap port."""
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/kv/{room}", self._on_kv)
        app.router.add_post("/kv/{room}/abort", self._on_abort)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()

    async def close(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _on_kv(self, request: web.Request) -> web.Response:
        room = self.get(request.match_info["room"])
        try:
            body = await request.json()
            room.ready_unix_s = float(body.get("ready_unix_s", self.clock.wall()))
            room.decode_prefix_len = max(0, int(body.get("decode_prefix_len", 0)))
        except (ValueError, TypeError, AttributeError):
            return web.json_response({"error": "the body must be JSON with a number ready_unix_s (and a whole "
                                               "decode_prefix_len)"}, status=400)
        room.ready.set()
        try:
            async with Deadline(self.clock, self.timeout_s):
                payload = await asyncio.shield(room.result)
        except TimeoutError:
            return web.json_response({"error": f"the prefill server published nothing for room {room.room_id} "
                                               f"within {self.timeout_s:g} s (it never received the request, or "
                                               "gave up on it)"}, status=504)
        finally:
            self.discard(room)
        return web.json_response(payload, status=409 if "error" in payload else 200)

    async def _on_abort(self, request: web.Request) -> web.Response:
        room = self.get(request.match_info["room"])
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            room.abort_reason = str((await request.json()).get("reason"))
        room.abort_reason = room.abort_reason or "no reason given"
        room.ready.set()
        return web.json_response({"room": room.room_id})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


@dataclass(frozen=True)
class KvArrival:
    """What the decode half learns when a request's KV arrives."""

    prompt_tokens: int
    cached_tokens: int
    transfer_done_unix_s: float
    cached_details: dict[str, int | str] | None = None  # SGLang's cached_tokens_details, from prefill


class BootstrapClient:
    """The decode side: tell the prefill's bootstrap server a room is ready, wait for its KV."""

    def __init__(self, timeout_s: float, clock: Clock) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session (on the running loop; its requests are timed on the clock, not by aiohttp)."""
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open HTTP session."""
        if self._session is None:
            raise RuntimeError("the bootstrap client is not started")
        return self._session

    async def fetch_kv(self, host: str, port: int, room: str, ready_unix_s: float,
                       decode_prefix_len: int = 0) -> KvArrival:
        """Signal that room `room` is ready and wait for its KV; `BootstrapError` if it never comes."""
        netloc = _netloc(host, port)
        ready = {"ready_unix_s": ready_unix_s, "decode_prefix_len": decode_prefix_len}
        try:
            async with (Deadline(self.clock, self.timeout_s + CLIENT_MARGIN_S),
                        self.session.post(f"http://{netloc}/kv/{room}", json=ready) as response):
                body = await response.json(content_type=None)
                status = response.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise BootstrapError(f"bootstrap room {room}: cannot reach the prefill server's bootstrap port at "
                                 f"{netloc}: {exc or type(exc).__name__}") from exc
        if status != 200 or not isinstance(body, dict):
            detail = body.get("error") if isinstance(body, dict) else body
            raise BootstrapError(f"bootstrap room {room} at {netloc}: {detail}")
        try:
            details = body.get("cached_tokens_details")
            return KvArrival(int(body["prompt_tokens"]), int(body["cached_tokens"]),
                             float(body["transfer_done_unix_s"]), details if isinstance(details, dict) else None)
        except (KeyError, TypeError, ValueError) as exc:
            raise BootstrapError(f"bootstrap room {room} at {netloc}: malformed answer {body!r}") from exc

    async def abort(self, host: str, port: int, room: str, reason: str) -> None:
        """Tell the prefill half that this request will not come for its KV (best effort: errors are ignored)."""
        url = f"http://{_netloc(host, port)}/kv/{room}/abort"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with (Deadline(self.clock, ABORT_TIMEOUT_S),
                        self.session.post(url, json={"reason": reason}) as response):
                await response.read()


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

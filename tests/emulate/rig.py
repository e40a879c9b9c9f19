"""In-process emulated servers for the tests: apps with their lifespans, and a router-like dual dispatch.

`Pair` runs a prefill and a decode app in this event loop (the prefill's bootstrap port is a real
loopback port; the decode half reaches it with aiohttp, as across processes), talks to both through
`httpx.ASGITransport`, and sends a request to both halves with the bootstrap fields added, as smg does.
`TINY_YAML` is tests/sim/builders.py's TINY profile as a profile file, so durations are round numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from starlette.applications import Starlette

from basin_emulate.config import EmulatorConfig, parse_config
from basin_emulate.server import build_app
from basin_runtime.clock import Clock
from basin_stack.stack import free_port
from tests.sim.builders import TINY

_ROOMS = itertools.count(1)


def tiny_profile_file(folder: Path) -> Path:
    """TINY (prefill 10 ms + 0.1 ms/token, decode 20 ms/step, transfer 5 ms + 1 us/token) as a profile file."""
    path = folder / "tiny.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(TINY)))
    return path


@dataclass
class Server:
    """One emulated server running in this loop."""

    app: Starlette
    config: EmulatorConfig
    http: httpx.AsyncClient

    @property
    def role(self) -> Any:
        """The app's role object (PrefillServer or DecodeServer), for looking at its engine."""
        return self.app.state.role


@asynccontextmanager
async def serving(argv: list[str], wall: Clock | None = None) -> AsyncIterator[Server]:
    """An emulated server from command-line options (on the `wall` clock: the real one if None), started
    (lifespan) and stopped around the block."""
    config = parse_config(argv)
    app = build_app(config, wall)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://emulated", timeout=30) as http:
            yield Server(app, config, http)


@dataclass
class Pair:
    """A prefill and a decode server, and the router's dual dispatch."""

    prefill: Server
    decode: Server

    async def send(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
        """Send `body` to both halves with bootstrap fields (smg's PD protocol); (prefill, decode) responses."""
        routed = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.prefill.config.bootstrap_port,
                  "bootstrap_room": next(_ROOMS)}
        prefill, decode = await asyncio.gather(self.prefill.http.post(path, json=routed),
                                               self.decode.http.post(path, json=routed))
        return prefill, decode

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion through both halves; the decode's answer (both must succeed)."""
        prefill, decode = await self.send("/v1/chat/completions", body)
        assert prefill.status_code == 200, prefill.text
        assert decode.status_code == 200, decode.text
        answer: dict[str, Any] = decode.json()
        return answer


@asynccontextmanager
async def pair(*extra: str, prefill_extra: tuple[str, ...] = (), decode_extra: tuple[str, ...] = (),
               wall: Clock | None = None) -> AsyncIterator[Pair]:
    """A prefill and a decode server with the same `extra` options, on one `wall` clock (the real one if None)."""
    async with AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(serving(
            ["--role", "prefill", "--port", str(free_port()), "--disaggregation-bootstrap-port", str(free_port()),
             *extra, *prefill_extra], wall))
        decode = await stack.enter_async_context(serving(
            ["--role", "decode", "--port", str(free_port()), *extra, *decode_extra], wall))
        yield Pair(prefill, decode)

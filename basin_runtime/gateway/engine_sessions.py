"""Closing a session on the engines when they run SGLang's session radix cache (`engine_session_cache`).

SGLang's `--enable-session-radix-cache` keeps a reference per session tag (the request's top-level
`session_id`) on the KV of its finished calls, evicts unreferenced KV first, and drops a session's
references on `/close_session` (body `{"session_id": tag}`, GET or POST; field-sources.md section 2).
smg routes no `/close_session`, so the gateway posts it to every prefill and decode engine itself.

Rules:
- The tag is the session's routing key (`priority.routing_key`: "basin-" + a hash of the session id):
  stable for the session, the same on every replica and after a restart, never the client's own text.
  A tag closed and used again reopens in SGLang (`open_radix_session` drops its tombstone), so a session
  id reused after its end is tagged alike and takes references again.
- `close(tag)` starts one background task that POSTs the close to every engine at once, each with its
  own timeout; it never waits, raises or delays a call. A failure (unreachable, timeout, a status other
  than 200) counts in `basin_engine_session_close_failures_total{engine}` and is logged (at most once a
  minute per engine); nothing is retried: a session left unclosed keeps soft references, which eviction
  still takes under pressure (SGLang pins nothing).
- `aclose()` (the gateway's end, after its sessions were ended) waits for the closes in flight, each
  bounded by its timeout, then closes the HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import httpx
from prometheus_client import Counter

logger = logging.getLogger(__name__)
CLOSE_PATH = "/close_session"
LOG_EVERY_S = 60.0


class EngineSessions:
    """Posts `/close_session` for an ended session to every engine, in the background (see the rules)."""

    def __init__(self, urls: Sequence[str], failures: Counter, now: Callable[[], float], *, timeout_s: float = 5.0,
                 client: httpx.AsyncClient | None = None) -> None:
        if not urls:
            raise ValueError("engine_session_cache needs at least one engine URL")
        self.urls = tuple(url.rstrip("/") for url in urls)
        self._failures = failures
        self._now = now
        self._timeout_s = timeout_s
        self._client = client or httpx.AsyncClient(trust_env=False)
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged_at: dict[str, float] = {}

    def close(self, tag: str) -> None:
        """Close the session `tag` on every engine, in the background (call inside the event loop)."""
        task = asyncio.get_running_loop().create_task(self._close_all(tag))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_all(self, tag: str) -> None:
        await asyncio.gather(*(self._close_one(url, tag) for url in self.urls))

    async def _close_one(self, url: str, tag: str) -> None:
        try:
            response = await self._client.post(url + CLOSE_PATH, json={"session_id": tag}, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            self._failed(url, tag, f"{type(exc).__name__}: {exc}")
            return
        if response.status_code != 200:
            self._failed(url, tag, f"HTTP {response.status_code}: {response.text[:200]}")

    def _failed(self, url: str, tag: str, why: str) -> None:
        self._failures.labels(url).inc()
        now = self._now()
        last = self._logged_at.get(url)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged_at[url] = now
            logger.warning("cannot close session %s on engine %s: %s (logged at most once a minute per engine)",
                           tag, url, why)

    async def aclose(self) -> None:
        """Wait for the closes in flight (each bounded by its timeout), then close the HTTP client."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        await self._client.aclose()

"""The windowed prefix hit rate scraped from the engines' /metrics counters.

Rules:
- Each configured URL is scraped every `interval_s`; its text is parsed with prometheus_client's
  parser. Hit and total tokens are the sums of `sglang:prefill_effective_tokens_total` over
  `mode=device_hit|host_hit|storage_hit` and over all modes; an engine without that counter falls
  back to `sglang:cached_tokens_total` (all sources) vs `sglang:prompt_tokens_total`. An engine
  with neither gives nothing.
- The hit rate is (sum over engines of hit-counter increase) / (sum of total-counter increase) over
  the last `window_s` seconds: each engine's increase is its newest sample minus its sample at
  the window's start (the newest one at or before it, else its oldest). A counter that went down
  (engine restarted) restarts that engine's history. None while the window's total increase is
  under `min_prompt_tokens`.
- When engines are configured, this is the hit rate fed to `Policy.tick`; while it is None (no
  scrape yet, too little traffic) the gateway falls back to the upstream usage window (`signals.py`).
- A failed scrape (unreachable, non-200, unparsable) counts in `basin_engine_scrape_errors_total`
  and is logged at most once per URL per minute.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

import httpx
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)
HIT_MODES = frozenset({"device_hit", "host_hit", "storage_hit"})
LOG_EVERY_S = 60.0


def hit_counts(text: str) -> tuple[float, float] | None:
    """(hit tokens, total prompt tokens) counters in one engine's metrics text; None if it has neither kind."""
    effective_hit = effective_all = cached = prompt = 0.0
    has_effective = has_cached = has_prompt = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:prefill_effective_tokens_total":
                has_effective = True
                effective_all += sample.value
                if sample.labels.get("mode") in HIT_MODES:
                    effective_hit += sample.value
            elif sample.name == "sglang:cached_tokens_total":
                has_cached = True
                cached += sample.value
            elif sample.name == "sglang:prompt_tokens_total":
                has_prompt = True
                prompt += sample.value
    if has_effective:
        return effective_hit, effective_all
    if has_cached and has_prompt:
        return cached, prompt
    return None


class EngineHitWindow:
    """Hit / total counter increases over the last `window_s` seconds, summed over engines."""

    def __init__(self, window_s: float = 60.0, min_prompt_tokens: int = 1) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.min_prompt_tokens = min_prompt_tokens
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}

    def record(self, engine: str, now: float, hit: float, total: float) -> None:
        """Add one scrape of `engine`'s counters."""
        samples = self._samples.setdefault(engine, deque())
        if samples and (hit < samples[-1][1] or total < samples[-1][2]):
            samples.clear()  # the counters went back: the engine restarted
        samples.append((now, hit, total))
        self._trim(samples, now)

    def _trim(self, samples: deque[tuple[float, float, float]], now: float) -> None:
        horizon = now - self.window_s
        while len(samples) > 1 and samples[1][0] <= horizon:
            samples.popleft()  # keep the newest sample at or before the horizon as the baseline

    def rate(self, now: float) -> float | None:
        """The windowed hit rate in [0, 1], or None with too little evidence."""
        hit = total = 0.0
        for samples in self._samples.values():
            self._trim(samples, now)
            if samples:
                hit += samples[-1][1] - samples[0][1]
                total += samples[-1][2] - samples[0][2]
        if total < max(1, self.min_prompt_tokens):
            return None
        return max(0.0, min(1.0, hit / total))


class EngineScraper:
    """Scrapes each engine's /metrics every `interval_s` into an `EngineHitWindow`."""

    def __init__(self, urls: Sequence[str], window: EngineHitWindow, now: Callable[[], float], errors: Counter, *,
                 interval_s: float = 5.0, client: httpx.AsyncClient | None = None, timeout_s: float = 5.0) -> None:
        self.urls = list(urls)
        self.window = window
        self.interval_s = interval_s
        self._now = now
        self._errors = errors
        self._client = client or httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._logged_at: dict[str, float] = {}

    async def scrape_once(self) -> None:
        """Scrape every engine once (concurrently)."""
        await asyncio.gather(*(self._scrape(url) for url in self.urls))

    async def _scrape(self, url: str) -> None:
        try:
            response = await self._client.get(url)
            response.raise_for_status()
            counts = hit_counts(response.text)
            if counts is None:
                raise ValueError("no sglang:prefill_effective_tokens_total nor sglang:cached_tokens_total"
                                 " with sglang:prompt_tokens_total")
        except (httpx.HTTPError, ValueError) as exc:
            self._failed(url, f"{type(exc).__name__}: {exc}")
            return
        self.window.record(url, self._now(), *counts)

    def _failed(self, url: str, why: str) -> None:
        self._errors.inc()
        now = self._now()
        last = self._logged_at.get(url)
        if last is None or now - last >= LOG_EVERY_S:
            self._logged_at[url] = now
            logger.warning("cannot scrape engine metrics %s: %s (logged at most once a minute)", url, why)

    async def run(self) -> None:
        """Scrape forever, every `interval_s`."""
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

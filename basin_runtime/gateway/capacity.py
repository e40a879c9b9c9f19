"""Start-up: the deployment's cache capacity, read from its engines, against the calibration's.

Rules:
- The deployment's cache capacity is the sum over its prefill engines of SGLang's `max_total_num_tokens`
  (the KV pool in tokens, a top-level field of `GET /server_info`; SGLang before 0.5 serves it at
  `/get_server_info`, and smg 1.13 forwards `/get_server_info` to one worker only).
- The prefill engines are found through the upstream: smg's `GET /workers` lists every worker's `url` and
  `worker_type` (prefill, decode, regular); an upstream without that list (one SGLang server) is itself
  the one engine.
- A calibration whose `cache_capacity_tokens` differs from the measured capacity by more than
  `TOLERANCE` (25%) of the measured capacity was made for another deployment: its budget would not fit
  these engines (the 1P3D H200 calibration in front of a 1.3M-token engine sets a budget four times the
  cache, and admission never engages). It is refused (`CapacityMismatch`, naming both numbers) unless
  the operator says otherwise (`allow_calibration_mismatch`).
- A capacity that cannot be read (upstream down, not SGLang, a field missing) is `CapacityUnknown`,
  naming the URL and why: the caller warns and starts unchecked.
- I/O goes through an `httpx.Client` the caller passes (tests pass one over `httpx.MockTransport`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from basin_runtime.policy.capacity import pooled_tokens

TOLERANCE = 0.25
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


class CapacityUnknown(Exception):
    """The engines' capacity could not be read; the message names the URL and why."""


class CapacityMismatch(ValueError):
    """The calibration's cache capacity is not this deployment's."""


@dataclass(frozen=True)
class Capacity:
    """The deployment's prefix-cache capacity: each prefill engine's KV pool, and their sum."""

    engines: tuple[tuple[str, int], ...]  # (engine base URL, max_total_num_tokens)
    found_by: str  # how the engines were found: smg's /workers, or the upstream itself

    @property
    def total_tokens(self) -> int:
        return pooled_tokens(tokens for _, tokens in self.engines)

    def describe(self) -> str:
        each = ", ".join(f"{url} {tokens:,}" for url, tokens in self.engines)
        return f"{self.total_tokens:,} tokens over {len(self.engines)} prefill engine(s) ({each}; {self.found_by})"


def _get_json(client: httpx.Client, url: str) -> Any:
    try:
        answer = client.get(url)
    except httpx.HTTPError as exc:
        raise CapacityUnknown(f"GET {url}: {exc or type(exc).__name__}") from None
    if answer.status_code != 200:
        raise CapacityUnknown(f"GET {url}: HTTP {answer.status_code}")
    try:
        return answer.json()
    except ValueError:
        raise CapacityUnknown(f"GET {url}: not JSON") from None


def prefill_engines(client: httpx.Client, upstream: str) -> tuple[list[str], str]:
    """The prefill engines' base URLs behind `upstream`, and how they were found."""
    base = upstream.rstrip("/")
    try:
        listed = _get_json(client, f"{base}/workers")
    except CapacityUnknown:
        return [base], f"{base} is the engine (no smg /workers list)"
    workers = listed.get("workers") if isinstance(listed, Mapping) else None
    if not isinstance(workers, list):
        return [base], f"{base} is the engine (no smg /workers list)"
    urls = [str(w["url"]).rstrip("/") for w in workers
            if isinstance(w, Mapping) and w.get("worker_type") == "prefill" and isinstance(w.get("url"), str)]
    if not urls:  # a regular (non-PD) router: every worker holds a cache
        urls = [str(w["url"]).rstrip("/") for w in workers if isinstance(w, Mapping) and isinstance(w.get("url"), str)]
    if not urls:
        raise CapacityUnknown(f"GET {base}/workers lists no worker")
    return urls, f"listed by {base}/workers"


def engine_tokens(client: httpx.Client, engine: str) -> int:
    """One engine's `max_total_num_tokens`, from /server_info (or the older /get_server_info)."""
    why = []
    for path in SERVER_INFO_PATHS:
        try:
            info = _get_json(client, engine + path)
        except CapacityUnknown as exc:
            why.append(str(exc))
            continue
        tokens = info.get("max_total_num_tokens") if isinstance(info, Mapping) else None
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            return tokens
        why.append(f"GET {engine}{path}: no positive max_total_num_tokens (got {tokens!r})")
    raise CapacityUnknown("; ".join(why))


def read_capacity(client: httpx.Client, upstream: str) -> Capacity:
    """The deployment's capacity behind `upstream`; `CapacityUnknown` if it cannot be read."""
    urls, found_by = prefill_engines(client, upstream)
    return Capacity(tuple((url, engine_tokens(client, url)) for url in urls), found_by)


def check_capacity(calibration_tokens: float, capacity: Capacity, source: str, allow_mismatch: bool,
                   tolerance: float = TOLERANCE) -> str:
    """A line saying how the calibration's capacity compares with the engines'; `CapacityMismatch` if it is more
    than `tolerance` off and `allow_mismatch` is false."""
    measured = capacity.total_tokens
    off = abs(calibration_tokens - measured) / measured
    line = (f"calibration {source} was measured for a cache of {calibration_tokens:,.0f} tokens; the engines hold "
            f"{capacity.describe()}: {off:.0%} apart")
    if off <= tolerance:
        return line + f" (within {tolerance:.0%})"
    if allow_mismatch:
        return line + f", beyond {tolerance:.0%}, used anyway (--allow-calibration-mismatch)"
    raise CapacityMismatch(
        f"{line}, beyond {tolerance:.0%}: the calibration was made for another deployment, and its budget would not "
        f"fit these engines. Measure one for them (`basin-sim knee --deployment FILE --out FILE` for a modelled "
        f"deployment, `basin-live-ramp` against the live engines), or pass --allow-calibration-mismatch "
        f"(allow_calibration_mismatch: true) to use it anyway")

"""Per-call usage from the upstream's answers.

The cache signals the policy and the operators read: the upstream's usage per call. The prefix
hit rate over a sliding window is `basin_runtime.policy.hit_rate.HitRateWindow` (shared with the
simulator), fed here with each call's usage.

Rules:
- A call's usage comes from the upstream's answer: OpenAI `usage` (`prompt_tokens`,
  `completion_tokens`, `prompt_tokens_details.cached_tokens`, present with SGLang's
  `--enable-cache-report`), or `/generate`'s `meta_info` (`prompt_tokens`, `completion_tokens`,
  `cached_tokens`, always present). A missing or malformed field is None, never a guess.
- Where the cached tokens came from (`cached_tiers`: device, host, storage): SGLang's
  `meta_info.cached_tokens_details` on `/generate` (present whenever something was cached), or the
  response-level `sglext.cached_tokens_details` of an OpenAI answer whose request asked for it
  (`return_cached_tokens_details`); shape `{"device": n, "host": n[, "storage": n, "storage_backend":
  name]}` (sglang 0.5.23, managers/scheduler_components/output_streamer.py). None when not reported.
- Answers are read with orjson; what it refuses is read again by the standard library's parser, which
  takes what Python's own `json.dumps` writes (NaN, Infinity) and integers past 64 bits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Usage:
    """What the upstream said one call used (None: it did not say)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    cached_tiers: Mapping[str, int] | None = None  # device / host / storage, as the engine split them


CACHE_TIERS = ("device", "host", "storage")


def parse_json(data: bytes) -> object:
    """JSON text as Python values (see the rules); `ValueError` (or `UnicodeDecodeError`) if it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def cached_tiers_of(details: object) -> dict[str, int] | None:
    """The tier split of SGLang's `cached_tokens_details` (only well-formed counts kept), or None."""
    if not isinstance(details, Mapping):
        return None
    tiers = {tier: count for tier in CACHE_TIERS if (count := _count(details.get(tier))) is not None}
    return tiers or None


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def usage_of(answer: object) -> Usage | None:
    """The usage in one parsed answer (or final stream chunk), OpenAI or `/generate` shaped; None if none."""
    if not isinstance(answer, Mapping):
        return None
    usage = answer.get("usage")
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        ext = answer.get("sglext")
        tiers = cached_tiers_of(ext.get("cached_tokens_details")) if isinstance(ext, Mapping) else None
        return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached),
                     tiers)
    meta = answer.get("meta_info")
    if isinstance(meta, Mapping):
        return Usage(_count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens")),
                     _count(meta.get("cached_tokens")), cached_tiers_of(meta.get("cached_tokens_details")))
    return None

# The cache signals the policy and the operators read: the upstream's usage per call. The prefix
# hit rate over a sliding window is `basin_runtime.policy.hit_rate.HitRateWindow` (shared with the
# simulator), fed here with each call's usage.
#
# Rules:
# - A call's usage comes from the upstream's answer: OpenAI `usage` (`prompt_tokens`,
#   `completion_tokens`, `prompt_tokens_details.cached_tokens`, present with SGLang's
#   `--enable-cache-report`), or `/generate`'s `meta_info` (`prompt_tokens`, `completion_tokens`,
#   `cached_tokens`, always present). A missing or malformed field is None, never a guess.
"""Per-call usage from the upstream's answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """What the upstream said one call used (None: it did not say)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


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
        return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), _count(cached))
    meta = answer.get("meta_info")
    if isinstance(meta, Mapping):
        return Usage(_count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens")),
                     _count(meta.get("cached_tokens")))
    return None

# The cache signals the policy and the operators read: the upstream's usage per call, and the
# prefix hit rate over a sliding window.
#
# Rules:
# - A call's usage comes from the upstream's answer: OpenAI `usage` (`prompt_tokens`,
#   `completion_tokens`, `prompt_tokens_details.cached_tokens`, present with SGLang's
#   `--enable-cache-report`), or `/generate`'s `meta_info` (`prompt_tokens`, `completion_tokens`,
#   `cached_tokens`, always present). A missing or malformed field is None, never a guess.
# - The hit rate is sum(cached tokens) / sum(prompt tokens) over the calls that ended in the last
#   `window_s` seconds of the gateway clock and reported cached tokens; None while the window holds
#   fewer than `min_prompt_tokens` prompt tokens (too little evidence to move the budget).
# - The window keeps at most `max_samples` calls (the oldest drop first): memory stays bounded.
"""Per-call usage from the upstream's answers, and the windowed prefix hit rate."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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


def usage_of_bytes(data: bytes) -> Usage | None:
    """The usage in a JSON answer body or one SSE event (`data: {...}`); None if there is none."""
    text = data.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    try:
        answer: Any = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return usage_of(answer)


class HitRateWindow:
    """Cached / prompt tokens over the calls that ended in the last `window_s` seconds."""

    def __init__(self, window_s: float = 60.0, min_prompt_tokens: int = 1, max_samples: int = 100_000) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.min_prompt_tokens = min_prompt_tokens
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=max_samples)
        self._cached_tokens = 0
        self._prompt_tokens = 0

    def record(self, now: float, prompt_tokens: int, cached_tokens: int) -> None:
        """Add one call's prompt and cached tokens (cached is clipped to the prompt)."""
        if prompt_tokens <= 0:
            return
        cached = max(0, min(cached_tokens, prompt_tokens))
        if len(self._samples) == self._samples.maxlen:
            _, old_prompt, old_cached = self._samples[0]
            self._prompt_tokens -= old_prompt
            self._cached_tokens -= old_cached
        self._samples.append((now, prompt_tokens, cached))
        self._prompt_tokens += prompt_tokens
        self._cached_tokens += cached

    def rate(self, now: float) -> float | None:
        """The windowed hit rate in [0, 1], or None with too little evidence."""
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            _, prompt, cached = self._samples.popleft()
            self._prompt_tokens -= prompt
            self._cached_tokens -= cached
        if self._prompt_tokens < max(1, self.min_prompt_tokens):
            return None
        return self._cached_tokens / self._prompt_tokens

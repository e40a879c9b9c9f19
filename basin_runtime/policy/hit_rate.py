"""`HitRateWindow`: cached / prompt tokens over the calls that ended in the last `window_s` seconds.

The prefix hit rate over a sliding window of ended calls: the one signal the budget moves by,
read the same way by the gateway (each call's usage) and the simulator (each call's answer).

Rules:
- The hit rate is sum(cached tokens) / sum(prompt tokens) over the calls that ended in the last
  `window_s` seconds of the driver's clock; None while the window holds fewer than
  `min_prompt_tokens` prompt tokens (too little evidence to move the budget).
- A call with no prompt tokens is not evidence; cached tokens are clipped to [0, prompt].
- The window keeps at most `max_samples` calls (the oldest drop first): memory stays bounded.
- Pure: time comes in as `now`; calls must be recorded in time order.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW_S = 60.0
DEFAULT_MIN_PROMPT_TOKENS = 1000


class HitRateWindow:
    """Cached / prompt tokens over the calls that ended in the last `window_s` seconds."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS,
                 max_samples: int = 100_000) -> None:
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
        cached, prompt = self.sums(now)
        if prompt < max(1, self.min_prompt_tokens):
            return None
        return cached / prompt

    def sums(self, now: float) -> tuple[int, int]:
        """(cached, prompt) tokens of the calls in the window (what replicas add up: `basin_runtime/state/`)."""
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            _, prompt, cached = self._samples.popleft()
            self._prompt_tokens -= prompt
            self._cached_tokens -= cached
        return self._cached_tokens, self._prompt_tokens

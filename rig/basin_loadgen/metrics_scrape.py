"""Parse cached/total prompt-token counters from Prometheus text; hit rate between two scrapes.

Hit rate from SGLang's Prometheus text (`/metrics`), for the live knee ramp.

Rules: cached tokens = `sglang:prefill_effective_tokens_total` with mode device_hit|host_hit|
storage_hit, over all modes; if that family is absent, `sglang:cached_tokens_total` (all sources)
over `sglang:prompt_tokens_total`. Counters are summed over every engine's sample lines. The hit
rate of a window is the ratio of counter differences between two scrapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
HIT_MODES = frozenset({"device_hit", "host_hit", "storage_hit"})


@dataclass(frozen=True)
class TokenCounters:
    """Cumulative cached and total prompt tokens at one scrape."""

    cached_tokens: float
    total_tokens: float


def parse_counters(text: str) -> TokenCounters:
    """Cached and total prompt-token counters from one `/metrics` text (raises if neither family is there)."""
    effective: dict[str, float] = {}
    cached = prompt = 0.0
    has_cached = has_prompt = False
    for raw in text.splitlines():
        match = _LINE.match(raw.strip())
        if match is None or raw.startswith("#"):
            continue
        name, value = match["name"], float(match["value"])
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if name == "sglang:prefill_effective_tokens_total":
            mode = labels.get("mode", "")
            effective[mode] = effective.get(mode, 0.0) + value
        elif name == "sglang:cached_tokens_total":
            cached, has_cached = cached + value, True
        elif name == "sglang:prompt_tokens_total":
            prompt, has_prompt = prompt + value, True
    if effective:
        return TokenCounters(sum(v for m, v in effective.items() if m in HIT_MODES), sum(effective.values()))
    if has_cached and has_prompt:
        return TokenCounters(cached, prompt)
    raise ValueError("no sglang:prefill_effective_tokens_total, nor sglang:cached_tokens_total with "
                     "sglang:prompt_tokens_total, in the /metrics text")


def window_hit_rate(before: TokenCounters, after: TokenCounters) -> float | None:
    """Hit rate between two scrapes (None: no prompt tokens in between)."""
    total = after.total_tokens - before.total_tokens
    if total <= 0:
        return None
    return (after.cached_tokens - before.cached_tokens) / total

# What a run looks like over time, recorded as it happens (no I/O; the plotting module draws it).
#
# Rules:
# - Prefill hits are binned by the time a request's hit is decided (when it enters a prefill batch):
#   per bin, prompt tokens, device-hit tokens and host-hit tokens. A window's hit rate is
#   (device + host hit tokens) / prompt tokens over the bins inside it, as SGLang's
#   `prefill_effective_tokens_total` counts it; None when nothing was prefilled.
# - TTFT is kept per call (time the first token reached decode, and its value): calls, not steps.
# - State (live and held sessions, working set, cache and queue sizes) is sampled at every engine
#   tick into parallel lists.
# Invariant: every per-bin list has the same length; every sample list has the same length.
"""The run's timeline: binned prefill hits, per-call TTFT, and periodic state samples."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Sample:
    """The engine's state at one tick."""

    time_s: float
    live_sessions: int
    held_sessions: int
    working_set_tokens: int
    cache_device_tokens: int
    cache_host_tokens: int
    cache_pinned_tokens: int
    prefill_waiting: int
    decode_queued: int
    decode_running: int
    decode_reserved_tokens: int


class Timeline:
    """Binned hits, TTFTs and state samples of one run."""

    def __init__(self, bin_s: float = 60.0) -> None:
        if not bin_s > 0:
            raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
        self.bin_s = bin_s
        self.prompt_tokens: list[int] = []
        self.device_hit_tokens: list[int] = []
        self.host_hit_tokens: list[int] = []
        self.ttft_time_s: list[float] = []
        self.ttft_s: list[float] = []
        self.samples: list[Sample] = []

    def record_prefill(self, now: float, prompt_tokens: int, device_hit_tokens: int, host_hit_tokens: int) -> None:
        """A request's cache hit was decided at `now`."""
        index = int(now // self.bin_s)
        while len(self.prompt_tokens) <= index:
            self.prompt_tokens.append(0)
            self.device_hit_tokens.append(0)
            self.host_hit_tokens.append(0)
        self.prompt_tokens[index] += prompt_tokens
        self.device_hit_tokens[index] += device_hit_tokens
        self.host_hit_tokens[index] += host_hit_tokens

    def record_ttft(self, now: float, ttft_s: float) -> None:
        """A call's first token reached decode at `now` after `ttft_s`."""
        self.ttft_time_s.append(now)
        self.ttft_s.append(ttft_s)

    def record_sample(self, sample: Sample) -> None:
        """Keep one state sample."""
        self.samples.append(sample)

    def hit_rate(self, start_s: float, end_s: float) -> float | None:
        """Hit rate over the whole bins inside [start_s, end_s); None if nothing was prefilled."""
        first = math.ceil(start_s / self.bin_s)
        last = min(int(end_s // self.bin_s), len(self.prompt_tokens))
        prompt = sum(self.prompt_tokens[first:last])
        if prompt == 0:
            return None
        return (sum(self.device_hit_tokens[first:last]) + sum(self.host_hit_tokens[first:last])) / prompt

    def bin_hit_rates(self, start_s: float, end_s: float) -> list[tuple[float, float | None]]:
        """(bin start, hit rate or None) for every whole bin inside [start_s, end_s)."""
        first, last = math.ceil(start_s / self.bin_s), int(end_s // self.bin_s)
        return [(k * self.bin_s, self.hit_rate(k * self.bin_s, (k + 1) * self.bin_s)) for k in range(first, last)]

    def first_collapse_s(self, threshold: float, start_s: float, end_s: float) -> float | None:
        """Start of the first whole bin in [start_s, end_s) whose hit rate is below `threshold`."""
        for time_s, rate in self.bin_hit_rates(start_s, end_s):
            if rate is not None and rate < threshold:
                return time_s
        return None

    def recovered_s(self, threshold: float, start_s: float, end_s: float) -> float | None:
        """When the hit rate got back to `threshold` for good: the end of the last bin below it in
        [start_s, end_s), `start_s` if none was below; None if the last bin is still below."""
        bins = self.bin_hit_rates(start_s, end_s)
        below = [t for t, rate in bins if rate is not None and rate < threshold]
        if not below:
            return start_s
        if bins and below[-1] == bins[-1][0]:
            return None
        return below[-1] + self.bin_s

    def ttfts(self, start_s: float, end_s: float) -> list[float]:
        """TTFTs of calls whose first token arrived in [start_s, end_s)."""
        lo = bisect.bisect_left(self.ttft_time_s, start_s)
        hi = bisect.bisect_left(self.ttft_time_s, end_s)
        return self.ttft_s[lo:hi]

    def series(self, name: str) -> list[float]:
        """One field of the samples as a list (e.g. 'working_set_tokens')."""
        if name not in {f.name for f in fields(Sample)}:
            raise KeyError(f"no sample field {name!r}")
        return [float(getattr(s, name)) for s in self.samples]

    def mean_sample(self, name: str, start_s: float, end_s: float) -> float | None:
        """Mean of one sample field over samples in [start_s, end_s); None if there are none."""
        values = [float(getattr(s, name)) for s in self.samples if start_s <= s.time_s < end_s]
        return sum(values) / len(values) if values else None

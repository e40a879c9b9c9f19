"""The run's timeline, recorded as it happens: binned prefill hits and counts, per-call TTFT, sampled state.

No I/O; plots.py draws it.

Rules:
- Prefill hits are binned by the time a request's hit is decided (when it enters a prefill batch):
  per bin, prompt tokens, device-hit tokens and host-hit tokens (storage hits counted with the host's:
  both are loaded to the device with the batch). A window's hit rate is (device + host hit tokens) /
  prompt tokens over the bins inside it, as SGLang's `prefill_effective_tokens_total` counts it; None
  when nothing was prefilled.
- TTFT is kept per call (time the first token reached decode, and its value): calls, not steps.
- State (live and held sessions, working set, cache and queue sizes) is sampled at every engine
  tick into parallel lists.
- Per bin, counts of what happened in it (`COUNTS`): attempts that timed out, attempts sent after a
  timeout (retries), sessions abandoned by their clients, sessions arrived at the door, sessions
  finished. Binned like the hits, in the same lists' length.
- Per bin, the state at its end (`BinState`): the engine records it once every event before the
  bin's end has been handled and none after it, so bin k's state is exact at (k + 1) x bin_s.

Invariants: every per-bin list (hits and counts) has the same length; every sample list has the
same length; bin_states[k].end_s == (k + 1) x bin_s.
"""

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
    cache_held_tokens: int  # of those, held for a TTL after an answer, between calls (Continuum's pins)
    prefill_waiting: int
    decode_queued: int
    decode_running: int
    decode_reserved_tokens: int


COUNTS = ("timeouts", "retries", "abandoned", "arrivals", "completions")


@dataclass(frozen=True)
class BinState:
    """The engine's state at the end of one bin."""

    end_s: float
    live_sessions: int  # burst sessions included
    live_burst_sessions: int
    held_sessions: int
    working_set_tokens: int
    prefill_queued: int  # requests waiting in a prefill queue (their decode memory reserved)
    prealloc_queued: int  # requests waiting for decode memory (then for prefill)


class Timeline:
    """Binned hits and counts, TTFTs, state samples and per-bin end states of one run."""

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
        self.counts: dict[str, list[int]] = {name: [] for name in COUNTS}
        self.bin_states: list[BinState] = []

    def _bin(self, now: float) -> int:
        """The index of the bin holding `now`, every per-bin list grown to hold it."""
        index = int(now // self.bin_s)
        while len(self.prompt_tokens) <= index:
            self.prompt_tokens.append(0)
            self.device_hit_tokens.append(0)
            self.host_hit_tokens.append(0)
            for values in self.counts.values():
                values.append(0)
        return index

    def record_prefill(self, now: float, prompt_tokens: int, device_hit_tokens: int, host_hit_tokens: int) -> None:
        """A request's cache hit was decided at `now`."""
        index = self._bin(now)
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

    def record_timeout(self, now: float) -> None:
        """An attempt of a call timed out at `now`."""
        self._count("timeouts", now)

    def record_retry(self, now: float) -> None:
        """An attempt after a timeout was sent at `now`."""
        self._count("retries", now)

    def record_abandoned(self, now: float) -> None:
        """A session's client gave it up at `now`."""
        self._count("abandoned", now)

    def record_arrival(self, now: float) -> None:
        """A session arrived at the door at `now`."""
        self._count("arrivals", now)

    def record_completion(self, now: float) -> None:
        """A session finished (its last answer) at `now`."""
        self._count("completions", now)

    def _count(self, name: str, now: float) -> None:
        self.counts[name][self._bin(now)] += 1

    def record_bin_state(self, state: BinState) -> None:
        """Keep the state at the end of the next bin (bins end in order, none skipped)."""
        expected_s = (len(self.bin_states) + 1) * self.bin_s
        if state.end_s != expected_s:
            raise ValueError(f"bin state for the end at {state.end_s} s, expected the end at {expected_s} s")
        self.bin_states.append(state)

    def count_series(self, name: str) -> list[int]:
        """One count per bin, from bin 0 to the last bin with a count or an end state."""
        if name not in self.counts:
            raise KeyError(f"no count {name!r}; known: {list(COUNTS)}")
        values = self.counts[name]
        return values + [0] * max(0, len(self.bin_states) - len(values))

    def bin_state_series(self, name: str) -> list[float]:
        """One field of the per-bin end states (e.g. 'live_sessions'), bin 0 first."""
        if name not in {f.name for f in fields(BinState)}:
            raise KeyError(f"no bin state field {name!r}")
        return [float(getattr(s, name)) for s in self.bin_states]

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

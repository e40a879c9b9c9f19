"""`SignalReport` and `combine`: the deployment's hit rate and first-token latency from every replica.

Rules:
- Each replica reports its own windows (`SignalReport`): the cached and prompt tokens of the calls it saw
  end in the hit-rate window, the engines' scraped hit rate when it scrapes them, and its first-token
  latencies (finished and still waiting) in the latency window, at most `MAX_LATENCIES` of them, evenly
  spaced in sorted order, with how many they stand for.
- The deployment's hit rate is the sum of cached over the sum of prompt tokens (None under
  `min_prompt_tokens`); engines scraped by any replica win (they see every replica's calls), their mean
  if several scrape. The first-token latency is the weighted median of every report's latencies
  (exact while no replica sees more than `MAX_LATENCIES` calls in the window), None with fewer than
  `min_calls` calls in all. One replica's report gives exactly what that replica alone would tick with.
- Pure: no I/O; reports travel as JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

MAX_LATENCIES = 512


@dataclass(frozen=True)
class SignalReport:
    """One replica's windows, as the leader reads them."""

    cached_tokens: int
    prompt_tokens: int
    engine_hit_rate: float | None
    latencies_s: tuple[float, ...]  # sorted, at most MAX_LATENCIES
    num_latencies: int  # how many calls they stand for

    @classmethod
    def of(cls, cached_tokens: int, prompt_tokens: int, engine_hit_rate: float | None,
           latencies_s: Sequence[float]) -> SignalReport:
        """A report from the windows' contents (latencies thinned to MAX_LATENCIES, evenly in sorted order)."""
        ordered = sorted(latencies_s)
        if len(ordered) > MAX_LATENCIES:
            step = len(ordered) / MAX_LATENCIES
            ordered = [ordered[math.floor((k + 0.5) * step)] for k in range(MAX_LATENCIES)]
        return cls(cached_tokens, prompt_tokens, engine_hit_rate, tuple(ordered), len(latencies_s))

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> SignalReport:
        """A report from `to_json`'s text; `ValueError` if it is not one."""
        data = json.loads(text)
        try:
            report = cls(int(data["cached_tokens"]), int(data["prompt_tokens"]),
                         None if data["engine_hit_rate"] is None else float(data["engine_hit_rate"]),
                         tuple(float(v) for v in data["latencies_s"]), int(data["num_latencies"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a signal report: {exc}") from None
        if len(report.latencies_s) > report.num_latencies:
            raise ValueError("a signal report holds more latencies than it stands for")
        return report


def combine(reports: Sequence[SignalReport], min_prompt_tokens: int,
            min_calls: int) -> tuple[float | None, float | None]:
    """(hit rate, first-token latency) of the deployment; either None with too little evidence."""
    engine = [r.engine_hit_rate for r in reports if r.engine_hit_rate is not None]
    prompt = sum(r.prompt_tokens for r in reports)
    if engine:
        hit_rate: float | None = sum(engine) / len(engine)
    else:
        hit_rate = None if prompt < max(1, min_prompt_tokens) else sum(r.cached_tokens for r in reports) / prompt
    return hit_rate, _weighted_median(reports, min_calls)


def _weighted_median(reports: Sequence[SignalReport], min_calls: int) -> float | None:
    total = sum(r.num_latencies for r in reports)
    if total < min_calls or total == 0:
        return None
    weighted = sorted((value, r.num_latencies / len(r.latencies_s)) for r in reports if r.latencies_s
                      for value in r.latencies_s)
    if all(len(r.latencies_s) == r.num_latencies for r in reports):  # exact: the statistics.median of the union
        values = [v for v, _ in weighted]
        middle = len(values) // 2
        return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
    half, seen = total / 2, 0.0
    for value, weight in weighted:
        seen += weight
        if seen >= half:
            return value
    return weighted[-1][0]

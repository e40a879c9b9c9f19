"""Per-call and per-session records of a replay, goodput, hit rates and the timeline.

What a replay against a live server recorded, and its summary. No I/O.

Rules:
- Times are model seconds from the start of the run (wall seconds x time scale); with a real
  engine (time scale 1) they are wall seconds. A call records when it was sent, when its response
  started (headers: a gateway holding the session answers only once admitted), its first token and
  its end, with the server's usage (prompt and cached tokens) or its error.
- Status of a session: finished (every call answered), shed (HTTP 503 carrying Retry-After or a
  `session_shed` body), aborted (a call waited longer than the client's max wait for its first
  token), error (any other failure, with its message), unfinished (still running when the run
  stopped or was cancelled). "Admission wait" = time to call 1's response headers.
- Goodput is basin_sim.goodput's: a session is good when it finished within GOODPUT_DEADLINE_FACTOR (4) x its
  unloaded time (the simulator's, same tool gaps); decode-step timing is not observed, so the step
  rule holds trivially. Goodput of a window = good sessions among those that ARRIVED in it, per
  model hour of window.
- Hit rate of a window = sum cached / sum prompt tokens of the calls that ENDED in it (calls without
  usage are left out). TTFT percentiles are over calls whose first token came in the window.
- The timeline has one row per `bin_s` from 0 to the last event: hit rate, calls ended per second,
  TTFT p50, sessions arrived, and the mean of the client's state samples (live sessions, sessions
  waiting for their first call's response, calls in flight, working set tokens).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from basin_sim.goodput import SessionOutcome, goodput, is_good

STATUSES = ("finished", "shed", "aborted", "error", "unfinished")


@dataclass
class CallRecord:
    """One call of a replayed session (model seconds from the run's start)."""

    index: int
    sent_s: float
    target_prompt_tokens: int
    built_prompt_tokens: int
    max_tokens: int
    response_s: float | None = None  # response headers arrived
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int | None = None  # from the server's usage
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time from sending to the first token."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s


@dataclass
class SessionRecord:
    """One replayed session."""

    run_id: str
    pool_session_id: str
    benchmark: str
    arrival_s: float
    n_calls: int
    unloaded_s: float | None = None
    status: str = "unfinished"
    end_s: float | None = None
    reason: str | None = None  # why it was shed, aborted or failed
    retry_after_s: float | None = None  # a shed session's Retry-After
    context_tokens: int = 0  # the prompt of its latest call, as built
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def is_over(self) -> bool:
        """True once the session has a final status."""
        return self.status != "unfinished"

    @property
    def admission_wait_s(self) -> float | None:
        """Time from arrival to call 1's response headers (None if they never came)."""
        if not self.calls or self.calls[0].response_s is None:
            return None
        return self.calls[0].response_s - self.arrival_s

    def outcome(self) -> SessionOutcome:
        """The session in basin_sim.goodput's terms."""
        return SessionOutcome(self.run_id, self.arrival_s, self.end_s, self.status, self.unloaded_s, 0.0, 0.0)


@dataclass(frozen=True)
class StateSample:
    """The client's view at one moment: sessions arrived and not over, and what they hold."""

    time_s: float
    live_sessions: int
    waiting_sessions: int  # call 1 sent, no response yet (held at a gateway, or queued)
    calls_in_flight: int
    working_set_tokens: int  # sum of live sessions' latest prompts


@dataclass(frozen=True)
class Window:
    """A named span of model time."""

    name: str
    start_s: float
    end_s: float


def windows_for(duration_s: float, surge: tuple[float, float, float] | None) -> list[Window]:
    """pre / surge / post around a surge (start_s, end_s, factor); one window `all` without."""
    if surge is None:
        return [Window("all", 0.0, duration_s)]
    start, end, _ = surge
    return [Window("pre", 0.0, start), Window("surge", start, end), Window("post", end, duration_s)]


def percentile(values: Sequence[float], q: int) -> float | None:
    """The q-th percentile (inclusive method); None for no values."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def hit_rate(calls: Iterable[CallRecord], start_s: float, end_s: float) -> float | None:
    """Token-weighted cached / prompt tokens of calls that ended in [start_s, end_s)."""
    cached = prompt = 0
    for c in calls:
        if c.end_s is not None and start_s <= c.end_s < end_s and c.prompt_tokens:
            prompt += c.prompt_tokens
            cached += c.cached_tokens or 0
    return cached / prompt if prompt else None


def _ttfts(calls: Iterable[CallRecord], start_s: float, end_s: float) -> list[float]:
    return [c.first_token_s - c.sent_s for c in calls
            if c.first_token_s is not None and start_s <= c.first_token_s < end_s]


def _window_summary(records: Sequence[SessionRecord], calls: Sequence[CallRecord], w: Window) -> dict[str, Any]:
    arrived = [r for r in records if w.start_s <= r.arrival_s < w.end_s]
    judged = [r.outcome() for r in arrived if r.unloaded_s is not None]
    result = goodput(judged, w.start_s, w.end_s) if judged and w.end_s > w.start_s else None
    ttfts = _ttfts(calls, w.start_s, w.end_s)
    return {"start_s": w.start_s, "end_s": w.end_s, "sessions_arrived": len(arrived),
            "sessions_good": None if result is None else result.good,
            "goodput_per_hour": None if result is None else result.per_hour,
            "hit_rate": hit_rate(calls, w.start_s, w.end_s),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90)}


def summarize(records: Sequence[SessionRecord], samples: Sequence[StateSample], windows: Sequence[Window],
              *, time_scale: float, bin_s: float = 60.0) -> dict[str, Any]:
    """The run's summary: per window goodput, hit rate and TTFT; overall percentiles; counts; timeline.
    The headline goodput is the `post` window's when there is one (as the simulator's), else the last window's."""
    calls = [c for r in records for c in r.calls]
    statuses = [r.status for r in records]
    waits = [w for r in records if (w := r.admission_wait_s) is not None]
    ttfts = [t for c in calls if (t := c.ttft_s) is not None]
    totals = [r.end_s - r.arrival_s for r in records if r.status == "finished" and r.end_s is not None]
    judged = [r for r in records if r.unloaded_s is not None]
    reasons: dict[str, int] = {}
    for r in records:
        if r.status in ("shed", "aborted", "error") and r.reason:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    by_window = {w.name: _window_summary(records, calls, w) for w in windows}
    headline = "post" if "post" in by_window else (windows[-1].name if windows else None)
    return {
        "time_scale": time_scale,
        "goodput_window": headline,
        "goodput_per_hour": None if headline is None else by_window[headline]["goodput_per_hour"],
        "sessions": len(records), "calls_sent": len(calls),
        "calls_answered": sum(c.end_s is not None and c.error is None for c in calls),
        "prompt_tokens": sum(c.prompt_tokens or 0 for c in calls),
        "cached_tokens": sum(c.cached_tokens or 0 for c in calls if c.prompt_tokens),
        "status_counts": {s: statuses.count(s) for s in STATUSES},
        "failure_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:20]),
        "sessions_good": sum(is_good(r.outcome()) for r in judged) if judged else None,
        "windows": by_window,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "admission_wait_p50_s": percentile(waits, 50), "admission_wait_p90_s": percentile(waits, 90),
        "admission_wait_p50_wall_s": _wall(percentile(waits, 50), time_scale),
        "admission_wait_p90_wall_s": _wall(percentile(waits, 90), time_scale),
        "session_time_p50_s": percentile(totals, 50),
        "prompt_tokens_built_over_target": _built_ratio(calls),
        "timeline": timeline(records, samples, bin_s),
    }


def _wall(model_s: float | None, time_scale: float) -> float | None:
    return None if model_s is None else model_s / time_scale


def _built_ratio(calls: Sequence[CallRecord]) -> float | None:
    target = sum(c.target_prompt_tokens for c in calls)
    return sum(c.built_prompt_tokens for c in calls) / target if target else None


def timeline(records: Sequence[SessionRecord], samples: Sequence[StateSample], bin_s: float) -> list[dict[str, Any]]:
    """One row per bin of `bin_s` model seconds, suitable for plotting."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    calls = [c for r in records for c in r.calls]
    times = [t for t in [*(c.end_s for c in calls), *(s.time_s for s in samples), *(r.arrival_s for r in records)]
             if t is not None]
    n = math.floor(max(times, default=-1.0) / bin_s) + 1
    prompt, cached, answered, arrived = [0] * n, [0] * n, [0] * n, [0] * n
    ttfts: list[list[float]] = [[] for _ in range(n)]
    state: list[list[StateSample]] = [[] for _ in range(n)]
    for c in calls:
        if c.end_s is not None and c.error is None:
            k = int(c.end_s // bin_s)
            answered[k] += 1
            prompt[k] += c.prompt_tokens or 0
            cached[k] += (c.cached_tokens or 0) if c.prompt_tokens else 0
        if c.first_token_s is not None:
            ttfts[min(n - 1, int(c.first_token_s // bin_s))].append(c.first_token_s - c.sent_s)
    for r in records:
        arrived[int(r.arrival_s // bin_s)] += 1
    for sample in samples:
        state[int(sample.time_s // bin_s)].append(sample)
    rows: list[dict[str, Any]] = []
    for k in range(n):
        row: dict[str, Any] = {"start_s": k * bin_s, "hit_rate": cached[k] / prompt[k] if prompt[k] else None,
                               "calls_per_s": answered[k] / bin_s, "ttft_p50_s": percentile(ttfts[k], 50),
                               "sessions_arrived": arrived[k]}
        for name in ("live_sessions", "waiting_sessions", "calls_in_flight", "working_set_tokens"):
            row[name] = statistics.fmean(getattr(s, name) for s in state[k]) if state[k] else None
        rows.append(row)
    return rows


def records_json(records: Sequence[SessionRecord]) -> list[dict[str, Any]]:
    """The records as plain JSON types."""
    return [asdict(r) for r in records]

"""`Telemetry`: what the gateway measures of its calls and sessions, and where it reports them.

Rules:
- One object holds the gateway's measuring instruments: the Prometheus metrics, the windowed prefix hit
  rate and first-token latency (the signals the policy is ticked with), the engines' /metrics scraper
  when configured, the lending reports and the session log. It is built before the waiting room, which
  takes it as its signals and its listener (`waiting.RoomSignals`, `waiting.RoomListener`), and before a
  shared backend and its coordinator, which take its `state_hooks()` and `signal_report`.
- The hit rate is the engines' (scraped) when they have evidence, else the upstream's reported usage; the
  first-token latency is measured on the clock, from a call's forwarding to its answer's first bytes, and
  counts the calls still waiting for theirs (since they were forwarded).
- Replicas (`--state`): the room ticks with the deployment's signals, the leader's combination of every
  replica's report (`DeploymentSignals`); this replica's own go into its report.
- A session that leaves reaches the metrics, the lending reports and (if it made calls) the session log,
  as one line (`log_record`); a session adopted after a run that was killed is logged whole. With the memory
  of finished tasks on (`task_memory.py`), it reaches that memory too, at the clock's now.
- With `engine_session_cache` (`engine_sessions.py`) a session that leaves is closed on every engine under
  its routing key, but one that `moved` (it lives on in another replica, under the same key) and one the
  engines never saw (no call forwarded in this run, and not adopted from the last one).
- Assumption: a session ended by a shutdown is closed too, though a restart may adopt it; its next call
  after the restart reopens the tag (SGLang's `open_radix_session`), so only the references between the two
  runs are lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from basin_runtime.clock import Clock
from basin_runtime.gateway.engine_metrics import EngineScraper
from basin_runtime.gateway.engine_sessions import EngineSessions
from basin_runtime.gateway.lending import LendingTracker
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.gateway.sessions import CallRecord, SessionEntry
from basin_runtime.gateway.task_memory import GatewayTaskMemory
from basin_runtime.gateway.waiting import EndReason
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.session_log import LoggedCall, SessionLogRecord
from basin_runtime.state.backend import StateHooks
from basin_runtime.state.signals import SignalReport

if TYPE_CHECKING:
    from basin_runtime.state.leases import Coordinator  # redis: imported only with `--state`


class Telemetry:
    """The gateway's metrics, signals, lending reports and session log (see the rules)."""

    def __init__(self, clock: Clock, metrics: GatewayMetrics, *, tokenizer_name: str,
                 hit_window: HitRateWindow | None = None, lending: LendingTracker | None = None,
                 session_log: SessionLogWriter | None = None, engine_scraper: EngineScraper | None = None,
                 engine_sessions: EngineSessions | None = None,
                 task_memory: GatewayTaskMemory | None = None) -> None:
        self.clock = clock
        self.metrics = metrics
        self.tokenizer_name = tokenizer_name
        self.hit_window = hit_window or HitRateWindow()
        self.latency_window = LatencyWindow()
        self.lending = lending or LendingTracker()
        self.session_log = session_log
        self.engine_scraper = engine_scraper
        self.task_memory = task_memory
        self.engine_sessions = engine_sessions
        self._awaiting_first_byte: dict[int, float] = {}  # id of a call in flight -> clock.now() when forwarded

    # --- the signals ----------------------------------------------------------------------------

    def hit_rate(self) -> float | None:
        """The windowed prefix hit rate now (None: too little evidence).

        From the engines' /metrics counters when they are scraped and have evidence, else from the
        upstream's reported usage.
        """
        now = self.clock.now()
        if self.engine_scraper is not None:
            rate = self.engine_scraper.window.rate(now)
            if rate is not None:
                return rate
        return self.hit_window.rate(now)

    def ttft_s(self) -> float | None:
        """The engines' windowed median time to first token (calls still waiting for theirs counted; None: too
        few calls), as this gateway saw its forwarded calls' answers begin."""
        now = self.clock.now()
        return self.latency_window.median_s(now, self._waits_s(now))

    def signal_report(self) -> SignalReport:
        """This replica's windows, for the leader to combine into the deployment's signals."""
        now = self.clock.now()
        cached, prompt = self.hit_window.sums(now)
        engine = None if self.engine_scraper is None else self.engine_scraper.window.rate(now)
        return SignalReport.of(cached, prompt, engine, self.latency_window.values(now, self._waits_s(now)))

    def _waits_s(self, now: float) -> list[float]:
        """How long each call still waiting for its first byte has waited."""
        return [now - sent for sent in self._awaiting_first_byte.values()]

    def state_hooks(self) -> StateHooks:
        """What a shared backend tells the metrics (up/down, errors, step latency, dropped steps, apply lag)."""
        m = self.metrics
        return StateHooks(on_up=lambda is_up: m.state_up.set(1 if is_up else 0),
                          on_error=lambda kind: m.state_errors.labels(kind).inc(),
                          on_step_latency=m.state_step_seconds.observe, on_dropped=m.state_dropped.inc,
                          on_apply_lag=m.state_apply_lag.observe)

    # --- calls ----------------------------------------------------------------------------------

    def call_forwarded(self, record: CallRecord) -> None:
        """A call went upstream: it waits for its first byte from now."""
        self._awaiting_first_byte[id(record)] = self.clock.now()

    def first_byte(self, record: CallRecord) -> None:
        """A call's answer began: its first-token latency is the time since it was forwarded."""
        sent = self._awaiting_first_byte.pop(id(record), None)
        if sent is not None:
            now = self.clock.now()
            self.latency_window.record(now, max(0.0, now - sent))

    def call_done(self, record: CallRecord) -> None:
        """A call's answer ended (it waits for nothing more)."""
        self._awaiting_first_byte.pop(id(record), None)

    # --- the room's listener --------------------------------------------------------------------

    def session_admitted(self, entry: SessionEntry, waited_s: float) -> None:
        """A session was admitted here after `waited_s` in the queue."""
        self.metrics.session_admitted(waited_s)

    def session_held(self, entry: SessionEntry) -> None:
        """Recovery holds a session at its tool boundary: counted."""
        self.metrics.recovery_holds.inc()

    def session_resumed(self, entry: SessionEntry, held_s: float) -> None:
        """Recovery resumed a held session: its hold time observed."""
        self.metrics.recovery_hold_time.observe(max(0.0, held_s))

    def session_ended(self, entry: SessionEntry, reason: EndReason) -> None:
        """A session left: counted, its lending forgotten, closed on the engines (`engine_session_cache`), logged if
        it made calls."""
        self.metrics.session_ended(entry, reason)
        self.lending.session_ended(entry.session_id)
        if self.engine_sessions is not None and reason != "moved" and (entry.calls or entry.is_adopted):
            self.engine_sessions.close(entry.routing_key)
        if self.task_memory is not None:
            self.task_memory.session_ended(entry, reason, self.clock.wall())
        if self.session_log is not None and entry.calls:
            self.session_log.append(log_record(entry, reason, self.clock.wall(), self.tokenizer_name))


class DeploymentSignals:
    """Replicas: the deployment's signals, as the leader last combined them (`Coordinator`)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def hit_rate(self) -> float | None:
        """The deployment's prefix hit rate."""
        return self._coordinator.hit_rate

    def ttft_s(self) -> float | None:
        """The deployment's median time to first token."""
        return self._coordinator.ttft_s


def log_record(entry: SessionEntry, reason: EndReason, ended_at: float, tokenizer: str) -> SessionLogRecord:
    """The session-log line of a finished session (unknown completion tokens are written as 0). A session adopted
    after a run that was killed is logged whole: the previous run's part, the calls only its conversation shows,
    then this run's (`restart.py`)."""
    calls = logged_calls(entry)
    earlier = entry.earlier
    if earlier is not None:
        calls = earlier.calls + entry.unrecorded_calls + calls
    return SessionLogRecord(
        session_id=entry.session_id, model=entry.model or "unknown", tokenizer=tokenizer, task_text=entry.task_text,
        task_chars=len(entry.task_text), started_at=entry.started_at if earlier is None else earlier.started_at,
        ended_at=ended_at, end_reason=reason, calls=calls, workload=entry.workload,
        predicted_peak_tokens=entry.predicted_peak_tokens if earlier is None else earlier.predicted_peak_tokens,
        reserved_peak_tokens=entry.reserved_peak_tokens, adopted=entry.is_adopted and earlier is None,
    )


def logged_calls(entry: SessionEntry) -> tuple[LoggedCall, ...]:
    """A session's calls in this run, as the session log writes them."""
    return tuple(LoggedCall(c.started_at, c.ended_at, c.prompt_tokens, c.completion_tokens or 0, c.cached_tokens,
                            c.outcome) for c in entry.calls)

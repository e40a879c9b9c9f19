"""The gateway's memory of finished tasks: a session's first-call prediction shrunk toward its task's finished peaks.

Rules:
- On (`--task-memory FILE`, the pipeline's k: `basin_runtime.task_memory.load_shrinkage`), at a new session's
  first call (not an adopted one: it ran before and keeps its earlier prediction; not a single call), the
  prediction is replaced by `Shrinkage.peak` of it and the task's remembered peaks; the policy, the
  session log and the prediction-error metrics see that peak. Off: nothing changes.
- A session enters the memory when it leaves, on the rule the prediction-error metrics judge by
  (`metrics.JUDGED_REASONS`: it ran to its end, `ended` or `idle`; made a call; was not adopted, whose record
  starts mid-way): its peak is the largest prompt of any call, its task the fingerprint of its task text
  (`basin_runtime.task_fingerprint`), its time the gateway clock's wall time at its end, the clock a first
  call reads, so only sessions that ended before an arrival count (wall time: replicas share it). A gateway
  session id never repeats, so no trajectory is excluded.
- Where the peaks live (`TaskPeaks`): in process (`LocalTaskPeaks`, a `TaskMemory`: the newest 32 peaks of each
  of at most 10,000 tasks), or, with `--state`, in the shared Redis (`basin_runtime.state.task_peaks`, the same
  bounds), so every replica's finished sessions reach every replica. A store that cannot answer gives no
  peaks (the prediction alone is told) and counts `basin_task_memory_errors`; it never holds a call.
- Metrics: `basin_task_memory_sessions` (new sessions told a peak), `basin_task_memory_hits` (those whose task
  had remembered peaks), `basin_task_memory_recorded` (sessions remembered), `basin_task_memory_errors`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from basin_runtime.gateway.metrics import JUDGED_REASONS
from basin_runtime.gateway.sessions import SessionEntry
from basin_runtime.task_fingerprint import task_fingerprint
from basin_runtime.task_memory import Shrinkage, TaskMemory


class TaskPeaks(Protocol):
    """Where the memory's finished peaks are kept."""

    async def peaks(self, fingerprint: str | None, now: float) -> list[float] | None:
        """The task's remembered peaks that ended before `now` (wall seconds); None if the store cannot answer."""
        ...

    def record(self, fingerprint: str, session_id: str, peak_tokens: float, ended_s: float,
               on_error: Callable[[], None]) -> None:
        """Remember a finished session (at once in process; sent without waiting to a shared store, `on_error`
        called if that fails)."""
        ...

    async def aclose(self) -> None:
        """Finish what is being sent and let go of the store."""
        ...


class LocalTaskPeaks:
    """The peaks in this process (`TaskMemory`)."""

    def __init__(self, memory: TaskMemory | None = None) -> None:
        self.memory = memory if memory is not None else TaskMemory()

    async def peaks(self, fingerprint: str | None, now: float) -> list[float] | None:
        """The task's peaks that ended before `now`."""
        return self.memory.peaks(fingerprint, now)

    def record(self, fingerprint: str, session_id: str, peak_tokens: float, ended_s: float,
               on_error: Callable[[], None]) -> None:
        """Remember at once."""
        self.memory.record(fingerprint, session_id, peak_tokens, ended_s)

    async def aclose(self) -> None:
        """Nothing to let go of."""


class GatewayTaskMemory:
    """Finished peaks by task, told to new sessions at their first call (see the rules)."""

    def __init__(self, shrinkage: Shrinkage, registry: CollectorRegistry, store: TaskPeaks | None = None) -> None:
        self.shrinkage = shrinkage
        self.store: TaskPeaks = store if store is not None else LocalTaskPeaks()
        self.sessions = Counter("basin_task_memory_sessions", "New sessions told a peak by the task memory",
                                registry=registry)
        self.hits = Counter("basin_task_memory_hits", "New sessions whose task had remembered peaks",
                            registry=registry)
        self.recorded = Counter("basin_task_memory_recorded", "Finished sessions remembered by task",
                                registry=registry)
        self.errors = Counter("basin_task_memory_errors", "Task-memory store failures (the prediction alone told)",
                              registry=registry)

    async def told_peak(self, task_text: str, predicted_tokens: float, now: float) -> float:
        """A new session's peak: its prediction shrunk toward its task's peaks that ended before `now` (wall)."""
        peaks = await self.store.peaks(task_fingerprint(task_text), now)
        if peaks is None:
            self.errors.inc()
            peaks = []
        self.sessions.inc()
        if peaks:
            self.hits.inc()
        return self.shrinkage.peak(predicted_tokens, peaks)

    def session_ended(self, entry: SessionEntry, reason: str, now: float) -> None:
        """Remember a session that ran to its end (see the rules); `now` in wall seconds."""
        if reason not in JUDGED_REASONS or entry.is_adopted or entry.is_single_call or not entry.calls:
            return
        fingerprint = task_fingerprint(entry.task_text)
        peak = max(c.prompt_tokens for c in entry.calls)
        if fingerprint is None or peak < 1:
            return
        self.store.record(fingerprint, entry.session_id, float(peak), now, self.errors.inc)
        self.recorded.inc()

    async def aclose(self) -> None:
        """Let go of the store (what is being sent is sent first)."""
        await self.store.aclose()

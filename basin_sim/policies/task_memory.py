"""Basin's memory of finished tasks in the simulator: built from the run's own completions.

Rules:
- At a session's arrival, Basin is told `basin_runtime.task_memory.shrunk_peak` of its predicted peak
  and the memory's peaks of its task (fingerprint of its task text, `basin_runtime.task_fingerprint`),
  with the pipeline's k (`load_shrinkage`); reservation and priority follow that peak, the reservation
  multiplier m(q) stays the model's.
- Only sessions that ended before the arrival count (the memory's own rule), and never the same
  trajectory: the pool draws sessions with replacement, so a replayed pool session (its
  `Session.session_id`, the trajectory) is excluded from its own memory, every replay of it included.
- A session enters the memory at its end, with the largest prompt seen (the peak the gateway would have
  seen), once its last call has been seen: every prompt observed, so its peak is known. A session ended
  before its last call (killed, aborted, abandoned, withdrawn while held) does not enter; a shed never
  ends here (the engine does not report it). A retried call is not counted twice (the call index is the
  first call at or after the last one seen with this prompt size, as Basin's revisions find it).
- Report: sessions told a peak, and those whose task had remembered peaks (hits).
- No I/O; time only from `now`.
"""

from __future__ import annotations

from dataclasses import dataclass

from basin_runtime.session_table import Session
from basin_runtime.task_fingerprint import task_fingerprint
from basin_runtime.task_memory import Shrinkage, TaskMemory
from basin_sim.policies.base import TaskMemoryReport


@dataclass
class _Live:
    fingerprint: str | None
    trajectory_id: str
    prompts: tuple[int, ...]
    last_index: int = -1
    peak_seen_tokens: int = 0


class RunTaskMemory:
    """The run's memory of finished tasks and the sessions it follows to their end (see the rules)."""

    def __init__(self, shrinkage: Shrinkage, memory: TaskMemory | None = None) -> None:
        self.shrinkage = shrinkage
        self.memory = memory if memory is not None else TaskMemory()
        self.sessions = 0
        self.hits = 0
        self._fingerprints: dict[str, str | None] = {}  # pool session id -> fingerprint (hashed once)
        self._live: dict[str, _Live] = {}

    def told_peak(self, session_id: str, now: float, session: Session, predicted_tokens: float) -> float:
        """The peak Basin is told at the arrival of run session `session_id` replaying pool `session`."""
        trajectory = session.session_id
        if trajectory not in self._fingerprints:
            self._fingerprints[trajectory] = task_fingerprint(session.task_text)
        fingerprint = self._fingerprints[trajectory]
        self._live[session_id] = _Live(fingerprint, trajectory, tuple(c.prompt_tokens for c in session.calls))
        peaks = self.memory.peaks(fingerprint, now, exclude=trajectory)
        self.sessions += 1
        self.hits += bool(peaks)
        return self.shrinkage.peak(predicted_tokens, peaks)

    def on_call(self, session_id: str, prompt_tokens: int) -> None:
        """A call's prompt of a followed session reached the door."""
        live = self._live.get(session_id)
        if live is None:
            return
        index = next((j for j in range(max(live.last_index, 0), len(live.prompts))
                      if live.prompts[j] == prompt_tokens), None)
        if index is not None:
            live.last_index = index
        live.peak_seen_tokens = max(live.peak_seen_tokens, prompt_tokens)

    def on_end(self, session_id: str, now: float) -> None:
        """A followed session ended: it enters the memory if its last call was seen."""
        live = self._live.pop(session_id, None)
        if live is None or live.fingerprint is None or live.last_index != len(live.prompts) - 1:
            return
        self.memory.record(live.fingerprint, live.trajectory_id, float(live.peak_seen_tokens), now)

    def report(self) -> TaskMemoryReport:
        """Sessions told a peak and memory hits."""
        return TaskMemoryReport(self.sessions, self.hits)

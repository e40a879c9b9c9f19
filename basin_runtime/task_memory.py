"""A memory of finished tasks: the peaks of ended sessions by task fingerprint, and how they shrink a prediction.

Rules:
- The combination (`shrunk_peak`), in log space: log p' = (1 - w) log p + w mean(log peaks), with
  w = n / (n + k) for the n remembered peaks of the task; no peaks (or k None: the memory is off)
  leave the prediction as it is. k is fitted out of fold by task in the pipeline
  (`basin_pipeline.task_memory`, written to TASK_MEMORY_FILE) and read here by `load_shrinkage`; one
  function serves the pipeline's fit, the simulator and the gateway.
- `TaskMemory.record` keeps, per fingerprint, the newest MAX_PEAKS_PER_TASK finished peaks with the
  trajectory they came from and when they ended; at most MAX_TASKS fingerprints, the least recently
  recorded dropped first. Assumption (the bounds): the mean of 32 log peaks has a standard error of
  0.18 of their spread, so older peaks add little while a task's sessions may drift; 10,000 tasks x 32
  entries is a few tens of MB at most in a gateway.
- `TaskMemory.peaks` counts only sessions that ended strictly before `now` (an arrival never learns
  from a session ending at or after it), and never an entry of the trajectory `exclude` (a replayed
  trajectory must not find its own peak: the simulator draws sessions with replacement).
- Peaks are positive token counts; a record that is not finite and >= 1 raises and changes nothing.
- No I/O except `load_shrinkage`, which reads the pipeline's JSON file.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_PEAKS_PER_TASK = 32
MAX_TASKS = 10_000
TASK_MEMORY_FILE = Path("metrics/task_memory.json")
FORMAT = "basin-task-memory"
VERSION = 1


class TaskMemoryError(ValueError):
    """A bad record, or a shrinkage file that is missing or does not follow the format (the message names it)."""


def shrinkage_weight(n: int, k: float | None) -> float:
    """w = n / (n + k): the memory's weight for n remembered peaks (0 with none, or with k None)."""
    if n <= 0 or k is None:
        return 0.0
    if k < 0 or not math.isfinite(k):
        raise TaskMemoryError(f"shrinkage k must be finite and >= 0, got {k!r}")
    return n / (n + k)


def shrunk_peak(predicted_tokens: float, peaks: Sequence[float], k: float | None) -> float:
    """The prediction shrunk toward the task's remembered peaks, in log space (see the rules)."""
    w = shrinkage_weight(len(peaks), k)
    if w == 0.0:
        return predicted_tokens
    mean_log = sum(math.log(p) for p in peaks) / len(peaks)
    return math.exp((1.0 - w) * math.log(predicted_tokens) + w * mean_log)


@dataclass(frozen=True)
class Shrinkage:
    """The memory switched on, with the pipeline's k (None: the fit found the memory does not help, w = 0)."""

    k: float | None

    def peak(self, predicted_tokens: float, peaks: Sequence[float]) -> float:
        """`shrunk_peak` with this k."""
        return shrunk_peak(predicted_tokens, peaks, self.k)


@dataclass(frozen=True)
class Finished:
    """One finished session of a task: its trajectory, its peak context and when it ended."""

    trajectory_id: str
    peak_tokens: float
    ended_s: float


class TaskMemory:
    """Finished peaks by task fingerprint, bounded (see the rules)."""

    def __init__(self, max_peaks_per_task: int = MAX_PEAKS_PER_TASK, max_tasks: int = MAX_TASKS) -> None:
        if max_peaks_per_task < 1 or max_tasks < 1:
            raise TaskMemoryError(f"bounds must be >= 1, got {max_peaks_per_task} peaks, {max_tasks} tasks")
        self.max_peaks_per_task = max_peaks_per_task
        self.max_tasks = max_tasks
        self._tasks: OrderedDict[str, deque[Finished]] = OrderedDict()

    def record(self, fingerprint: str, trajectory_id: str, peak_tokens: float, ended_s: float) -> None:
        """Remember a finished session of task `fingerprint`."""
        if not (math.isfinite(peak_tokens) and peak_tokens >= 1) or not math.isfinite(ended_s):
            raise TaskMemoryError(f"task {fingerprint}: session {trajectory_id!r} has peak {peak_tokens!r} "
                                  f"ended at {ended_s!r}; a peak must be finite and >= 1 token")
        entries = self._tasks.pop(fingerprint, None)
        if entries is None:
            entries = deque(maxlen=self.max_peaks_per_task)
        entries.append(Finished(trajectory_id, float(peak_tokens), float(ended_s)))
        self._tasks[fingerprint] = entries
        while len(self._tasks) > self.max_tasks:
            self._tasks.popitem(last=False)

    def peaks(self, fingerprint: str | None, now: float, exclude: str | None = None) -> list[float]:
        """The remembered peaks of the task that ended before `now`, none from trajectory `exclude`."""
        if fingerprint is None:
            return []
        return [e.peak_tokens for e in self._tasks.get(fingerprint, ())
                if e.ended_s < now and e.trajectory_id != exclude]

    def __len__(self) -> int:
        """Fingerprints remembered."""
        return len(self._tasks)


def load_shrinkage(path: Path = TASK_MEMORY_FILE) -> Shrinkage:
    """The fitted k of the pipeline's task-memory file (k None: the fit found the memory does not help)."""
    if not path.is_file():
        raise TaskMemoryError(f"no task-memory file at {path}: build it with `make repro` (stage task_memory)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TaskMemoryError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise TaskMemoryError(f"{path}: not a {FORMAT} v{VERSION} file")
    k = data.get("k")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int | float) or not math.isfinite(k) or k < 0):
        raise TaskMemoryError(f"{path}: key 'k' is {k!r}; expected a finite number >= 0 or null")
    return Shrinkage(None if k is None else float(k))

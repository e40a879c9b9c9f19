"""Jobs, their failures and the loop that drives them on any executor backend (the rules in executors.py).

Shared by the local executor (executors.py) and the Ray executor (ray_executor.py), so neither imports the other
at module level and Ray stays out of a local sweep.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from tqdm import tqdm

log = logging.getLogger(__name__)

ATTEMPTS = 2  # a failed job is run once more, then reported
POLL_S = 0.5  # how long one wait for finished jobs blocks (Ctrl-C is seen between waits at the latest)
EXIT_UNAVAILABLE = 2  # no executor: Ray not installed, or no cluster at the address
EXIT_JOB_FAILED = 1
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by SIGINT

R = TypeVar("R")
H = TypeVar("H")


@dataclass(frozen=True)
class Job(Generic[R]):
    """One run of a sweep: `fn(shared, *args)`, reported as `name` (scenario/deployment/policy/seed...)."""

    name: str
    fn: Callable[..., R]
    args: tuple[Any, ...] = ()


class ExecutorError(RuntimeError):
    """A sweep could not run or stopped before all its jobs finished; the message says which job or executor,
    and why."""


class JobFailed(ExecutorError):
    """A job failed ATTEMPTS times; the outstanding jobs were cancelled."""

    def __init__(self, name: str, attempts: int, error: str) -> None:
        super().__init__(f"run {name} failed {attempts} times (retried once), last error: {error}")
        self.name = name
        self.attempts = attempts
        self.error = error


class Interrupted(ExecutorError):
    """KeyboardInterrupt while jobs were outstanding; they were cancelled."""

    def __init__(self, cancelled: int) -> None:
        super().__init__(f"interrupted: {cancelled} outstanding runs cancelled")
        self.cancelled = cancelled


def exit_status(error: ExecutorError) -> int:
    """The exit status a CLI gives for `error`: EXIT_JOB_FAILED, EXIT_INTERRUPTED or EXIT_UNAVAILABLE."""
    if isinstance(error, JobFailed):
        return EXIT_JOB_FAILED
    return EXIT_INTERRUPTED if isinstance(error, Interrupted) else EXIT_UNAVAILABLE


class Executor(Protocol):
    """Runs batches of jobs against one shared input."""

    def run(self, jobs: Sequence[Job[R]], label: str) -> list[R]:
        """Every job's result, in the jobs' order (progress as `label`); raises `ExecutorError`."""
        ...


class Backend(Protocol[H]):
    """How one executor submits, waits for, reads and cancels jobs (handles: futures, Ray object refs)."""

    def submit(self, job: Job[Any]) -> H: ...

    def wait(self, handles: Sequence[H], timeout_s: float) -> list[H]:
        """The handles of `handles` that have finished (at least one unless `timeout_s` passed)."""
        ...

    def result(self, handle: H) -> Any:
        """The job's result; raises its error."""
        ...

    def cancel(self, handles: Sequence[H]) -> None: ...

    def explain(self, error: BaseException) -> str:
        """The job's error in one line (`Type: message`)."""
        ...


def drive(backend: Backend[H], jobs: Sequence[Job[R]], label: str, show_progress: bool = True) -> list[R]:
    """Run `jobs` on `backend` (the rules above): results in order, one retry, cancel on failure or Ctrl-C."""
    if not jobs:
        return []
    results: dict[int, R] = {}
    running: dict[H, tuple[int, int]] = {}  # handle -> (job index, attempt)
    try:
        with tqdm(total=len(jobs), desc=label, unit="run", file=sys.stderr, disable=not show_progress) as bar:
            for k, job in enumerate(jobs):
                running[backend.submit(job)] = (k, 1)
            while running:
                for handle in backend.wait(list(running), POLL_S):
                    k, attempt = running.pop(handle)
                    try:
                        results[k] = backend.result(handle)
                    except Exception as exc:  # any failure of the job: retried once, then reported
                        _retry_or_fail(backend, jobs[k], k, attempt, backend.explain(exc), running)
                        continue
                    bar.update(1)
    except KeyboardInterrupt:
        backend.cancel(list(running))
        raise Interrupted(len(jobs) - len(results)) from None
    return [results[k] for k in range(len(jobs))]


def _retry_or_fail(backend: Backend[H], job: Job[Any], k: int, attempt: int, error: str,
                   running: dict[H, tuple[int, int]]) -> None:
    """Submit `job` once more, or (its last attempt) cancel everything outstanding and raise `JobFailed`."""
    if attempt < ATTEMPTS:
        log.warning("run %s failed (attempt %d of %d): %s; retrying", job.name, attempt, ATTEMPTS, error)
        try:
            running[backend.submit(job)] = (k, attempt + 1)
            return
        except Exception as exc:  # the executor itself is gone (a broken pool): report the job, not a traceback
            error = f"{error}; then resubmitting it failed: {backend.explain(exc)}"
    backend.cancel(list(running))
    raise JobFailed(job.name, attempt, error)

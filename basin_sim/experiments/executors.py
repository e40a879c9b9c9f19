"""The executor seam of `basin-sim compare|ramp|risk --executor local|ray[://ADDRESS]`.

Where a sweep's runs execute: this machine (inline, or a process pool) or a Ray cluster.

Rules:
- A sweep opens an executor with its one shared input (the cells: session pools, predictions,
  calibrations) and hands it named jobs; a job is a module-level function and its arguments, run as
  `fn(shared, *args)`. The shared input crosses to the workers once: the process pool's initializer
  (fork: inherited, never pickled per job), or Ray's object store (`ray.put` once, read once per
  worker process: ray_executor.py). One worker, or one job: run inline, in this process.
- Results come back in the jobs' order whatever order they finish in, so a sweep's output is the same
  seed by seed whichever executor ran it.
- A job that fails (raises, or its worker dies) is submitted once more (ATTEMPTS in all); when that
  fails too, the jobs still outstanding are cancelled and `JobFailed` names the job, the attempts and
  the error. Nothing is retried silently: each retry is logged with its error.
- KeyboardInterrupt (Ctrl-C) while jobs are outstanding cancels them all and raises `Interrupted`
  with how many were cancelled; the caller exits non-zero with one line.
- Progress: one tqdm bar on stderr per batch of jobs, counting finished jobs.
- Ray is imported only when the Ray executor is opened (basin[ray]); `basin[sim]` needs no Ray.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from basin_sim.experiments.jobs import (
    ATTEMPTS,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_UNAVAILABLE,
    POLL_S,
    Backend,
    Executor,
    ExecutorError,
    Interrupted,
    Job,
    JobFailed,
    drive,
    exit_status,
)

__all__ = ["ATTEMPTS", "EXIT_INTERRUPTED", "EXIT_JOB_FAILED", "EXIT_UNAVAILABLE", "POLL_S", "Backend", "Executor",
           "ExecutorError", "ExecutorSpec", "Interrupted", "Job", "JobFailed", "LocalExecutor", "add_executor_options",
           "drive", "exit_status", "open_executor", "parse_executor"]

log = logging.getLogger(__name__)

R = TypeVar("R")

@dataclass(frozen=True)
class ExecutorSpec:
    """`local`, or `ray` with a Ray address (None: `ray.init()`'s own: RAY_ADDRESS, a local cluster, or a new one)."""

    kind: Literal["local", "ray"]
    address: str | None = None

    def __str__(self) -> str:
        return self.kind if self.address is None else self.address


LOCAL = ExecutorSpec("local")


def parse_executor(text: str) -> ExecutorSpec:
    """`local`, `ray`, or `ray://HOST:PORT` (a Ray Client address); argparse's `type` for --executor."""
    if text == "local":
        return ExecutorSpec("local")
    if text == "ray":
        return ExecutorSpec("ray")
    if text.startswith("ray://") and len(text) > len("ray://"):
        return ExecutorSpec("ray", text)
    raise argparse.ArgumentTypeError(f"expected local, ray or ray://HOST:PORT, got {text!r}")


def add_executor_options(parser: argparse.ArgumentParser, with_jobs: bool = True) -> None:
    """--executor (and --jobs, the local pool's worker processes)."""
    parser.add_argument("--executor", type=parse_executor, default=ExecutorSpec("local"), metavar="EXECUTOR",
                        help="where the runs execute: local (this machine's processes, --jobs), ray (a Ray "
                             "cluster as ray.init() finds it: RAY_ADDRESS, one started here by `ray start`, else "
                             "a new local one) or ray://HOST:PORT (Ray Client); ray needs basin[ray]")
    if with_jobs:
        parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                            help="worker processes of the local executor (default: cores)")


# --- local: inline, or a process pool ----------------------------------------------------------------

_SHARED: list[Any] = []  # in a pool worker: the shared input, set once by the pool's initializer


def _share(shared: Any) -> None:
    _SHARED[:] = [shared]


def _call_shared(fn: Callable[..., R], args: tuple[Any, ...]) -> R:
    return fn(_SHARED[0], *args)


def _explain(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class _Inline:
    """Jobs run one at a time in this process, when waited for (so the bar moves and Ctrl-C stops between jobs)."""

    def __init__(self, shared: Any) -> None:
        self._shared = shared
        self._queue: deque[tuple[Future[Any], Job[Any]]] = deque()

    def submit(self, job: Job[Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.append((future, job))
        return future

    def wait(self, handles: Sequence[Future[Any]], timeout_s: float) -> list[Future[Any]]:
        future, job = self._queue.popleft()
        try:
            future.set_result(job.fn(self._shared, *job.args))
        except Exception as exc:  # handed to drive() as the job's failure
            future.set_exception(exc)
        return [future]

    def result(self, handle: Future[Any]) -> Any:
        return handle.result()

    def cancel(self, handles: Sequence[Future[Any]]) -> None:
        self._queue.clear()

    explain = staticmethod(_explain)


class _Pool:
    """Jobs on a process pool whose workers got the shared input once, from the initializer."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self._pool = pool

    def submit(self, job: Job[Any]) -> Future[Any]:
        return self._pool.submit(_call_shared, job.fn, job.args)

    def wait(self, handles: Sequence[Future[Any]], timeout_s: float) -> list[Future[Any]]:
        return list(wait(handles, timeout_s, FIRST_COMPLETED).done)

    def result(self, handle: Future[Any]) -> Any:
        return handle.result()

    def cancel(self, handles: Sequence[Future[Any]]) -> None:
        for future in handles:
            future.cancel()  # queued ones; a running one ends with the pool (shutdown without waiting)
        self._pool.shutdown(wait=False, cancel_futures=True)

    explain = staticmethod(_explain)


class LocalExecutor:
    """This machine: inline with one worker or one job, else a pool of `workers` processes (made on first use)."""

    def __init__(self, shared: Any, workers: int, show_progress: bool = True) -> None:
        if workers < 1:
            raise ValueError(f"--jobs must be >= 1, got {workers}")
        self._shared = shared
        self._workers = workers
        self._show_progress = show_progress
        self._pool: ProcessPoolExecutor | None = None

    def run(self, jobs: Sequence[Job[R]], label: str) -> list[R]:
        """Every job's result in order (the module's rules)."""
        if self._workers == 1 or len(jobs) <= 1:
            return drive(_Inline(self._shared), jobs, label, self._show_progress)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self._workers, initializer=_share, initargs=(self._shared,))
        return drive(_Pool(self._pool), jobs, label, self._show_progress)

    def close(self) -> None:
        """Stop the pool's processes (waiting for none after an interrupt or a failure)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def _local(shared: Any, workers: int, show_progress: bool) -> Iterator[Executor]:
    executor = LocalExecutor(shared, workers, show_progress)
    try:
        yield executor
    finally:
        executor.close()


def open_executor(spec: ExecutorSpec, shared: Any, workers: int = 1,
                  show_progress: bool = True) -> AbstractContextManager[Executor]:
    """An executor for `spec` holding `shared` (local: `workers` processes; ray: the cluster's CPUs)."""
    if spec.kind == "ray":
        try:
            from basin_sim.experiments.ray_executor import ray_executor  # Ray only when asked for
        except ModuleNotFoundError as exc:
            raise ExecutorError(f"--executor {spec} needs Ray ({exc}): pip install 'basin[ray]'") from exc
        return ray_executor(spec.address, shared, show_progress)
    return _local(shared, workers, show_progress)

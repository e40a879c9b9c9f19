"""`--executor ray[://ADDRESS]`: a sweep's runs as Ray tasks, the shared input put once in the object store.

The Ray executor (executors.py's rules): every job is a Ray task on the cluster ray.init() reaches.

Rules:
- Connecting: the address given (ray://HOST:PORT, Ray Client) or ray.init()'s own search (RAY_ADDRESS,
  a cluster started on this machine by `ray start`, else a new local instance, stopped at the end).
  Ray already initialised in this process (a caller's own ray.init()): used as it is and left running.
- The shared input goes into the object store once (`ray.put`). Each task gets its reference inside a
  list, so Ray does not fetch and deserialise it per task; a worker process reads it once and keeps
  the latest one (`_HELD`), as the local pool's initializer does.
- One CPU per task. Ray's own retries are off (max_retries=0): executors.drive retries once itself,
  so a job that raises and a worker that dies count the same way.
- Cancelling: ray.cancel(force=True) on every outstanding task: a queued one never starts, a running
  one's worker process is ended. Ray's default (force=False, a KeyboardInterrupt raised in the task)
  does not reliably reach a task that is sleeping or inside a C call (ray-project/ray#32954, open), so a
  Ctrl-C could leave a run going on the cluster; the runs are pure functions, so ending them loses
  nothing but the run.
- The workers import the jobs' functions and the shared input's classes by name: they need the same
  basin installed (`pip install basin[ray]`), not this checkout's data/ (the cells carry their data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import ray
from ray import ObjectRef
from ray.exceptions import RayTaskError

from basin_sim.experiments.jobs import Executor, ExecutorError, Job, drive

R = TypeVar("R")

_HELD: dict[str, Any] = {}  # in a Ray worker: object id -> the shared input, the latest one only


def _call_held(box: list[ObjectRef[Any]], fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """In a Ray worker: `fn(shared, *args)`, the shared input read from the object store once per process."""
    key = box[0].hex()
    if key not in _HELD:
        _HELD.clear()
        _HELD[key] = ray.get(box[0])
    return fn(_HELD[key], *args)


_REMOTE = ray.remote(_call_held)


def explain(error: BaseException) -> str:
    """A task's error in one line: the exception the job raised (not Ray's wrapper and remote traceback)."""
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


class _RayBackend:
    """executors.Backend on Ray: a task per job, object refs as handles."""

    def __init__(self, shared: ObjectRef[Any]) -> None:
        self._shared = shared

    def submit(self, job: Job[Any]) -> ObjectRef[Any]:
        return _REMOTE.options(name=job.name, num_cpus=1, max_retries=0).remote([self._shared], job.fn, job.args)

    def wait(self, handles: Sequence[ObjectRef[Any]], timeout_s: float) -> list[ObjectRef[Any]]:
        ready, _ = ray.wait(list(handles), num_returns=1, timeout=timeout_s)
        return ready

    def result(self, handle: ObjectRef[Any]) -> Any:
        return ray.get(handle)

    def cancel(self, handles: Sequence[ObjectRef[Any]]) -> None:
        for handle in handles:
            ray.cancel(handle, force=True)

    explain = staticmethod(explain)


class RayExecutor:
    """Runs batches of jobs as Ray tasks against one shared input already in the object store."""

    def __init__(self, shared: ObjectRef[Any], show_progress: bool = True) -> None:
        self._shared = shared
        self._show_progress = show_progress

    def run(self, jobs: Sequence[Job[R]], label: str) -> list[R]:
        """Every job's result in order (executors.py's rules)."""
        return drive(_RayBackend(self._shared), jobs, label, self._show_progress)


@contextmanager
def ray_executor(address: str | None, shared: Any, show_progress: bool = True) -> Iterator[Executor]:
    """Connect (or start) as the rules say, put `shared` in the object store once, and run jobs there."""
    is_ours = not ray.is_initialized()
    if is_ours:
        try:
            ray.init(address=address)
        except (ConnectionError, RuntimeError, ValueError) as exc:  # no cluster there, or a bad address
            where = address or "RAY_ADDRESS, or a cluster on this machine, or a new one"
            raise ExecutorError(f"cannot start or reach a Ray cluster ({where}): {type(exc).__name__}: {exc}") from exc
    try:
        yield RayExecutor(ray.put(shared), show_progress)
    finally:
        if is_ours:
            ray.shutdown()

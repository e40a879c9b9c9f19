"""`--executor ray` on a real local Ray cluster (2 CPUs, started once for this module): the same JSON as the
local pool, a failing run retried once then named, Ctrl-C cancelling the cluster's outstanding tasks.

Faults are injected into the Ray workers themselves: the cluster's `worker_process_setup_hook` (below)
breaks every run of the scenario named BROKEN in each worker process it starts.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from basin_runtime.session_table import read_sessions
from basin_sim.catalog import load_deployment, load_scenario
from basin_sim.experiments import compare
from basin_sim.experiments.calibrate.rates import RateCache, rate_key
from basin_sim.experiments.cli import main as cli_main
from basin_sim.experiments.executors import EXIT_JOB_FAILED, ExecutorSpec, Interrupted, Job, JobFailed, open_executor
from basin_sim.workload.pool import workload_pool
from tests.sim.builders import seeded_files
from tests.sim.grids import tiny_grid
from tests.sim.test_cli import DEPLOYMENT

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BROKEN = "tiny-broken"  # every run of a scenario of this name raises in a Ray worker


def break_the_broken_scenario() -> None:
    """Ray's worker_process_setup_hook: in each worker, runs of the scenario BROKEN raise."""
    real = compare.run_scenario

    def run(spec: Any, *args: Any) -> Any:
        if spec.scenario.name == BROKEN:
            raise RuntimeError(f"injected fault in worker {os.getpid()}")
        return real(spec, *args)

    compare.run_scenario = run


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    """A new local Ray instance with 2 CPUs for the module (never a cluster `ray start` left on this machine);
    the workers import this checkout's tests package."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={
        "env_vars": {"PYTHONPATH": str(ROOT)},
        "worker_process_setup_hook": f"{__name__}.break_the_broken_scenario"})
    yield
    ray.shutdown()


def test_the_grid_on_ray_writes_the_same_json_as_the_local_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    grid = tiny_grid(tmp_path, "tiny-surge")  # sglang and a calibrated basin (its knee ramp a task too), 2 seeds
    local, on_ray = tmp_path / "local.json", tmp_path / "ray.json"
    assert compare.main([*grid.argv(local), "--executor", "local", "--jobs", "2"]) == 0
    put: list[Any] = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **options: put.append(value) or real_put(value, **options))
    assert compare.main([*grid.argv(on_ray), "--executor", "ray"]) == 0
    [cells] = put  # one put for the knee ramp and the 4 runs: the cells, with their pool and predictions
    [cell] = cells.values()
    told = cell.reserving
    assert len(cell.pool) == len(told.peaks) == len(told.multipliers) == 900  # 300 sessions of 3 benchmarks
    err = capsys.readouterr().err
    assert err.count("Basin calibration measured now") == 2  # once per executor: each has its own knee file
    assert "runs: 100%" in err and "4/4" in err  # the progress bar, as the local pool shows it
    assert on_ray.read_text() == local.read_text()
    result = json.loads(on_ray.read_text())
    assert [(r["policy"], r["seed"]) for r in result["runs"]] == [("basin", 1), ("basin", 2), ("sglang", 1),
                                                                 ("sglang", 2)]
    assert result["cells"]["tiny-surge/tiny/none"]["calibration"]["reservation_ratio"] > 1.0


def test_the_field_labels_on_ray_write_the_same_json_as_the_local_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grid = tiny_grid(tmp_path, "tiny-surge", ("thunderagent", "thunderagent+session-cache", "continuum-fixed-ttl"),
                     seeds=(1,))
    local, on_ray = tmp_path / "local.json", tmp_path / "ray.json"
    assert compare.main([*grid.argv(local), "--executor", "local", "--jobs", "2"]) == 0
    assert compare.main([*grid.argv(on_ray), "--executor", "ray"]) == 0
    assert on_ray.read_text() == local.read_text()
    runs = {r["policy"]: r for r in json.loads(on_ray.read_text())["runs"]}
    assert runs["thunderagent+session-cache"]["session_cache"]["mode"] == "true"
    assert "session_cache" not in runs["thunderagent"] and "pin_slow_tool_share" in runs["continuum-fixed-ttl"]


def test_risk_and_ramp_over_two_deployments_on_ray_print_what_the_local_pool_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = seeded_files(tmp_path, DEPLOYMENT)
    second = tmp_path / "d2.yaml"
    second.write_text(DEPLOYMENT.replace("name: tiny", "name: tiny-2p").replace("num_prefill: 1", "num_prefill: 2"))
    steady = load_scenario("steady")  # the second shape's rate seeded too (measuring it takes a minute)
    pool = workload_pool(read_sessions(Path(files["sessions"])), steady.workload)
    RateCache(Path(files["rates"])).put(rate_key(load_deployment(str(second)).build("gpu"), steady.workload,
                                                 steady.clients, pool), 0.2, {"command": "seeded by the test"})
    for command in ("risk", "ramp"):
        argv = [command, "--deployment", files["deployment"], str(second), "--sessions", files["sessions"],
                "--rates-file", files["rates"], "--step-s", "300", "--fractions", "0.5", "1", "2", "--json", "--quiet"]
        printed = []
        for executor in (["--executor", "local", "--jobs", "2"], ["--executor", "ray"]):
            assert cli_main([*argv, *executor]) == 0
            printed.append(capsys.readouterr().out)
        assert printed[0] == printed[1]
        records = [json.loads(line) for line in printed[1].splitlines()]
        assert [(r["deployment"], r["overload_rate_per_s"]) for r in records] == [("tiny", 0.1), ("tiny-2p", 0.2)]


def test_a_run_that_fails_on_ray_is_retried_once_then_named_with_exit_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    grid = tiny_grid(tmp_path, BROKEN, policies=("sglang",), seeds=(1,))
    assert compare.main([*grid.argv(tmp_path / "out.json"), "--executor", "ray"]) == EXIT_JOB_FAILED
    err = capsys.readouterr().err
    assert f"basin-sim compare: run {BROKEN}/tiny/none/sglang seed 1 failed 2 times (retried once), last error: " \
        "RuntimeError: injected fault in worker " in err
    assert caplog.text.count("failed (attempt 1 of 2)") == 1  # the retry, said once
    assert "Traceback" not in err and not (tmp_path / "out.json").exists()


def attempted(shared: object, marker_dir: str) -> int:
    """A job that fails every time, leaving one file per attempt (its worker's pid in the name)."""
    (Path(marker_dir) / f"attempt.{os.getpid()}.{time.monotonic_ns()}").touch()
    raise ValueError("always")


def test_a_failing_task_is_run_exactly_twice(tmp_path: Path) -> None:
    with open_executor(ExecutorSpec("ray"), {}, show_progress=False) as executor, pytest.raises(JobFailed) as failed:
        executor.run([Job("always broken", attempted, (str(tmp_path),))], "jobs")
    assert str(failed.value) == "run always broken failed 2 times (retried once), last error: ValueError: always"
    assert len(list(tmp_path.glob("attempt.*"))) == 2  # Ray's own retries are off: ours is the only one


def blocking(shared: object, marker_dir: str, k: int) -> int:
    """A job that says it started, then waits (in short sleeps, so a cancel lands) until the test releases it."""
    folder = Path(marker_dir)
    (folder / f"started.{k}").touch()
    while not (folder / "release").exists():
        time.sleep(0.05)
    return k


def _interrupt_when(condition: Callable[[], bool], stop: threading.Event, timeout_s: float = 60.0) -> None:
    """A thread that sends this process SIGINT (Ctrl-C) once `condition` holds (or at `timeout_s`), unless
    `stop` is set first."""
    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.05)
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def test_ctrl_c_cancels_the_clusters_outstanding_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled: list[Any] = []
    real_cancel = ray.cancel

    def recording_cancel(ref: Any, **options: Any) -> None:  # the real ray.cancel, each ref noted
        cancelled.append(ref)
        real_cancel(ref, **options)

    monkeypatch.setattr(ray, "cancel", recording_cancel)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises KeyboardInterrupt here
    jobs = [Job(f"blocking {k}", blocking, (str(tmp_path), k)) for k in range(3)]  # 2 CPUs: 2 run, 1 queued
    stop = threading.Event()
    try:
        _interrupt_when(lambda: len(list(tmp_path.glob("started.*"))) == 2, stop)
        with open_executor(ExecutorSpec("ray"), {}, show_progress=False) as executor, \
                pytest.raises(Interrupted) as interrupted:
            executor.run(jobs, "jobs")
    finally:
        stop.set()
        signal.signal(signal.SIGINT, previous)
    assert interrupted.value.cancelled == 3 and len(cancelled) == 3
    for ref in cancelled:  # running and queued alike: cancelled on the cluster, none left to finish
        with pytest.raises(ray.exceptions.TaskCancelledError):
            # a bound, not a wait: the answer comes as soon as the cancel lands (a forced cancel: Ray's
            # KeyboardInterrupt did not always reach a sleeping task, ray-project/ray#32954)
            ray.get(ref, timeout=120)
    (tmp_path / "release").touch()
    assert sorted(p.name for p in tmp_path.glob("started.*")) == ["started.0", "started.1"]  # the third never ran

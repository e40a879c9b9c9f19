"""The session pool a run draws from: the session table, or the synthetic corpus when there is none."""

from __future__ import annotations

import logging
from pathlib import Path

from basin_runtime.session_table import Session, SessionTableError, read_sessions
from basin_sim.workload.synthetic import generate_corpus

log = logging.getLogger(__name__)

DEFAULT_SESSIONS = Path("data/sessions.parquet")
SYNTHETIC_SEED = 7  # the pipeline's synthetic corpus (params.yaml: ingest.synthetic)
SYNTHETIC_PER_BENCHMARK = 300


class PoolError(ValueError):
    """The session table exists but cannot be read; the message names the file and the problem."""


def load_pool(path: Path, use_synthetic: bool) -> tuple[list[Session], str]:
    """The session pool and its workload label ('table' or 'synthetic'); warns when it falls back."""
    if not use_synthetic and path.exists():
        try:
            return read_sessions(path), "table"
        except SessionTableError as exc:
            raise PoolError(str(exc)) from exc
    if not use_synthetic:
        log.warning("no session table at %s: using the SYNTHETIC corpus (seed %d, %d sessions per benchmark); "
                    "numbers are not those of the real traces", path, SYNTHETIC_SEED, SYNTHETIC_PER_BENCHMARK)
    return generate_corpus(SYNTHETIC_SEED, SYNTHETIC_PER_BENCHMARK), "synthetic"

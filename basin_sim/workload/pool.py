"""The session pool a run draws from: the session table (or the synthetic corpus), shaped by a workload."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from basin_runtime.session_table import Session, SessionTableError, read_sessions
from basin_sim.workload.presets import preset_pool
from basin_sim.workload.scenarios import WorkloadSpec
from basin_sim.workload.synthetic import generate_corpus
from basin_sim.workload.tool_time import resolve_gaps

log = logging.getLogger(__name__)

DEFAULT_SESSIONS = Path("data/sessions.parquet")
SYNTHETIC_SEED = 7  # the pipeline's synthetic corpus (params.yaml: ingest.synthetic)
SYNTHETIC_PER_BENCHMARK = 300
PRESET_SEED = 11  # a preset's pool is one fixed draw, like the synthetic corpus


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


def workload_pool(base: Sequence[Session], workload: WorkloadSpec) -> list[Session]:
    """The sessions a scenario draws from: a preset, or the base pool's chosen benchmarks; tool time resolved.

    Tool time is resolved once per pool session (its own seeded stream), so a session's gaps, and
    with them its unloaded time, are the same in every run and every seed.
    """
    if workload.preset is not None:
        sessions = preset_pool(workload.preset, PRESET_SEED)
    elif workload.benchmarks is not None:
        known = sorted({s.benchmark for s in base})
        missing = [b for b in workload.benchmarks if b not in known]
        if missing:
            raise PoolError(f"workload.benchmarks {missing} have no sessions in the pool; known: {known}")
        sessions = [s for s in base if s.benchmark in workload.benchmarks]
    else:
        sessions = list(base)
    return [with_tool_time(s, workload.tool_time_scale) for s in sessions]


def with_tool_time(session: Session, tool_time_scale: float) -> Session:
    """The session with its gaps resolved (workload/tool_time.py) on its own stream, seeded by its id."""
    seed = int.from_bytes(hashlib.sha256(session.session_id.encode()).digest()[:8], "big")
    gaps = resolve_gaps(session, random.Random(seed), tool_time_scale)
    calls = tuple(dataclasses.replace(call, gap_s=gaps[k] if k < len(gaps) else None)
                  for k, call in enumerate(session.calls))
    return dataclasses.replace(session, calls=calls)

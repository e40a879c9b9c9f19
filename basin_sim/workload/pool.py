"""The session pool a run draws from: the session table (or the synthetic corpus), shaped by a workload."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

from basin_runtime.session_table import Session, SessionTableError, read_sessions
from basin_sim.workload.presets import preset_pool
from basin_sim.workload.scenarios import WorkloadSpec
from basin_sim.workload.serving import RECORDED, load_timing
from basin_sim.workload.synthetic import generate_corpus
from basin_sim.workload.tool_time import SOURCED, resolve_gaps

DEFAULT_SESSIONS = Path("data/sessions.parquet")
SYNTHETIC_SEED = 7  # the pipeline's synthetic corpus (params.yaml: ingest.synthetic)
SYNTHETIC_PER_BENCHMARK = 300
PRESET_SEED = 11  # a preset's pool is one fixed draw, like the synthetic corpus


class PoolError(ValueError):
    """No session table where one was looked for, or one that cannot be read; the message names the file."""


PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when basin_sim runs from one


def table_candidates(path: Path) -> list[Path]:
    """Where a session table given as `path` is looked for: `path`, and for a relative path also the same
    path under the project checkout this package runs from (a command started outside the project root)."""
    candidates = [path.absolute()]
    if not path.is_absolute() and (PROJECT_ROOT / "dvc.yaml").exists():
        beside = PROJECT_ROOT / path
        if beside != candidates[0]:
            candidates.append(beside)
    return candidates


def load_pool(path: Path, use_synthetic: bool) -> tuple[list[Session], str]:
    """The session pool and its workload label ('table' or 'synthetic').

    The synthetic corpus only when asked for (`use_synthetic`); with no table found, a `PoolError` that
    names every place looked in and the command that builds the table."""
    if use_synthetic:
        return generate_corpus(SYNTHETIC_SEED, SYNTHETIC_PER_BENCHMARK), "synthetic"
    candidates = table_candidates(path)
    for candidate in candidates:
        if candidate.exists():
            try:
                return read_sessions(candidate), "table"
            except SessionTableError as exc:
                raise PoolError(str(exc)) from exc
    looked = " nor ".join(str(c) for c in candidates)
    raise PoolError(f"no session table at {looked}: build it with `make repro` (or `dvc repro ingest`) in the "
                    f"project, pass --sessions PATH, or --synthetic for the synthetic corpus (seed {SYNTHETIC_SEED}, "
                    f"{SYNTHETIC_PER_BENCHMARK} sessions per benchmark; not the real traces' numbers)")


def workload_pool(base: Sequence[Session], workload: WorkloadSpec) -> list[Session]:
    """The sessions a scenario draws from: a preset, or the base pool's chosen benchmarks; tool time resolved;
    every prompt scaled by `token_scale` (1 unless the workload sets `median_peak_tokens`); then the serving
    model's timing applied (workload/serving.py) unless it is `recorded`.

    Tool time is resolved once per pool session (its own seeded stream), so a session's gaps, and
    with them its unloaded time, are the same in every run and every seed.
    """
    sessions = _chosen(base, workload)
    scale = _scale_of(sessions, workload)
    resolved = [scaled(with_tool_time(s, workload.tool_time_scale, workload.tool_time), scale) for s in sessions]
    if workload.timing == RECORDED:
        return resolved
    timing = load_timing(workload.timing, workload.reasoning_scale)
    return [timing.apply(s) for s in resolved]


def _chosen(base: Sequence[Session], workload: WorkloadSpec) -> list[Session]:
    """A preset's pool, or the base pool's sessions of the workload's benchmarks (all without a list)."""
    if workload.preset is not None:
        return preset_pool(workload.preset, PRESET_SEED)
    if workload.benchmarks is None:
        return list(base)
    known = sorted({s.benchmark for s in base})
    missing = [b for b in workload.benchmarks if b not in known]
    if missing:
        raise PoolError(f"workload.benchmarks {missing} have no sessions in the pool; known: {known}")
    return [s for s in base if s.benchmark in workload.benchmarks]


def _scale_of(sessions: Sequence[Session], workload: WorkloadSpec) -> float:
    if workload.median_peak_tokens is None:
        return 1.0
    if not sessions:
        raise PoolError("workload.median_peak_tokens: the pool has no sessions to scale")
    return workload.median_peak_tokens / statistics.median(s.peak_prompt_tokens for s in sessions)


def token_scale(base: Sequence[Session], workload: WorkloadSpec) -> float:
    """The factor every prompt of the workload's pool is scaled by: its `median_peak_tokens` over the chosen
    sessions' median peak (1 without one)."""
    return _scale_of(_chosen(base, workload), workload)


def scaled(session: Session, scale: float) -> Session:
    """The session with every prompt (and what of it was cached or recorded) `scale` times as large, rounded;
    completions, gaps and task text as they were. A session of the same shape at another size: each prompt's
    share already sent in the previous call stays."""
    if scale == 1.0:
        return session

    def times(tokens: int | None) -> int | None:
        return None if tokens is None else max(1, round(tokens * scale))

    calls = tuple(dataclasses.replace(c, prompt_tokens=max(1, round(c.prompt_tokens * scale)),
                                      cached_tokens=times(c.cached_tokens),
                                      recorded_prompt_tokens=times(c.recorded_prompt_tokens)) for c in session.calls)
    return dataclasses.replace(session, calls=calls)


def with_tool_time(session: Session, tool_time_scale: float, mode: str = SOURCED) -> Session:
    """The session with its gaps resolved (workload/tool_time.py) on its own stream, seeded by its id."""
    seed = int.from_bytes(hashlib.sha256(session.session_id.encode()).digest()[:8], "big")
    gaps = resolve_gaps(session, random.Random(seed), tool_time_scale, mode)
    calls = tuple(dataclasses.replace(call, gap_s=gaps[k] if k < len(gaps) else None)
                  for k, call in enumerate(session.calls))
    return dataclasses.replace(session, calls=calls)

"""The risk test checked against the limits ramp on a grid of deployments fixed in advance.

    python benchmarks/risk_grid.py [--grid benchmarks/risk_grid.yaml] [--sessions data/sessions.parquet]
        [--out data/sim/risk_grid.json] [--workers 2]

For every deployment of the grid (benchmarks/risk_grid.yaml: decode counts x prefill cache sizes x
decode memories x tool time scales): the overload rate of its shape and workload (cached in
--rates-file, measured once otherwise: phase 1), then `basin-sim risk` (the knee ramp, seed
`risk_seed`) and `basin-sim ramp` (the limits ramp, seed `ramp_seed`) (phase 2). Prints and writes the
confusion matrix (risk verdict x ramp first_limit) and one row per deployment. The workers only read
the rates file; the parent writes every measured rate, so two workers never race on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

import yaml
from tqdm import tqdm

from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.experiments.calibrate.commands import ramp_record, risk_record, simulated_ramp
from basin_sim.experiments.calibrate.fluid import VERDICTS
from basin_sim.experiments.calibrate.knee_ramp import RAMP_FRACTIONS, RAMP_STEP_S
from basin_sim.experiments.calibrate.overload import CalibrationSettings, find_overload_rate
from basin_sim.experiments.calibrate.ramp import LIMITS
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE, RateCache, rate_key
from basin_sim.experiments.calibrate.setups import LIMIT_RAMP_FRACTIONS
from basin_sim.profile import Deployment
from basin_sim.workload.pool import DEFAULT_SESSIONS, load_pool, workload_pool
from basin_sim.workload.scenarios import Scenario

GRID_KEYS = {"base_deployment", "scenario", "num_prefill", "num_decode", "prefill_cache_x_pool", "decode_kv_x_pool",
             "tool_time_scale", "risk_seed", "ramp_seed"}
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One deployment of the grid and the workload it is run on."""

    deployment: Deployment
    scenario: Scenario
    tool_time_scale: float


def read_grid(path: Path) -> tuple[list[Cell], dict[str, Any]]:
    """The grid file's deployments (in a fixed order) and its raw settings."""
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or set(raw) != GRID_KEYS:
        keys = sorted(raw) if isinstance(raw, dict) else raw
        raise SystemExit(f"{path}: the grid needs exactly the keys {sorted(GRID_KEYS)}, got {keys}")
    base = catalog.load_deployment(str(raw["base_deployment"])).build()
    scenario = catalog.load_scenario(str(raw["scenario"]))
    pool_tokens = base.profile.kv_pool_tokens
    cells = []
    for p, d, cache_x, decode_x, tool in itertools.product(raw["num_prefill"], raw["num_decode"],
                                                          raw["prefill_cache_x_pool"], raw["decode_kv_x_pool"],
                                                          raw["tool_time_scale"]):
        name = f"{p}p{d}d-cache{cache_x:g}x-decode{decode_x:g}x-tool{tool:g}"
        deployment = dataclasses.replace(base, name=name, num_prefill=int(p), num_decode=int(d),
                                         prefill_cache_tokens=round(cache_x * pool_tokens),
                                         decode_kv_tokens=round(decode_x * pool_tokens))
        workload = dataclasses.replace(scenario.workload, tool_time_scale=float(tool))
        cells.append(Cell(deployment, dataclasses.replace(scenario, workload=workload), float(tool)))
    return cells, raw


def _pool(sessions: Path, cell: Cell) -> list[Session]:
    base, _ = load_pool(sessions, use_synthetic=False)
    return workload_pool(base, cell.scenario.workload)


def measure_rate(cell: Cell, sessions: Path) -> tuple[str, float, dict[str, Any]]:
    """Phase 1 (a worker): the overload rate of the cell's shape (GPU cache) and workload, and its note."""
    pool = _pool(sessions, cell)
    shape = dataclasses.replace(cell.deployment, host_cache_tokens=0)
    settings = CalibrationSettings()
    found = find_overload_rate(shape, "sglang", pool, settings)
    note = {"deployment": cell.deployment.name, "workload": dataclasses.asdict(cell.scenario.workload),
            "settings": dataclasses.asdict(settings), "tried": [list(t) for t in found.tried],
            "command": "python benchmarks/risk_grid.py"}
    return rate_key(shape, cell.scenario.workload, cell.scenario.clients, pool), found.overload_rate_per_s, note


def run_cell(cell: Cell, sessions: Path, rates_file: Path, risk_seed: int, ramp_seed: int) -> dict[str, Any]:
    """Phase 2 (a worker): the risk test and the limits ramp of one deployment (rates only read)."""
    started = time.perf_counter()
    pool = _pool(sessions, cell)
    cache = RateCache(rates_file)
    risk = risk_record(simulated_ramp(cell.deployment, pool, cell.scenario, cache, RAMP_FRACTIONS, RAMP_STEP_S,
                                      risk_seed))
    ramp = ramp_record(simulated_ramp(cell.deployment, pool, cell.scenario, cache, LIMIT_RAMP_FRACTIONS,
                                      RAMP_STEP_S, ramp_seed))
    return {"deployment": cell.deployment.name, "num_prefill": cell.deployment.num_prefill,
            "num_decode": cell.deployment.num_decode, "prefill_cache_tokens": cell.deployment.prefill_cache_tokens,
            "decode_kv_tokens": cell.deployment.decode_kv_tokens, "tool_time_scale": cell.tool_time_scale,
            "verdict": risk["verdict"], "first_limit": ramp["first_limit"],
            "cache_limit_sessions": risk["cache_limit_sessions"],
            "decode_limit_sessions": risk["decode_limit_sessions"],
            "engine_decode_limit_sessions": risk["engine_decode_limit_sessions"],
            "knee_is_censored": risk["knee_is_censored"], "decode_holding_share": risk["decode_holding_share"],
            "mean_context_tokens": risk["mean_context_tokens"], "cache_limit_step": ramp["cache_limit_step"],
            "decode_limit_step": ramp["decode_limit_step"], "is_tie_broken_by_minute": ramp["is_tie_broken_by_minute"],
            "overload_rate_per_s": ramp["overload_rate_per_s"], "wall_s": time.perf_counter() - started,
            "risk": risk, "ramp": ramp}


def confusion(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Counts of (risk verdict, ramp first_limit)."""
    matrix = {verdict: dict.fromkeys(LIMITS, 0) for verdict in VERDICTS}
    for row in rows:
        matrix[row["verdict"]][row["first_limit"]] += 1
    return matrix


def _pooled(workers: int, label: str, jobs: list[tuple[Callable[..., T], tuple[Any, ...]]],
            done: Callable[[int, T], None]) -> None:
    with ProcessPoolExecutor(max_workers=workers) as executor:
        futures = {executor.submit(fn, *fn_args): k for k, (fn, fn_args) in enumerate(jobs)}
        with tqdm(total=len(futures), desc=label, unit="deployment", file=sys.stderr) as bar:
            for future in as_completed(futures):
                done(futures[future], future.result())
                bar.update(1)


def main(argv: list[str] | None = None) -> int:
    """Run the grid; print and write the confusion matrix and the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=Path, default=Path("benchmarks/risk_grid.yaml"))
    parser.add_argument("--sessions", type=Path, default=DEFAULT_SESSIONS)
    parser.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE)
    parser.add_argument("--out", type=Path, default=Path("data/sim/risk_grid.json"))
    parser.add_argument("--workers", type=int, default=2, help="processes (the machine has 2 cores)")
    args = parser.parse_args(argv)
    if not args.sessions.exists():
        raise SystemExit(f"{args.sessions}: no session table (run `make repro`'s ingest, or pass --sessions)")
    started = time.perf_counter()
    cells, raw = read_grid(args.grid)
    cache = RateCache(args.rates_file)
    base, _ = load_pool(args.sessions, use_synthetic=False)
    pools = {cell.tool_time_scale: workload_pool(base, cell.scenario.workload) for cell in cells}
    missing: list[tuple[str, Cell]] = []
    for cell in cells:
        key = rate_key(dataclasses.replace(cell.deployment, host_cache_tokens=0), cell.scenario.workload,
                       cell.scenario.clients, pools[cell.tool_time_scale])
        if cache.get(key) is None and key not in {k for k, _ in missing}:
            missing.append((key, cell))

    def record_rate(_: int, measured: tuple[str, float, dict[str, Any]]) -> None:
        key, rate, note = measured
        cache.put(key, rate, note)

    _pooled(args.workers, "overload rates", [(measure_rate, (cell, args.sessions)) for _, cell in missing],
            record_rate)
    rows: list[dict[str, Any]] = [{} for _ in cells]

    def record_row(k: int, row: dict[str, Any]) -> None:
        rows[k] = row
        tqdm.write(f"{row['deployment']}: risk {row['verdict']} (cache {row['cache_limit_sessions']:.0f}, decode "
                   f"{row['decode_limit_sessions']:.0f} sessions); ramp {row['first_limit']} (cache step "
                   f"{row['cache_limit_step']}, decode step {row['decode_limit_step']}) [{row['wall_s']:.0f} s]",
                   file=sys.stderr)

    _pooled(args.workers, "risk + ramp", [(run_cell, (cell, args.sessions, args.rates_file, raw["risk_seed"],
                                                      raw["ramp_seed"])) for cell in cells], record_row)
    matrix = confusion(rows)
    wall = time.perf_counter() - started
    print(_table(matrix, rows, wall, len(missing)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"grid": str(args.grid), "grid_settings": raw, "command": " ".join(
        ["python benchmarks/risk_grid.py", *(argv if argv is not None else sys.argv[1:])]),
        "confusion": matrix, "wall_s": wall, "rates_measured": len(missing), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _table(matrix: dict[str, dict[str, int]], rows: list[dict[str, Any]], wall_s: float, measured: int) -> str:
    lines = ["risk verdict \\ ramp first_limit  " + "  ".join(f"{limit:>6s}" for limit in LIMITS)]
    for verdict in VERDICTS:
        lines.append(f"{verdict:32s}  " + "  ".join(f"{matrix[verdict][limit]:6d}" for limit in LIMITS))
    lines.append("")
    lines.append(f"{'deployment':36s} {'verdict':12s} {'cache N':>8s} {'decode N':>8s} {'engine N':>8s} "
                 f"{'ramp':>6s} {'c.step':>6s} {'d.step':>6s}  tie by minute")
    for row in rows:
        engine = row["engine_decode_limit_sessions"]
        lines.append(f"{row['deployment']:36s} {row['verdict']:12s} {row['cache_limit_sessions']:8.0f} "
                     f"{row['decode_limit_sessions']:8.0f} {engine or float('nan'):8.0f} {row['first_limit']:>6s} "
                     f"{row['cache_limit_step']!s:>6s} {row['decode_limit_step']!s:>6s}  "
                     f"{'yes' if row['is_tie_broken_by_minute'] else ''}")
    lines.append("cache N / decode N: the risk test's limits in live sessions; engine N: decode memory / what the "
                 "simulated engine held per live session on the plateau (a diagnostic)")
    lines.append(f"{len(rows)} deployments in {wall_s:.0f} s wall ({measured} overload rates measured)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Sweeps on Ray against the local process pool: the same grid on each, wall time, overhead, identical results.

    python benchmarks/bench_ray.py [--scenario paper-timed-surge-100] [--deployment 1p3d]
        [--policies sglang continuum budgeter basin] [--seeds 1 ... 10] [--workers 2] [--repeats 2]

One `basin-sim compare` grid (default 4 policies x 10 seeds = 40 runs of the paper's surge on its 1P3D node) run
by `compare.run_grids` with `--executor local --jobs W` and with `--executor ray` on a local Ray instance of W
CPUs, alternately, `--repeats` times each; each run starts from its own copy of the rates and calibrations files,
so neither finds what the other measured. Prints each executor's best wall time (loading the pool and the
predictions included, as a user waits for them), Ray's start-up (once, apart: a cluster already up does not pay
it), the overhead (target <= 10%), and whether every run's row and every cell's calibration are the same bit
for bit (JSON text of the floats' shortest repr; target: identical). Exit status 1 if they are not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from basin_sim.experiments import compare
from basin_sim.experiments.calibrate.knee_cache import DEFAULT_CALIBRATIONS_FILE
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE
from basin_sim.experiments.executors import LOCAL, ExecutorSpec


def _run(setup: compare.CompareSetup, executor: ExecutorSpec, folder: Path) -> tuple[float, str]:
    """(wall seconds, the result as JSON text) of the grid on `executor`, from fresh copies of the caches."""
    folder.mkdir(parents=True)
    rates, knees = folder / "rates.json", folder / "calibrations.json"
    for source, copy in ((DEFAULT_RATES_FILE, rates), (DEFAULT_CALIBRATIONS_FILE, knees)):
        if source.exists():
            shutil.copy(source, copy)
    inputs = dataclasses.replace(setup.inputs, rates_file=rates, calibrations_file=knees)
    started = time.perf_counter()
    result = compare.run_grids(dataclasses.replace(setup, inputs=inputs, executor=executor))
    wall_s = time.perf_counter() - started
    return wall_s, json.dumps({"runs": result.rows, "cells": result.cells_json()}, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    """Run the grid on both executors; print wall times, overhead and whether the results are identical."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="paper-timed-surge-100")
    parser.add_argument("--deployment", default="1p3d")
    parser.add_argument("--policies", nargs="+", default=["sglang", "continuum", "budgeter", "basin"])
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(1, 11)))
    parser.add_argument("--workers", type=int, default=2, help="local pool processes = Ray CPUs (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each executor, alternating (best kept)")
    args = parser.parse_args(argv)
    grid = compare.Grid((args.scenario,), (args.deployment,), ("none",), tuple(args.policies))
    setup = compare.CompareSetup((grid,), tuple(args.seeds), jobs=args.workers)
    import ray  # basin[ray]

    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    ray.init(address="local", num_cpus=args.workers, include_dashboard=False)  # a new instance, never a cluster here
    startup_s = time.perf_counter() - started
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    results: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        try:
            for k in range(args.repeats):
                for name, executor in (("local", LOCAL), ("ray", ExecutorSpec("ray"))):
                    wall_s, text = _run(setup, executor, Path(tmp) / f"{name}-{k}")
                    walls[name].append(wall_s)
                    results.add(text)
                    print(f"{name} #{k + 1}: {wall_s:.1f} s", file=sys.stderr)
        finally:
            ray.shutdown()
    runs = len(json.loads(next(iter(results)))["runs"])
    load_after = os.getloadavg()[0]
    local, on_ray = min(walls["local"]), min(walls["ray"])
    print(f"grid: {args.scenario} x {args.deployment} x lending none x {' '.join(args.policies)} x "
          f"{len(args.seeds)} seeds = {runs} runs; best of {args.repeats} each, alternating")
    print(f"machine: {os.cpu_count()} cores, 1-minute load {load_before:.1f} before, {load_after:.1f} after "
          "(other work on it stretches both executors' times)")
    print(f"local process pool ({args.workers} workers): {local:.1f} s  (each: {_each(walls['local'])})")
    print(f"ray ({args.workers} local CPUs):            {on_ray:.1f} s  (each: {_each(walls['ray'])}); "
          f"ray.init {startup_s:.1f} s once, apart")
    with_startup = 100 * ((on_ray + startup_s) / local - 1)
    print(f"overhead: {100 * (on_ray / local - 1):+.1f}% (with ray.init: {with_startup:+.1f}%)")
    identical = len(results) == 1
    print(f"results identical bit for bit: {'yes' if identical else 'NO'} ({runs} runs x {2 * args.repeats} sweeps)")
    return 0 if identical else 1


def _each(walls: list[float]) -> str:
    return ", ".join(f"{w:.1f} s" for w in walls)


if __name__ == "__main__":
    sys.exit(main())

"""Sessions as the model now runs them: tool time per step, unloaded time, and the paper's "short" share.

    python benchmarks/session_lifetimes.py                 # the paper-sized preset, timed, on 1p1d
    python benchmarks/session_lifetimes.py --scenario paper-swebench-pro-steady --deployment 1p3d

For the scenario's pool (workload/pool.py: tool time sourced, the serving timing at its fitted scale):
the tool gaps per step (median, mean, p90, p99), calls per session, and each session's unloaded time
(alone on an empty deployment, unloaded.py): median, mean, p95, and the share of sessions that finish
within 5 minutes (the paper's "short" sessions, the burst's candidates: `max_unloaded_s: 300`).
Nothing here is fitted; it reports what the sources and the steady fit give. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from basin_sim import catalog
from basin_sim.simulate import pool_unloaded_s
from basin_sim.unloaded import UnloadedTimes
from basin_sim.workload.pool import load_pool, workload_pool

SHORT_S = 300.0  # the paper: short sessions finish within 5 minutes on a healthy engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="paper-preset-steady")
    parser.add_argument("--deployment", default="1p1d")
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    scenario = catalog.load_scenario(args.scenario)
    base, _ = load_pool(args.sessions, False)
    pool = workload_pool(base, scenario.workload)
    deployment = catalog.load_deployment(args.deployment).build(None)
    unloaded_s = pool_unloaded_s(pool, UnloadedTimes(deployment))
    times = np.array([unloaded_s(session) for session in pool])
    gaps = np.array([c.gap_s for s in pool for c in s.calls[:-1] if c.gap_s is not None])
    calls = [s.n_calls for s in pool]
    report = {
        "scenario": args.scenario, "deployment": args.deployment, "sessions": len(pool),
        "calls_per_session_median": statistics.median(calls), "calls_per_session_mean": statistics.fmean(calls),
        "tool_s_per_step": {"p50": float(np.median(gaps)), "mean": float(gaps.mean()),
                            "p90": float(np.quantile(gaps, 0.9)), "p99": float(np.quantile(gaps, 0.99))},
        "tool_s_per_session_mean": float(gaps.sum() / len(pool)),
        "unloaded_s": {"p50": float(np.median(times)), "mean": float(times.mean()),
                       "p95": float(np.quantile(times, 0.95))},
        "short_share": float((times <= SHORT_S).mean()),
    }
    print(json.dumps(report, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

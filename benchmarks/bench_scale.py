"""Simulator scale: one simulated hour (after the steady scenario's warm-up) of steady arrivals under plain
SGLang on 1P3D and on 100P300D at exactly 100x the rate, both given as explicit `per_min` rates. Targets:
1P3D's hour in < 10 s, 100P300D's in < 5 min, 100P300D's wall time per session within 1.5x of 1P3D's.

The 1P3D rate is half its overload rate for the default workload, read from the overload-rate cache
(`basin-sim calibrate --deployment 1p3d-h100 --scenario steady` records it); nothing is calibrated here.

    python benchmarks/bench_scale.py [--scale 100] [--hours 1] [--seed 1] [--sessions PATH] [--rates-file PATH]
        [--profile-out DIR]   # also write a cProfile of each run (DIR/<deployment>.prof)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import logging
import sys
import time
from pathlib import Path

from basin_runtime.logs import configure_logging
from basin_runtime.session_table import Session
from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.experiments.calibrate.rates import DEFAULT_RATES_FILE, RateCache, rate_key
from basin_sim.policies import PolicyContext, make_policy
from basin_sim.profile import Deployment
from basin_sim.simulate import ArrivalFeed, advance, sparse_gc
from basin_sim.timeline import Timeline
from basin_sim.workload.pool import DEFAULT_SESSIONS, load_pool, workload_pool
from basin_sim.workload.scenarios import RateStep, Scenario, generate_sessions

LOAD_FRACTION = 0.5  # of 1P3D's overload rate: the steady scenario's load
TICK_S, STEP_S = 10.0, 60.0  # as run_scenario (RunSpec.tick_s, RunSpec.step_s)


@dataclasses.dataclass(frozen=True)
class ScaleRun:
    """What one run cost and what it did."""

    wall_s: float
    cpu_s: float  # this process's CPU time: steadier than wall time on a shared machine
    sessions: int  # arrived, warm-up included
    finished: int
    calls: int
    hit_rate: float | None  # prefill hit rate over the measured hour
    live_per_decode: float  # mean live sessions per decode instance at the timeline's samples in the hour

    @property
    def ms_per_session(self) -> float:
        """Wall milliseconds per arrived session."""
        return 1000 * self.wall_s / self.sessions

    @property
    def cpu_ms_per_session(self) -> float:
        """CPU milliseconds per arrived session."""
        return 1000 * self.cpu_s / self.sessions


def run_hour(deployment: Deployment, pool: list[Session], per_min: float, hours: float, warmup_s: float, seed: int,
             profile_out: Path | None) -> ScaleRun:
    """Simulate warm-up + `hours` of steady arrivals at `per_min` under `sglang`; time the engine's work."""
    duration_s = hours * 3600.0
    scenario = Scenario("scale", duration_s=duration_s, warmup_s=warmup_s, goodput_from_s=0.0,
                        goodput_to_s=duration_s, rate=(RateStep(0.0, per_min=per_min),))
    sessions = generate_sessions(scenario, pool, 0.0, seed)
    profiler = cProfile.Profile() if profile_out is not None else None
    started, started_cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    engine = Engine(deployment, make_policy("sglang", PolicyContext(deployment)), timeline=Timeline(60.0),
                    tick_s=TICK_S, router_seed=seed, clients=scenario.clients, client_seed=seed)
    feed, end_s = ArrivalFeed(engine, sessions), scenario.engine_s(duration_s)
    with sparse_gc():  # as run_scenario does
        advance(engine, end_s, STEP_S, feed=feed)
    if profiler is not None:
        profiler.disable()
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    if profiler is not None and profile_out is not None:
        profile_out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(profile_out / f"{deployment.name}.prof")
    hour = (scenario.engine_s(0.0), scenario.engine_s(duration_s))
    live = [s.live_sessions for s in engine.timeline.samples if hour[0] <= s.time_s < hour[1]]
    return ScaleRun(wall_s, cpu_s, len(sessions), sum(run.ended_s is not None for run in engine.runs.values()),
                    sum(run.next_call for run in engine.runs.values()), engine.timeline.hit_rate(*hour),
                    sum(live) / len(live) / deployment.num_decode if live else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", default="1p3d-h100", help="the deployment whose overload rate sets the load")
    parser.add_argument("--large", default="100p300d", help="run at --scale x the small one's rate")
    parser.add_argument("--scale", type=float, default=100.0)
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours after the warm-up")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sessions", type=Path, default=DEFAULT_SESSIONS)
    parser.add_argument("--rates-file", type=Path, default=DEFAULT_RATES_FILE, help="the overload-rate cache")
    parser.add_argument("--overload-rate", type=float, help="the small deployment's overload rate (skip the cache)")
    parser.add_argument("--profile-out", type=Path, help="write a cProfile of each run here")
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING)
    steady = catalog.load_scenario("steady")
    base, workload = load_pool(args.sessions, use_synthetic=False)
    pool = workload_pool(base, steady.workload)
    small = catalog.load_deployment(args.small).build("gpu")
    large = catalog.load_deployment(args.large).build("gpu")
    if args.overload_rate is not None:
        overload, source = args.overload_rate, "--overload-rate"
    else:
        overload = RateCache(args.rates_file).get(rate_key(small, steady.workload, steady.clients, pool))
        source = str(args.rates_file)
    if overload is None:
        print(f"no overload rate of {small.name} for this workload in {args.rates_file}: run `basin-sim calibrate "
              f"--deployment {small.name} --scenario steady`, or pass --rates-file or --overload-rate", file=sys.stderr)
        return 2
    per_min = LOAD_FRACTION * overload * 60.0
    print(f"workload {workload} ({len(pool)} pool sessions); {small.name} overload rate {overload:.4f}/s "
          f"({source}); {small.name} at {LOAD_FRACTION:g} x = {per_min:.3f}/min, {large.name} at "
          f"{args.scale:g} x that = {args.scale * per_min:.2f}/min; {steady.warmup_s:.0f} s warm-up + "
          f"{args.hours:g} h, policy sglang, seed {args.seed}")
    print(f"{'deployment':>10} {'sessions':>9} {'finished':>9} {'calls':>9} {'hit rate':>9} {'live/decode':>12} "
          f"{'wall s':>8} {'ms/session':>11} {'cpu s':>8} {'cpu ms/session':>15}")
    results = {}
    for deployment, rate in ((small, per_min), (large, args.scale * per_min)):
        run = results[deployment.name] = run_hour(deployment, pool, rate, args.hours, steady.warmup_s, args.seed,
                                                  args.profile_out)
        hit = "-" if run.hit_rate is None else f"{run.hit_rate:.3f}"
        print(f"{deployment.name:>10} {run.sessions:>9d} {run.finished:>9d} {run.calls:>9d} {hit:>9} "
              f"{run.live_per_decode:>12.2f} {run.wall_s:>8.2f} {run.ms_per_session:>11.3f} {run.cpu_s:>8.2f} "
              f"{run.cpu_ms_per_session:>15.3f}", flush=True)
    one, many = results[small.name], results[large.name]
    print(f"per-session cost {large.name} / {small.name}: {many.ms_per_session / one.ms_per_session:.2f}x wall, "
          f"{many.cpu_ms_per_session / one.cpu_ms_per_session:.2f}x cpu (target <= 1.5x); {small.name} hour "
          f"{one.wall_s:.1f} s (target < 10 s), {large.name} hour {many.wall_s:.1f} s (target < 300 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay agent sessions through a surge on emulated PD SGLang, without and with the Basin gateway.

`make demo`: Basin as a system on this CPU: emulated SGLang engines (1P3D), the real router (smg),
the gateway, and replayed agent sessions through a surge, once without the gateway and once with it.

Rules:
- The deployment is the shipped profile with a smaller KV pool (`--cache-tokens`, every engine's
  --max-total-tokens) so that a few dozen live sessions fill the prefix cache; the load is the paper's:
  half the overload rate of THAT deployment (the simulator's, as `basin-sim calibrate` measures it),
  doubled during the surge. The gateway's calibration (knee, reservation ratio, peak completion rate)
  is the simulator's knee ramp on the same deployment and model. Both come from the simulator's caches
  (--rates-file, --calibrations-file: keyed by deployment shape, pool, predictor file, quantile and
  lending switch), measured on first use (minutes) and reused by every later demo and `basin-sim` run.
- Both runs replay the same planned sessions (same seed and tag: the same text); each run gets a
  fresh stack (empty caches). The runs are judged with the simulator's goodput (basin_sim.goodput).
- Validity: the emulators report how late their timed events fire (wall seconds). A run whose p99
  lag x time scale exceeds `--max-lag-model-s` is INVALID (the emulator, not the model, slowed it):
  the table says so and the exit status is 3. Lower --time-scale then.
- `--lending storage-offload`: the two runs are both with the gateway, on engines started with the
  lending recipe (rig/basin_stack/lending.py: HiCache storage on prefill, a fresh shared storage folder per
  run, smg's sticky sessions), and differ by decode's offload flag alone: "lending-off" and
  "lending-on". Each run's gateway reads a calibration measured by the simulator's knee ramp on the
  deployment with its own lending switch (none, storage-offload), never a nominal storage size; the
  arrivals are the same in both (the overload rate of the shape without lending, as in the simulator).
- The table counts every planned session once: finished, shed, aborted, error or unfinished (still
  running at the end, or never started), the shed share on its own line; a run whose hit rate before
  the surge was already more than 0.1 under the steady reference (the calibration's plateau: this
  deployment's hit rate under steady load below its knee) is flagged COLLAPSED BEFORE THE SURGE.
- `--keep-up`: no replay; the stack with the gateway is started and left running, its URLs and an
  `openai` snippet printed, until Ctrl-C.
- Everything started is stopped at the end, on Ctrl-C and on SIGTERM (basin_stack.stack).
- Output in --out-dir: calibration.json, run-<mode>.json, timeline-<mode>.png, comparison.png,
  summary.md, logs/<mode>/*.log, and the gateway's session log (gateway-log/, for the closed loop).
  A new demo first removes the previous one's logs/ and gateway-log/ (the same session ids again
  would otherwise be logged twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from basin_runtime.logs import configure_logging
from basin_runtime.markdown_table import markdown_table
from basin_sim.workload.pool import load_pool

log = logging.getLogger("basin_stack.demo")
MODES = ("without", "with")
LENDING_MODES = ("lending-off", "lending-on")  # --lending storage-offload: both with the gateway


@dataclass(frozen=True)
class DemoSettings:
    """What the demo runs."""

    out_dir: Path
    sessions: Path
    synthetic: bool = False
    time_scale: float = 15.0
    cache_tokens: int = 325_000
    duration_s: float = 3000.0
    surge: tuple[float, float, float] = (900.0, 1800.0, 2.0)
    load_fraction: float = 0.5
    seed: int = 1
    max_sessions: int | None = None
    max_lag_model_s: float = 2.0
    modes: tuple[str, ...] = MODES
    model: Path = Path("models/peak_predictor.onnx")
    lending: str = "none"  # storage-offload: compare decode offload off and on (LENDING_MODES)
    rates_file: Path = Path("data/sim/overload_rates.json")  # the simulator's caches (basin_sim/calibrate)
    calibrations_file: Path = Path("data/sim/calibrations.json")
    keep_up: bool = False  # start the stack with the gateway, print how to reach it, run until Ctrl-C


@dataclass
class LagWatch:
    """Polls the stack's engines for their scheduler lag while a run goes on; keeps the worst."""

    stack: Any
    period_s: float = 2.0
    worst_p99_s: float = 0.0
    worst_max_s: float = 0.0
    polls: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> LagWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._poll()

    def _poll(self) -> None:
        try:
            lags = self.stack.lag()
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:  # an engine gone mid-poll: not the demo's
            log.debug("lag poll failed: %s", exc)
            return
        for lag in lags.values():
            if lag.get("count", 0):
                self.worst_p99_s = max(self.worst_p99_s, float(lag["p99_s"]))
                self.worst_max_s = max(self.worst_max_s, float(lag["max_s"]))
        self.polls += 1


DEMO_RESERVATION_QUANTILE = 0.9  # the gateway's default; its calibration's r is measured at it


def demo_deployment(cache_tokens: int) -> Any:
    """1P3D of the shipped profile with every KV pool set to `cache_tokens`."""
    from basin_sim import catalog
    from basin_sim.profile import Deployment

    spec = catalog.load_deployment("1p3d-h100")
    profile = dataclasses.replace(spec.profile, kv_pool_tokens=cache_tokens)
    return Deployment.of(f"demo-1p3d-h100-{cache_tokens}", profile, spec.num_prefill, spec.num_decode, "gpu")


DEMO_SCENARIO_NAME = "demo"  # the knee cache's scenario label; its key reads only the workload and client knobs


def calibrate(settings: DemoSettings, pool: Any, deployment: Any) -> dict[str, Any]:
    """Overload rate and the gateway's calibration for the demo deployment, from the simulator's caches.

    The overload rate is the simulator's (basin_sim/experiments/calibrate/rates.py): measured once per deployment shape
    without lending and pool, so both lending switches see the same arrivals; the knee ramp's record is cached
    per lending switch, predictor file and quantile (knee_cache.py). A missing entry is measured now (minutes)
    and kept in --rates-file / --calibrations-file, shared with `basin-sim`."""
    from basin_runtime.model_files import file_sha256
    from basin_sim.clients import ClientPolicy
    from basin_sim.experiments.calibrate.knee_cache import KneeCache, cached_knee_calibration
    from basin_sim.experiments.calibrate.rates import RateCache, overload_rate_for
    from basin_sim.experiments.predictions import load_predictor, revised_tag
    from basin_sim.experiments.run_setup import Inputs, reserving_for
    from basin_sim.workload.scenarios import RateStep, Scenario

    started = time.perf_counter()
    scenario = Scenario(DEMO_SCENARIO_NAME, duration_s=settings.duration_s, warmup_s=0.0, goodput_from_s=0.0,
                        goodput_to_s=settings.duration_s, rate=(RateStep(0.0, 1.0),))
    rate, rate_source = overload_rate_for(deployment, pool, scenario.workload, ClientPolicy(),
                                          RateCache(settings.rates_file))
    predictor, inputs = load_predictor(settings.model), Inputs(predictions="in-sample")
    # the shipped model's peaks, m(q) x each, revised at its online model's slots: as the gateway reserves
    told = reserving_for(predictor, pool, 1.0, inputs, DEMO_RESERVATION_QUANTILE, inputs.revise_at(predictor))
    revised = told.revised()
    knee, knee_source = cached_knee_calibration(deployment, pool, scenario, rate, file_sha256(settings.model),
                                                DEMO_RESERVATION_QUANTILE, told.reserved(),
                                                KneeCache(settings.calibrations_file), revised=revised or None,
                                                revised_tag=revised_tag(revised))
    log.info("simulator: overload rate %.4f sessions/s (%s), knee %d tokens, reservation ratio %s (%s, lending %s; "
             "%.0f s)", rate, rate_source, knee.calibration.knee_tokens, knee.record.get("reservation_ratio"),
             knee_source, deployment.lending, time.perf_counter() - started)
    return {"overload_rate_per_s": rate, "gateway": dict(knee.record)}


def gateway_options(settings: DemoSettings, calibration_file: Path, session_log: Path) -> dict[str, Any]:
    """The gateway's config (model seconds; the stack scales it to the wall clock)."""
    models = [str(settings.model.resolve())]  # the config file's folder is not the project: absolute paths
    for path in sorted(settings.model.resolve().parent.glob("peak_predictor-*.onnx")):
        if path.name.endswith(".online.onnx"):  # loaded beside its first-call model, never on its own
            continue
        models.append(f"{path.stem.removeprefix('peak_predictor-')}={path}")
    measured = json.loads(calibration_file.read_text(encoding="utf-8"))
    policy = {}
    if "peak_completion_rate_per_s" in measured:  # model units: the stack scales the policy section
        policy["peak_completion_rate_per_s"] = measured["peak_completion_rate_per_s"]
    return {"model": models, "calibration": str(calibration_file.resolve()), "policy": policy,
            "reservation_quantile": DEMO_RESERVATION_QUANTILE,
            "session_log": str(session_log.resolve()), "session_log_keep_text": True,  # the demo retrains from it
            "upstream_timeout_s": 3600.0, "log_level": "warning"}


def stack_spec(settings: DemoSettings, mode: str, gateway: dict[str, Any] | None) -> Any:
    """The stack of one run: the plain 1P3D, or (lending modes) the lending recipe with or without decode offload."""
    from basin_stack import lending
    from basin_stack.stack import StackSpec

    out = settings.out_dir
    spec = StackSpec(out / "logs" / mode, 1, 3, settings.time_scale, settings.cache_tokens, gateway=gateway)
    if mode not in LENDING_MODES:
        return spec
    storage = out / "storage" / mode
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    return dataclasses.replace(spec, prefill_args=lending.prefill_args(),
                               decode_args=lending.decode_args(with_offload=mode == "lending-on"),
                               engine_env=lending.storage_env(storage.resolve()), router_args=lending.SMG_ARGS)


def run_one(settings: DemoSettings, mode: str, pool: Any, deployment: Any, rate_per_s: float,
            calibration_file: Path) -> dict[str, Any]:
    """One replay through a fresh stack; the run's summary with its lag verdict."""
    from basin_loadgen.replay import ConversationBuilder, RateSchedule, plan_sessions, unloaded_times
    from basin_loadgen.replay_client import ClientSettings, Replayer
    from basin_loadgen.replay_plots import plot_timeline
    from basin_loadgen.replay_summary import records_json, summarize, windows_for
    from basin_runtime.tokenizer import get_tokenizer
    from basin_stack.stack import LocalStack

    out = settings.out_dir
    schedule = RateSchedule.steady(rate_per_s, settings.duration_s, settings.surge)
    tag = f"demo-s{settings.seed}"
    planned = plan_sessions(pool, schedule, settings.seed, tag, max_sessions=settings.max_sessions)
    unloaded = unloaded_times(planned, pool, deployment)
    gateway = gateway_options(settings, calibration_file, out / "gateway-log" / "sessions.jsonl") \
        if mode != "without" else None
    spec = stack_spec(settings, mode, gateway)
    wall = settings.duration_s / settings.time_scale
    print(f"[{mode} gateway] starting 1 prefill + 3 decode emulators, smg{' and the gateway' if gateway else ''}; "
          f"replaying {len(planned)} sessions over {settings.duration_s:.0f} model s (~{wall:.0f} s wall + drain)",
          file=sys.stderr)
    with LocalStack(spec) as stack:
        client = ClientSettings(f"{stack.base_url}/v1", time_scale=settings.time_scale,
                                max_wait_s=max(60.0, 3600.0 / settings.time_scale), end_sessions=gateway is not None,
                                max_drain_s=1800.0)
        progress = _Progress(len(planned), mode)
        replayer = Replayer(client, ConversationBuilder(pool, get_tokenizer(), tag), progress.step)
        with LagWatch(stack) as lag:
            asyncio.run(replayer.run(planned, unloaded))
        progress.close()
    records = [replayer.records[p.run_id] for p in planned if p.run_id in replayer.records]
    summary = summarize(records, replayer.samples, windows_for(settings.duration_s, settings.surge),
                        time_scale=settings.time_scale)
    lag_model_s = lag.worst_p99_s * settings.time_scale
    summary.update(mode=mode, sessions_planned=len(planned), lag_p99_wall_s=lag.worst_p99_s,
                   lag_max_wall_s=lag.worst_max_s, lag_p99_model_s=lag_model_s,
                   valid=lag_model_s <= settings.max_lag_model_s)
    (out / f"run-{mode}.json").write_text(json.dumps({"summary": summary, "sessions": records_json(records)}) + "\n")
    plot_timeline(summary, out / f"timeline-{mode}.png", title=f"demo: {_title(mode)}")
    return summary


class _Progress:
    def __init__(self, total: int, mode: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="session", desc=f"{mode} gateway: sessions over", file=sys.stderr)

    def step(self, _: object) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _post(summary: dict[str, Any], key: str, digits: int) -> str:
    return _num(summary["windows"].get("post", {}).get(key), digits)


COLLAPSED_DROP = 0.1  # a pre-surge hit rate this far under the steady reference: collapsed before the surge


def session_counts(s: dict[str, Any]) -> dict[str, int]:
    """Every planned session in exactly one class: finished, shed, aborted, error, or unfinished (still running
    at the end, or never started)."""
    counts = {k: int(s["status_counts"].get(k, 0)) for k in ("finished", "shed", "aborted", "error")}
    counts["unfinished"] = int(s.get("sessions_planned", sum(s["status_counts"].values()))) - sum(counts.values())
    return counts


def collapsed_before_surge(s: dict[str, Any], steady_hit_rate: float | None) -> bool:
    """The run's hit rate before the surge was already more than 0.1 under the steady reference."""
    pre = s["windows"].get("pre", {}).get("hit_rate")
    return steady_hit_rate is not None and pre is not None and pre < steady_hit_rate - COLLAPSED_DROP


def _row_cells(s: dict[str, Any], steady_hit_rate: float | None) -> list[tuple[str, str]]:
    counts = session_counts(s)
    planned = sum(counts.values())
    pre = _num(s["windows"].get("pre", {}).get("hit_rate"), 2)
    if collapsed_before_surge(s, steady_hit_rate):
        pre += " COLLAPSED BEFORE THE SURGE"
    return [
        ("goodput after the surge (sessions/h)", _num(s["goodput_per_hour"])),
        (f"hit rate before the surge (steady reference {_num(steady_hit_rate, 2)})", pre),
        ("hit rate during the surge", _num(s["windows"].get("surge", {}).get("hit_rate"), 2)),
        ("hit rate after the surge", _post(s, "hit_rate", 2)),
        ("TTFT p50 / p90 after the surge (model s)", f"{_post(s, 'ttft_p50_s', 2)} / {_post(s, 'ttft_p90_s', 2)}"),
        ("admission wait p50 / p90 (model s)",
         f"{_num(s['admission_wait_p50_s'], 1)} / {_num(s['admission_wait_p90_s'], 1)}"),
        ("sessions planned", f"{planned:,}"),
        ("finished / shed / aborted / error / unfinished",
         " / ".join(str(counts[k]) for k in ("finished", "shed", "aborted", "error", "unfinished"))),
        ("shed share (of sessions planned)", f"{counts['shed'] / planned:.0%}" if planned else "n/a"),
        ("emulator lag p99 (model s)", f"{s['lag_p99_model_s']:.2f}" + ("" if s["valid"] else " INVALID")),
    ]


def table(runs: dict[str, dict[str, Any]], steady_hit_rate: float | None = None) -> str:
    """The side-by-side Markdown table of the runs; `steady_hit_rate` is the reference a run's pre-surge hit rate
    is held to (the calibration's plateau: the hit rate of this deployment under steady load below its knee)."""
    modes = list(runs)
    cells = {m: _row_cells(runs[m], steady_hit_rate) for m in modes}
    rows = ([label, *(cells[m][k][1] for m in modes)] for k, (label, _) in enumerate(cells[modes[0]]))
    return markdown_table([None, *(_title(m) for m in modes)], rows)


def _title(mode: str) -> str:
    """A run's column title: "with gateway", or "lending-on" (decode offload, with the gateway)."""
    return mode if mode in LENDING_MODES else f"{mode} gateway"


def _num(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def comparison_plot(runs: dict[str, dict[str, Any]], settings: DemoSettings, path: Path) -> Path:
    """Hit rate and live sessions per minute of both runs, the surge shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for mode, summary in runs.items():
        rows = summary["timeline"]
        minutes = [r["start_s"] / 60 for r in rows]
        axes[0].plot(minutes, [r["hit_rate"] for r in rows], label=_title(mode))
        axes[1].plot(minutes, [r["live_sessions"] for r in rows], label=_title(mode))
    for ax in axes:
        ax.axvspan(settings.surge[0] / 60, settings.surge[1] / 60, color="orange", alpha=0.15, label="surge")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("prefix hit rate")
    axes[1].set_ylabel("live sessions")
    axes[1].set_xlabel("model minutes")
    axes[0].legend(loc="lower left")
    fig.suptitle("emulated 1P3D SGLang + smg: the same replayed sessions, " + " vs ".join(_title(m) for m in runs))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo(settings: DemoSettings) -> int:
    """Calibrate, run every mode, print and write the comparison; 3 if a run was invalid."""

    out = settings.out_dir
    for previous in (out / "logs", out / "gateway-log"):
        shutil.rmtree(previous, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    pool, workload = load_pool(settings.sessions, settings.synthetic)
    deployment = demo_deployment(settings.cache_tokens)
    measured = calibrate(settings, pool, deployment)
    calibration_file = out / "calibration.json"
    calibration_file.write_text(json.dumps(measured["gateway"], indent=2) + "\n")
    calibrations = {mode: calibration_file for mode in settings.modes}
    if "lending-on" in settings.modes:  # the budget grows only by what the knee ramp measures with storage on
        lent = calibrate(settings, pool, dataclasses.replace(deployment, lending="storage-offload"))
        calibrations["lending-on"] = out / "calibration-storage-offload.json"
        calibrations["lending-on"].write_text(json.dumps(lent["gateway"], indent=2) + "\n")
    rate = settings.load_fraction * measured["overload_rate_per_s"]
    if settings.keep_up:
        return keep_up(settings, calibration_file)
    runs = {mode: run_one(settings, mode, pool, deployment, rate, calibrations[mode]) for mode in settings.modes}
    steady = measured["gateway"].get("hit_rate_plateau")
    text = (f"Demo ({workload} sessions, seed {settings.seed}, time scale {settings.time_scale:g}, cache "
            f"{settings.cache_tokens:,} tokens per engine, {rate:.4f} sessions/s, x{settings.surge[2]:g} from "
            f"{settings.surge[0]:.0f} to {settings.surge[1]:.0f} model s)\n\n{table(runs, steady)}\n")
    collapsed = [_title(m) for m, r in runs.items() if collapsed_before_surge(r, steady)]
    if collapsed:
        text += (f"\n{', '.join(collapsed)}: the hit rate before the surge was already more than {COLLAPSED_DROP:g} "
                 f"under the steady reference ({steady:.2f}): collapsed before its surge, so the surge is not what "
                 f"this run measures.\n")
    print(text)
    (out / "summary.md").write_text(text, encoding="utf-8")
    comparison_plot(runs, settings, out / "comparison.png")
    print(f"wrote {out}/summary.md, comparison.png, timeline-*.png, run-*.json; gateway session log in "
          f"{out}/gateway-log/", file=sys.stderr)
    if not all(r["valid"] for r in runs.values()):
        print(f"INVALID: emulator lag over {settings.max_lag_model_s:g} model s; rerun with a lower --time-scale",
              file=sys.stderr)
        return 3
    return 0


def keep_up(settings: DemoSettings, calibration_file: Path) -> int:
    """The demo's stack with the gateway, left running for exploration until Ctrl-C (or SIGTERM)."""
    from basin_stack.stack import LocalStack

    out = settings.out_dir
    gateway = gateway_options(settings, calibration_file, out / "gateway-log" / "sessions.jsonl")
    with LocalStack(stack_spec(settings, "with", gateway)) as stack:
        print(keep_up_text(stack, settings), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()  # until Ctrl-C; the stack stops every process on the way out
    return 0


def keep_up_text(stack: Any, settings: DemoSettings) -> str:
    """Where each part of a kept-up stack listens, and how to talk to it."""
    engines = "\n".join(f"  {role} engine  {url}  (/server_info, /metrics)"
                         for role, urls in (("prefill", stack.prefill_urls), ("decode", stack.decode_urls))
                         for url in urls)
    scale = settings.time_scale
    return f"""The demo stack is up (time scale {scale:g}: model seconds per wall second); Ctrl-C stops it.
  gateway  {stack.gateway_url}  (/metrics, /basin/state, /basin/sessions)
  router   {stack.router_url}  (smg, PD mode: /workers, /readiness)
{engines}
  logs     {settings.out_dir / "logs" / "with"}

  curl -s {stack.gateway_url}/metrics | grep '^basin_'
  .venv/bin/python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{stack.gateway_url}/v1", api_key="none")
answer = client.chat.completions.create(
    model=client.models.list().data[0].id, max_tokens=32,
    messages=[{{"role": "user", "content": "Fix the failing test in parser.py"}}],
    extra_headers={{"X-Session-ID": "try-1"}})
print(answer.choices[0].message.content, answer.usage)
PY
  curl -s -X POST {stack.gateway_url}/basin/sessions/try-1/end"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m basin_stack.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=Path("data/demo"))
    p.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    p.add_argument("--synthetic", action="store_true", help="replay the synthetic corpus")
    p.add_argument("--time-scale", type=float, default=DemoSettings.time_scale)
    p.add_argument("--cache-tokens", type=int, default=DemoSettings.cache_tokens, help="every engine's KV pool")
    p.add_argument("--duration-s", type=float, default=DemoSettings.duration_s, help="model seconds of arrivals")
    p.add_argument("--surge", type=float, nargs=3, default=DemoSettings.surge, metavar=("START", "END", "FACTOR"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-sessions", type=int)
    p.add_argument("--max-lag-model-s", type=float, default=DemoSettings.max_lag_model_s)
    p.add_argument("--only", choices=MODES + LENDING_MODES, help="run one mode only")
    p.add_argument("--lending", choices=("none", "storage-offload"), default="none",
                   help="storage-offload: compare decode KV offload off and on, both with the gateway, on engines "
                        "started with the lending recipe (deploy/sglang-pd-lending.md)")
    p.add_argument("--model", type=Path, default=DemoSettings.model)
    p.add_argument("--rates-file", type=Path, default=DemoSettings.rates_file,
                   help="overload-rate cache shared with basin-sim (measured on first use)")
    p.add_argument("--calibrations-file", type=Path, default=DemoSettings.calibrations_file,
                   help="knee-calibration cache shared with basin-sim (measured on first use)")
    p.add_argument("--keep-up", action="store_true",
                   help="replay nothing: start the emulated engines, smg and the gateway, print their URLs and an "
                        "openai snippet, and keep them running until Ctrl-C (`make demo DEMO_ARGS=--keep-up`)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit status 0, 2 (bad input or a process that would not start), 3 (invalid run)."""
    from basin_loadgen.replay_client import HTTP_LOGGERS, ReplayError
    from basin_runtime.predictor import PredictorError
    from basin_sim.catalog import CatalogError
    from basin_sim.experiments.calibrate.rates import RatesError
    from basin_sim.workload.pool import PoolError
    from basin_stack.stack import StackError

    args = _parser().parse_args(argv)
    configure_logging(quiet=HTTP_LOGGERS)
    settings = DemoSettings(args.out_dir, args.sessions, args.synthetic, args.time_scale, args.cache_tokens,
                            args.duration_s, tuple(args.surge), seed=args.seed, max_sessions=args.max_sessions,
                            max_lag_model_s=args.max_lag_model_s, model=args.model, lending=args.lending,
                            rates_file=args.rates_file, calibrations_file=args.calibrations_file, keep_up=args.keep_up,
                            modes=(args.only,) if args.only else LENDING_MODES if args.lending != "none" else MODES)
    try:
        return run_demo(settings)
    except (StackError, ReplayError, CatalogError, PredictorError, RatesError, PoolError) as exc:
        print(f"python -m basin_stack.demo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; every process the demo started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

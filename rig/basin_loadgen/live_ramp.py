"""Stepped load ramp on a live deployment: hit rate vs working set per step, the knee, the calibration file.

The knee ramp against a live deployment over HTTP (basin_sim/ramp.py is the simulated one).

Rules:
- Steps k = 0..n-1 cover model time [k x step_s, (k+1) x step_s) with Poisson arrivals at rate r_k;
  sessions stay open across steps (one replay, as ramp.py keeps one engine). The run stops at the
  end of the last step and cancels whatever is still running.
- Each step is measured over its second half [half, end): the engines' `/metrics` (every URL given,
  counters summed) are scraped at `half` and at `end`; hit rate = window_hit_rate of the two scrapes
  (0 when nothing was prefilled). Load = mean over the replayer's state samples in the half of the
  live sessions' summed latest prompts (the working set, as the simulator's engine counts it) /
  cache capacity. Live sessions = mean of the samples; calls/s = calls whose first token came in the
  half / its length; sessions finished/s likewise; decode busy share = mean calls in flight / mean
  live sessions (the client's view: in flight includes queued prefill); the standard error of calls/s
  from its per-minute rates (model minutes; None under two whole minutes), the completion peak's noise.
- Cache capacity = `--cache-capacity-tokens`, else the sum of `sglang:max_total_num_tokens` over the
  metrics URLs (give the prefill engines' URLs: that is where the prefix cache that hits lives).
- The calibration file has the keys basin_runtime/gateway/calibration.py accepts: knee_tokens,
  cache_capacity_tokens, hit_rate_plateau, peak_completion_rate_per_s (the highest finished rate on
  the plateau, when > 0), completion_peak_tokens (where calls/s stop rising, completion_peak.py),
  notes. No reservation_ratio: the live ramp does not run the predictor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from basin_loadgen.metrics_scrape import TokenCounters, parse_counters, window_hit_rate
from basin_loadgen.replay import ConversationBuilder, PlannedSession, RateSchedule, plan_sessions
from basin_loadgen.replay_client import ClientSettings, Replayer, ReplayError, default_run_tag, run_cli
from basin_loadgen.replay_summary import SessionRecord, StateSample
from basin_runtime.policy.capacity import pooled_tokens
from basin_sim.experiments.calibrate.completion_peak import rate_standard_error
from basin_sim.experiments.calibrate.ramp import RampStep, ramp_knee
from basin_sim.experiments.calibrate.ramp import calibration_record as ramp_calibration_record
from basin_sim.workload.pool import load_pool

log = logging.getLogger(__name__)

CAPACITY_GAUGE = "sglang:max_total_num_tokens"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def gauge_total(text: str, name: str) -> float | None:
    """Sum of every sample line of metric `name` in Prometheus text (None when there is none)."""
    values = [float(m["value"]) for line in text.splitlines()
              if not line.startswith("#") and (m := _SAMPLE.match(line.strip())) and m["name"] == name]
    return sum(values) if values else None


async def fetch_metrics(http: httpx.AsyncClient, urls: Sequence[str]) -> list[str]:
    """The /metrics text of every URL; `ReplayError` naming the one that failed."""
    async def one(url: str) -> str:
        try:
            response = await http.get(url)
        except httpx.HTTPError as exc:
            raise ReplayError(f"cannot scrape {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ReplayError(f"cannot scrape {url}: HTTP {response.status_code}")
        return response.text

    return list(await asyncio.gather(*(one(url) for url in urls)))


def total_counters(texts: Sequence[str], urls: Sequence[str]) -> TokenCounters:
    """Cached and prompt-token counters summed over engines."""
    cached = total = 0.0
    for text, url in zip(texts, urls, strict=True):
        try:
            counters = parse_counters(text)
        except ValueError as exc:
            raise ReplayError(f"{url}: {exc}") from exc
        cached, total = cached + counters.cached_tokens, total + counters.total_tokens
    return TokenCounters(cached, total)


def measure_step(rate_per_s: float, half_s: float, end_s: float, before: TokenCounters, after: TokenCounters,
                 samples: Sequence[StateSample], records: Sequence[SessionRecord], capacity_tokens: float) -> RampStep:
    """One step's point, measured over [half_s, end_s)."""
    inside = [s for s in samples if half_s <= s.time_s < end_s]
    working = statistics.fmean(s.working_set_tokens for s in inside) if inside else 0.0
    live = statistics.fmean(s.live_sessions for s in inside) if inside else 0.0
    in_flight = statistics.fmean(s.calls_in_flight for s in inside) if inside else 0.0
    span = end_s - half_s
    firsts = sorted(c.first_token_s for r in records for c in r.calls
                    if c.first_token_s is not None and c.error is None and half_s <= c.first_token_s < end_s)
    ttfts = [c.first_token_s - c.sent_s for r in records for c in r.calls
             if c.first_token_s is not None and c.error is None and half_s <= c.first_token_s < end_s]
    done = [r for r in records if r.status == "finished" and r.end_s is not None and half_s <= r.end_s < end_s]
    cycles = [(r.end_s - r.arrival_s) / r.n_calls for r in done if r.end_s is not None and r.n_calls > 0]
    hit = window_hit_rate(before, after)
    return RampStep(rate_per_s, working / capacity_tokens, 0.0 if hit is None else hit, live, len(ttfts) / span,
                    len(done) / span, in_flight / live if live > 0 else 0.0,
                    ttft_p50_s=statistics.median(ttfts) if ttfts else None,
                    call_cycle_p50_s=statistics.median(cycles) if cycles else None,
                    calls_per_s_se=rate_standard_error(firsts, half_s, end_s))


def calibration_record(steps: Sequence[RampStep], capacity_tokens: float, command: str,
                       step_s: float) -> dict[str, Any]:
    """The gateway's calibration file from a live ramp."""
    return ramp_calibration_record(steps, capacity_tokens,
                                   f"{command}: live stepped ramp ({len(steps)} steps of {step_s:g} model s)")


@dataclass(frozen=True)
class LiveRamp:
    """What a live ramp measured."""

    steps: list[RampStep]
    capacity_tokens: float
    records: list[SessionRecord]


async def run_live_ramp(settings: ClientSettings, builder: ConversationBuilder, planned: Sequence[PlannedSession],
                        rates_per_s: Sequence[float], step_s: float, metrics_urls: Sequence[str],
                        capacity_tokens: float | None = None,
                        on_step: Callable[[int, RampStep], None] | None = None) -> LiveRamp:
    """Replay `planned` (arrivals planned on `RateSchedule.steps(rates_per_s, step_s)`) and measure each step."""
    if not metrics_urls:
        raise ReplayError("the live ramp needs at least one engine /metrics URL")
    replayer = Replayer(settings, builder)
    steps: list[RampStep] = []
    async with httpx.AsyncClient(timeout=10.0) as http:
        if capacity_tokens is None:
            texts = await fetch_metrics(http, metrics_urls)
            gauges = [gauge_total(t, CAPACITY_GAUGE) for t in texts]
            missing = [url for url, gauge in zip(metrics_urls, gauges, strict=True) if gauge is None]
            if missing:
                raise ReplayError(f"no {CAPACITY_GAUGE} in {missing}; pass --cache-capacity-tokens")
            capacity_tokens = pooled_tokens(g for g in gauges if g is not None)
        if not capacity_tokens > 0:
            raise ReplayError(f"cache capacity must be > 0 tokens, got {capacity_tokens}")
        capacity = capacity_tokens

        async def observe(r: Replayer) -> None:
            for k, rate in enumerate(rates_per_s):
                half, end = (k + 0.5) * step_s, (k + 1) * step_s
                log.info("step %d/%d: %g arrivals per model s until %g s", k + 1, len(rates_per_s), rate, end)
                await r.sleep_until(half)
                before = total_counters(await fetch_metrics(http, metrics_urls), metrics_urls)
                await r.sleep_until(end)
                after = total_counters(await fetch_metrics(http, metrics_urls), metrics_urls)
                step = measure_step(rate, half, end, before, after, r.samples, list(r.records.values()), capacity)
                steps.append(step)
                if on_step is not None:
                    on_step(k, step)

        records = await replayer.run(planned, stop_s=len(rates_per_s) * step_s, observers=[observe])
    return LiveRamp(steps, capacity, records)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_loadgen.live_ramp", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL the sessions go to (router or engine)")
    parser.add_argument("--engine-metrics", nargs="+", required=True, metavar="URL",
                        help="the prefill engines' /metrics URLs")
    parser.add_argument("--rates", type=float, nargs="+", required=True, help="arrival rates per model second")
    parser.add_argument("--step-s", type=float, required=True, help="model seconds per step")
    parser.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second")
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic corpus")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-tag", help="prefix of the session ids (default: seed and start time)")
    parser.add_argument("--cache-capacity-tokens", type=float,
                        help=f"default: the sum of {CAPACITY_GAUGE} over --engine-metrics")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default="basin-replay")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="wall seconds a call may wait for its "
                        "first token")
    parser.add_argument("--no-end-sessions", dest="end_sessions", action="store_false")
    parser.add_argument("--out", type=Path, help="calibration JSON for the gateway")
    parser.add_argument("--quiet", action="store_true")
    return parser


def _ramp(args: argparse.Namespace) -> int:
    from basin_runtime.tokenizer import get_tokenizer

    rates = list(args.rates)
    if rates != sorted(rates) or rates[0] <= 0 or len(rates) < 2:
        raise ReplayError(f"--rates must be at least two increasing positive rates, got {rates}")
    pool, _ = load_pool(args.sessions, args.synthetic)
    tag = args.run_tag or default_run_tag(args.seed)
    planned = plan_sessions(pool, RateSchedule.steps(rates, args.step_s), args.seed, tag)
    settings = ClientSettings(args.base_url, args.api_key, args.model, args.time_scale, args.max_wait_s,
                              end_sessions=args.end_sessions, sample_s=args.step_s / 40)

    def report(k: int, s: RampStep) -> None:
        print(f"step {k + 1}/{len(rates)}  rate {s.rate_per_s:.4f}/s  load {s.load:.3f}  hit {s.hit_rate:.3f}  "
              f"live {s.live_sessions:.1f}  calls/s {s.calls_per_s:.2f}  finished/s {s.sessions_finished_per_s:.3f}",
              flush=True)

    log.info("live ramp: %d sessions over %d steps of %g model s against %s", len(planned), len(rates),
             args.step_s, args.base_url)
    result = asyncio.run(run_live_ramp(settings, ConversationBuilder(pool, get_tokenizer(), tag), planned, rates,
                                       args.step_s, args.engine_metrics, args.cache_capacity_tokens, report))
    knee = ramp_knee(result.steps)
    censored = " (censored: beyond the last step)" if knee.is_censored else ""
    print(f"knee at load {knee.load:.3f} x {result.capacity_tokens:.0f} tokens = "
          f"{knee.load * result.capacity_tokens:.0f} tokens{censored}; plateau hit rate {knee.plateau_hit_rate:.3f}")
    command = (f"python -m basin_loadgen.live_ramp --base-url {args.base_url} "
               f"--rates {' '.join(f'{r:g}' for r in rates)} "
               f"--step-s {args.step_s:g} --time-scale {args.time_scale:g}")
    record = calibration_record(result.steps, result.capacity_tokens, command, args.step_s)
    print(json.dumps(record, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    try:
        return run_cli(_parser(), argv, _ramp)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

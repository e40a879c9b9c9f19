"""Timeline PNGs of a run: the collapse step by step (hit rate, queues, live sessions, working set,
TTFT, goodput, first-call wait by arrival minute). Writes files; matplotlib is imported here only, with
the Agg backend.

Time runs in minutes from the end of the warm-up, as scenario files count it (`from_s: 900` is minute 15);
the warm-up is the shaded stretch before 0."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from basin_sim.goodput import is_good
from basin_sim.simulate import RunResult

GOODPUT_BIN_S = 600.0


def _minutes(values: list[float], warmup_s: float) -> list[float]:
    """Engine times (s from the start of the warm-up) as minutes from the end of the warm-up."""
    return [(v - warmup_s) / 60.0 for v in values]


def _ttft_medians(result: RunResult) -> tuple[list[float], list[float]]:
    timeline, bin_s = result.timeline, result.timeline.bin_s
    end = timeline.samples[-1].time_s if timeline.samples else 0.0
    times, medians = [], []
    for k in range(int(end // bin_s)):
        values = timeline.ttfts(k * bin_s, (k + 1) * bin_s)
        if values:
            times.append(k * bin_s)
            medians.append(statistics.median(values))
    return times, medians


def _goodput_bins(result: RunResult) -> tuple[list[float], list[float], list[float]]:
    """Sessions/h arrived and good by arrival, in bins from the end of the warm-up (engine times)."""
    scenario = result.spec.scenario
    count = int(scenario.duration_s // GOODPUT_BIN_S)
    arrived, good = [0] * count, [0] * count
    for outcome in result.outcomes:
        index = math.floor((outcome.arrival_s - scenario.warmup_s) / GOODPUT_BIN_S)
        if outcome.is_burst or not 0 <= index < count or outcome.unloaded_s is None:
            continue
        arrived[index] += 1
        good[index] += is_good(outcome)
    per_hour = 3600.0 / GOODPUT_BIN_S
    starts = [scenario.warmup_s + k * GOODPUT_BIN_S for k in range(count)]
    return starts, [a * per_hour for a in arrived], [g * per_hour for g in good]


def _panels(result: RunResult, axes: Any) -> None:
    timeline, deployment, warmup_s = result.timeline, result.spec.deployment, result.spec.scenario.warmup_s
    t = _minutes(timeline.series("time_s"), warmup_s)
    bins = timeline.bin_hit_rates(0.0, timeline.samples[-1].time_s if timeline.samples else 0.0)
    axes[0].plot(_minutes([b for b, r in bins if r is not None], warmup_s), [r for _, r in bins if r is not None],
                 lw=1)
    axes[0].set_ylabel("hit rate\n(per min)")
    axes[0].set_ylim(0, 1.02)
    axes[1].plot(t, timeline.series("prefill_waiting"), label="prefill queue", lw=1)
    axes[1].plot(t, timeline.series("decode_queued"), label="decode pre-alloc queue", lw=1)
    axes[1].plot(t, timeline.series("decode_running"), label="decoding", lw=1)
    axes[1].set_ylabel("requests")
    axes[1].legend(loc="upper left", fontsize=7)
    axes[2].plot(t, timeline.series("live_sessions"), label="live", lw=1)
    axes[2].plot(t, timeline.series("held_sessions"), label="held at the door", lw=1)
    axes[2].set_ylabel("sessions N(t)")
    axes[2].legend(loc="upper left", fontsize=7)
    capacity = deployment.cache_capacity_tokens / 1e6
    axes[3].plot(t, [w / 1e6 for w in timeline.series("working_set_tokens")], label="working set", lw=1)
    axes[3].axhline(capacity, color="k", ls="--", lw=1, label="GPU cache")
    if deployment.has_host_tier:
        host = capacity + deployment.host_capacity_tokens / 1e6
        axes[3].axhline(host, color="grey", ls=":", lw=1, label="GPU + host tier")
    axes[3].set_ylabel("M tokens")
    axes[3].legend(loc="upper left", fontsize=7)
    ttft_t, ttft = _ttft_medians(result)
    axes[4].semilogy(_minutes(ttft_t, warmup_s), ttft, lw=1)
    axes[4].set_ylabel("TTFT p50 (s)")
    starts, arrived, good = _goodput_bins(result)
    width = GOODPUT_BIN_S / 60 * 0.8
    axes[5].bar(_minutes(starts, warmup_s), arrived, width=width, align="edge", color="lightgrey", label="arrived")
    axes[5].bar(_minutes(starts, warmup_s), good, width=width, align="edge", label="good")
    axes[5].set_ylabel("sessions/h\n(by arrival)")
    axes[5].legend(loc="upper left", fontsize=7)
    waits = [(e["t_s"] / 60.0, e["first_call_wait_p50_s"]) for e in result.run_summary.timeline
             if e["first_call_wait_p50_s"] is not None]  # summary times: already from the end of the warm-up
    axes[6].semilogy([m for m, _ in waits], [max(w, 1e-2) for _, w in waits], lw=1, marker=".", ms=3)
    axes[6].set_ylabel("first-call wait\np50 (s, by\narrival minute)")


def plot_run(result: RunResult, out_dir: Path) -> Path:
    """Write the run's timeline figure into `out_dir`; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, scenario = result.run_summary, result.spec.scenario
    fig, axes = plt.subplots(7, 1, figsize=(10, 15), sharex=True)
    _panels(result, axes)
    for ax in axes:  # scenario times are already counted from the end of the warm-up
        if scenario.pre_end_s < scenario.last_change_s:
            ax.axvspan(scenario.pre_end_s / 60, scenario.last_change_s / 60, color="orange", alpha=0.15)
        ax.axvspan(-scenario.warmup_s / 60, 0, color="grey", alpha=0.1)
        ax.axvline(scenario.duration_s / 60, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes from the end of the warm-up, as the scenario file counts them (grey: warm-up; "
                        "orange: surge or burst; line: arrivals stop)")
    fig.suptitle(f"{summary.scenario} on {summary.deployment} ({summary.cache} cache), policy "
                 f"{summary.policy}, seed {summary.seed}: goodput {summary.goodput_per_hour:.0f}/h, "
                 f"hit rate {_fmt(summary.hit_rate_pre)} -> {_fmt(summary.hit_rate_post)}", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"{summary.scenario}_{summary.deployment}_{summary.cache}_{summary.policy}"
                      f"_seed{summary.seed}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def plot_compare(cells: dict[tuple[str, str, str, str], dict[str, Any]], labels: list[str],
                 out_dir: Path) -> list[Path]:
    """One PNG per scenario: goodput per hour by policy (mean, sd as error bars, one bar group per deployment
    and lending), from `compare.aggregate`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for scenario in dict.fromkeys(key[0] for key in cells):
        groups = list(dict.fromkeys((d, lend) for s, d, lend, _ in cells if s == scenario))
        shown = [label for label in labels if any((scenario, d, lend, label) in cells for d, lend in groups)]
        fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 2.0 + 0.3 * len(shown) * len(groups))), 4.5))
        width = 0.8 / max(1, len(groups))
        for g, (deployment, lending) in enumerate(groups):
            means, sds = [], []
            for label in shown:
                cell = cells.get((scenario, deployment, lending, label))
                means.append(cell["goodput_mean"] if cell else math.nan)  # not run in this group: no bar
                sds.append(cell["goodput_sd"] if cell else math.nan)
            xs = [k + (g - (len(groups) - 1) / 2) * width for k in range(len(shown))]
            ax.bar(xs, means, width, yerr=sds, capsize=3, label=f"{deployment}, lending {lending}")
        seeds = max(cell["seeds"] for key, cell in cells.items() if key[0] == scenario)
        ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right")
        ax.set_ylabel("goodput (sessions/h), mean ± sd")
        ax.set_title(f"{scenario}: goodput by policy over {seeds} seeds")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"compare-{scenario}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

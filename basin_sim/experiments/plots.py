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

from basin_sim import catalog
from basin_sim.experiments.ablations import SESSION_CACHE
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


def _minute_means(runs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(minutes, the mean over seeds of `key` in each minute where any seed has a value)."""
    length = max(len(run[key]) for run in runs)
    xs, ys = [], []
    for minute in range(length):
        values = [run[key][minute] for run in runs if minute < len(run[key]) and run[key][minute] is not None]
        if values:
            xs.append(minute + 0.5)
            ys.append(statistics.fmean(values))
    return xs, ys


def plot_minutes(rows: list[dict[str, Any]], labels: list[str], out_dir: Path,
                 windows: dict[str, tuple[float, float, float]] | None = None) -> list[Path]:
    """One PNG per scenario, deployment and lending from compare's runs (its JSON `runs`): the hit rate by
    minute and the first-call wait p50 of the sessions arriving in each minute, the mean over seeds per label;
    a label ending in `+session-cache` dashed in its base policy's colour, an ablation (`basin:...`) dotted.
    `windows` (scenario -> pre-surge end, goodput window from, to; scenario-file seconds) marks where the
    surge starts and shades the window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    bases = list(dict.fromkeys(label.removesuffix(SESSION_CACHE) for label in labels))
    # matplotlib's ten colours, then ten more distinct ones (the field with Basin's ablations has twelve)
    more = ("black", "darkgoldenrod", "teal", "magenta", "navy", "lime", "maroon", "slategrey", "orchid", "khaki")
    colours = {base: f"C{k}" if k < 10 else more[(k - 10) % len(more)] for k, base in enumerate(bases)}
    paths = []
    for cell in dict.fromkeys((r["scenario"], r["deployment"], r["lending"]) for r in rows):
        fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
        seeds = 0
        for label in labels:
            runs = [r for r in rows if (r["scenario"], r["deployment"], r["lending"], r["policy"]) == (*cell, label)]
            if not runs:
                continue
            seeds = max(seeds, len(runs))
            base = label.removesuffix(SESSION_CACHE)
            dash = "--" if label != base else ":" if ":" in base else "-"  # session cache dashed, ablations dotted
            style = {"color": colours[base], "lw": 1.2, "ls": dash, "label": label}
            axes[0].plot(*_minute_means(runs, "minute_hit_rate"), **style)
            axes[1].semilogy(*_minute_means(runs, "minute_first_call_wait_s"), **style)
        window = (windows or {}).get(cell[0])
        for ax in axes:
            if window is not None:
                ax.axvline(window[0] / 60, color="grey", lw=0.8)
                ax.axvspan(window[1] / 60, window[2] / 60, color="grey", alpha=0.08)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("prefix hit rate\n(mean over seeds)")
        axes[1].set_ylabel("first-call wait p50 (s, by\narrival minute; mean over seeds)")
        axes[1].set_xlabel("minutes from the end of the warm-up (line: the surge or burst starts; shaded: the "
                           "goodput window)")
        axes[0].set_title(f"{cell[0]} on {cell[1]}, lending {cell[2]}: by minute over {seeds} seeds\n"
                          f"(dashed: with SGLang's session cache; dotted: an ablation of Basin)", fontsize=10)
        axes[0].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"minutes-{cell[0]}-{cell[1]}-{cell[2]}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _windows(scenarios: list[str]) -> dict[str, tuple[float, float, float]]:
    """Per scenario of the catalog: where its surge or burst starts and its goodput window (scenario-file s)."""
    windows = {}
    for name in scenarios:
        try:
            scenario = catalog.load_scenario(name)
        except catalog.CatalogError:  # a scenario file given by path elsewhere: drawn without its marks
            continue
        windows[name] = (scenario.pre_end_s, scenario.goodput_from_s, scenario.goodput_to_s)
    return windows


def plot_compare_doc(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every plot of a compare run from its JSON (`basin-sim compare --out`): goodput by label per scenario
    (`plot_compare`) and the hit rate and first-call wait by minute per cell (`plot_minutes`)."""
    rows = doc["runs"]
    labels = doc.get("labels") or list(dict.fromkeys(r["policy"] for r in rows))  # files written before "labels"
    cells = {tuple(key.split("/")): value for key, value in doc["summary"].items()}
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    return [*plot_compare(cells, labels, out_dir), *plot_minutes(rows, labels, out_dir, _windows(scenarios))]


def main(argv: list[str] | None = None) -> int:
    """`python -m basin_sim.experiments.plots RUN.json --plot-dir DIR`: redraw a compare run's plots from its JSON."""
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m basin_sim.experiments.plots",
                                     description="draw a compare run's plots from its JSON (basin-sim compare --out)")
    parser.add_argument("run", type=Path, help="the JSON `basin-sim compare --out` wrote")
    parser.add_argument("--plot-dir", type=Path, required=True, help="write the PNGs here")
    args = parser.parse_args(argv)
    try:
        doc = json.loads(args.run.read_text())
        paths = plot_compare_doc(doc, args.plot_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"plots: error: {args.run} is not a compare run's JSON that can be drawn ({type(exc).__name__}: "
              f"{exc})", file=sys.stderr)
        return 2
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

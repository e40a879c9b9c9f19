"""Timeline PNG of a live replay (from its summary dict): hit rate, sessions, calls/s, TTFT, working set.
Writes a file; matplotlib is imported here only, with the Agg backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _series(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(minutes, values) of the rows where `key` has a value."""
    points = [(row["start_s"] / 60.0, row[key] * scale) for row in rows if row.get(key) is not None]
    return [t for t, _ in points], [v for _, v in points]


def plot_timeline(summary: dict[str, Any], path: Path, title: str = "replay") -> Path:
    """Write the timeline of a replay summary (`replay_summary.summarize`) to `path`; return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, Any]] = summary["timeline"]
    fig, axes = plt.subplots(5, 1, figsize=(10, 11), sharex=True)
    axes[0].plot(*_series(rows, "hit_rate"), lw=1)
    axes[0].set_ylim(0, 1.02)
    axes[0].set_ylabel("hit rate\n(per bin)")
    axes[1].plot(*_series(rows, "live_sessions"), lw=1, label="live")
    axes[1].plot(*_series(rows, "waiting_sessions"), lw=1, label="waiting for call 1")
    axes[1].set_ylabel("sessions")
    axes[1].legend(loc="upper left", fontsize=7)
    axes[2].plot(*_series(rows, "calls_per_s"), lw=1)
    axes[2].set_ylabel("calls answered/s")
    ttft_t, ttft = _series(rows, "ttft_p50_s")
    if ttft and min(ttft) > 0:
        axes[3].semilogy(ttft_t, ttft, lw=1)
    else:
        axes[3].plot(ttft_t, ttft, lw=1)
    axes[3].set_ylabel("TTFT p50 (s)")
    axes[4].plot(*_series(rows, "working_set_tokens", 1e-6), lw=1)
    axes[4].set_ylabel("working set\n(M tokens)")
    surge = summary.get("windows", {}).get("surge")
    for ax in axes:
        if surge is not None:
            ax.axvspan(surge["start_s"] / 60, surge["end_s"] / 60, color="orange", alpha=0.15)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("model minutes (shaded: surge)")
    goodput = summary.get("goodput_per_hour")
    shown = "n/a" if goodput is None else f"{goodput:.0f}/h"
    fig.suptitle(f"{title}: goodput {shown} ({summary.get('goodput_window')} window)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

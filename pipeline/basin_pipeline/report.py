"""The data report: per benchmark sizes and token statistics, and a histogram of peaks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from basin_pipeline.metrics_files import write_metrics
from basin_runtime.markdown_table import markdown_table
from basin_runtime.session_table import Session


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def benchmark_stats(sessions: Sequence[Session]) -> dict[str, Any]:
    """Statistics of one benchmark's sessions."""
    firsts = [s.first_prompt_tokens for s in sessions]
    peaks = [s.peak_prompt_tokens for s in sessions]
    pairs = [(c.prompt_tokens, c.recorded_prompt_tokens) for s in sessions for c in s.calls
             if c.recorded_prompt_tokens]
    ours = sum(p for p, _ in pairs)
    theirs = sum(r for _, r in pairs if r is not None)
    gaps = [c.gap_s for s in sessions for c in s.calls if c.gap_s is not None]
    resolved = [s.resolved for s in sessions if s.resolved is not None]
    return {
        "sessions": len(sessions),
        "tasks": len({s.task_id for s in sessions}),
        "calls": sum(s.n_calls for s in sessions),
        "calls_per_session_median": _pct([s.n_calls for s in sessions], 50),
        "first_prompt_tokens_median": _pct(firsts, 50),
        "first_prompt_tokens_p90": _pct(firsts, 90),
        "peak_prompt_tokens_median": _pct(peaks, 50),
        "peak_prompt_tokens_p90": _pct(peaks, 90),
        "peak_over_first_median": _pct([p / f for p, f in zip(peaks, firsts, strict=True) if f], 50),
        "ours_over_agent_tokens": ours / theirs if theirs else None,
        "calls_with_agent_counts": len(pairs),
        "gap_s_median": _pct(gaps, 50) if gaps else None,
        "resolved_share": sum(resolved) / len(resolved) if resolved else None,
    }


def build_report(sessions: Sequence[Session], rejects: int, synthetic: bool) -> dict[str, Any]:
    """The whole report: one entry per benchmark."""
    by_benchmark: dict[str, list[Session]] = {}
    for s in sessions:
        by_benchmark.setdefault(s.benchmark, []).append(s)
    return {
        "synthetic": synthetic,
        "sessions": len(sessions),
        "rejects": rejects,
        "benchmarks": {name: benchmark_stats(group) for name, group in sorted(by_benchmark.items())},
    }


def report_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table, for people."""
    cols = ["sessions", "tasks", "calls", "first_prompt_tokens_median", "first_prompt_tokens_p90",
            "peak_prompt_tokens_median", "peak_prompt_tokens_p90", "peak_over_first_median",
            "ours_over_agent_tokens", "gap_s_median"]
    rows = [[name, *(f"{stats[c]:.3g}" if isinstance(stats[c], float) else str(stats[c]) for c in cols)]
            for name, stats in report["benchmarks"].items()]
    kind = "SYNTHETIC corpus (no real corpora found)" if report["synthetic"] else "real corpora"
    return f"# Session table report ({kind})\n\n{report['sessions']} sessions, {report['rejects']} rejects.\n\n" \
        + markdown_table(["benchmark", *cols], rows, rule="---") + "\n"


def plot_peaks(sessions: Sequence[Session], path: Path) -> None:
    """A PNG histogram of peak prompt tokens per benchmark (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_benchmark: dict[str, list[int]] = {}
    for s in sessions:
        by_benchmark.setdefault(s.benchmark, []).append(s.peak_prompt_tokens)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    all_peaks = [p for peaks in by_benchmark.values() for p in peaks]
    bins = np.logspace(np.log10(max(1, min(all_peaks))), np.log10(max(all_peaks) + 1), 40)
    for name, peaks in sorted(by_benchmark.items()):
        ax.hist(peaks, bins=bins.tolist(), alpha=0.55, label=f"{name} (n={len(peaks)})")
    ax.set_xscale("log")
    ax.set_xlabel("peak prompt tokens per session (serving tokenizer)")
    ax.set_ylabel("sessions")
    ax.set_title("Peak context per agent session")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], sessions: Sequence[Session], folder: Path,
                 metrics: Path | None = None) -> None:
    """Markdown and PNG into `folder`; the JSON to `metrics` (the stage: metrics/ingest.json, kept in git)
    or else beside them as report.json."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics = metrics or folder / "report.json"
    write_metrics(metrics, report)
    (folder / "report.md").write_text(report_markdown(report), encoding="utf-8")
    plot_peaks(sessions, folder / "peaks.png")

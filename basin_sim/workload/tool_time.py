"""Tool time: how long a session sits idle, holding its cache, between a call's answer and its next call.

Per benchmark: whether its recorded gaps are tool time, and what fills the gaps it lacks.

Rules:
- A session has one gap per call but the last: seconds from call k's answer to call k+1's request (the
  tool's execution and the agent's own step). `resolve_gaps` returns them, every one (recorded or
  drawn) multiplied by `tool_time_scale` (finite, >= 0; 1.0 = as recorded / drawn).
- Two modes (`WorkloadSpec.tool_time`):
  * `sourced` (the default): a benchmark whose recorded gaps measure tool execution keeps them; every
    other gap is drawn from a published distribution (SourcedToolTime, tool_time_sources.yaml, every
    number cited there), named per benchmark by GAP_SOURCES;
  * `recorded`: every recorded gap is kept as it was recorded, and the missing ones are drawn from the
    quantile table fitted on our corpora (ToolTimeModel, TOOL_TIME): the project's earlier behaviour.
- GAP_SOURCES states per benchmark what its recorded `gap_s` are, decided from the data (the evidence
  `--fit` prints; docs/simulator/design.md sums it up), not by a threshold:
  * terminal-bench: the terminal recording's print times (answer printed -> observation printed,
    median 0.04 s), not the command run to completion: sourced mode draws Terminal-Bench's measured
    shell-command latency instead;
  * swebench-verified: real, biased up by call k's own latency at the agent's provider, which the
    model's latency line (a 5%-quantile regression of gap on the call's completion tokens) removes;
  * tau-bench-airline, synthetic-* and presets: nothing measured; drawn (presets and synthetic
    families as the benchmark they mirror);
  * any other benchmark (e.g. a gateway log): recorded gaps are real; missing ones drawn.
- A kept gap of a benchmark with its own latency in it loses its model's latency line, floored at 0.
  A drawn gap is the inverse CDF of its distribution at one `rng.random()`, in call order. Same
  session, rng state, scale and mode -> the same gaps.
- The constants in TOOL_TIME are printed by
  `python -m basin_sim.workload.tool_time --fit data/sessions.parquet` (fit_models); a test refits them.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from basin_runtime.session_table import Session, SessionTableError, read_sessions

QUANTILE_PROBS: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6,
                                     0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.975, 0.99, 0.995, 0.999, 1.0)
LATENCY_QUANTILE = 0.05  # the latency line is the floor under the gaps: their 5% quantile given the call's size


class ToolTimeError(ValueError):
    """A tool-time model, scale or fit that cannot be used; the message names the value."""


@dataclass(frozen=True)
class ToolTimeModel:
    """Tool time of one benchmark: a quantile table, and the latency its recorded gaps carry."""

    benchmark: str  # the corpus it was fitted on
    quantiles_s: tuple[float, ...]  # tool time at QUANTILE_PROBS
    latency_base_s: float = 0.0  # own-model latency in a recorded gap: base + per_token x completion tokens
    latency_s_per_token: float = 0.0
    num_gaps: int = 0  # recorded gaps it was fitted on

    def __post_init__(self) -> None:
        q = self.quantiles_s
        if len(q) != len(QUANTILE_PROBS) or q[0] < 0 or any(b < a for a, b in itertools.pairwise(q)):
            raise ToolTimeError(f"tool-time model {self.benchmark!r}: quantiles_s must be {len(QUANTILE_PROBS)} "
                                f"non-decreasing values >= 0, got {q}")
        if self.latency_base_s < 0 or self.latency_s_per_token < 0:
            raise ToolTimeError(f"tool-time model {self.benchmark!r}: negative latency line "
                                f"({self.latency_base_s}, {self.latency_s_per_token})")

    def quantile_s(self, p: float) -> float:
        """Tool time at probability p (linear between the table's points)."""
        i = min(bisect.bisect_right(QUANTILE_PROBS, p), len(QUANTILE_PROBS) - 1)
        p0, p1 = QUANTILE_PROBS[i - 1], QUANTILE_PROBS[i]
        q0, q1 = self.quantiles_s[i - 1], self.quantiles_s[i]
        return q0 + (q1 - q0) * (min(max(p, p0), p1) - p0) / (p1 - p0)

    def sample_s(self, rng: random.Random) -> float:
        """One tool time drawn from the model."""
        return self.quantile_s(rng.random())

    def latency_s(self, completion_tokens: int) -> float:
        """The part of a recorded gap after a call of this size that was the recording model's own latency."""
        return self.latency_base_s + self.latency_s_per_token * completion_tokens


@dataclass(frozen=True)
class GapSource:
    """What a benchmark's recorded gaps are, and what fills those it lacks in each mode."""

    is_real: bool  # `recorded` mode keeps its recorded gaps (minus the model's latency line)
    measures_tool_time: bool  # `sourced` mode keeps them: they measure tool execution
    model: str  # the TOOL_TIME entry that draws the gaps it lacks in `recorded` mode
    has_own_latency: bool  # recorded gaps include the call's own model latency: `model` is the benchmark's own
    #                        fit, whose latency line is removed from them
    sourced: str  # the SOURCED_TOOL_TIME entry that draws every gap `sourced` mode does not keep
    reason: str


@dataclass(frozen=True)
class SourcedToolTime:
    """A published tool-time distribution: a quantile function through its source's points.

    Between two points the quantile is log-linear (log-uniform tool time) when both are positive, linear
    from a point at 0 s; the last point (p = 1) is the source's timeout or largest value.
    """

    name: str
    knots: tuple[tuple[float, float], ...]  # (probability, seconds), p from 0 to 1
    source: str
    published_mean_s: float | None = None

    def __post_init__(self) -> None:
        probs = [p for p, _ in self.knots]
        secs = [t for _, t in self.knots]
        if (len(self.knots) < 2 or probs[0] != 0.0 or probs[-1] != 1.0
                or any(b <= a for a, b in itertools.pairwise(probs))
                or secs[0] < 0 or any(b < a for a, b in itertools.pairwise(secs))
                or not all(math.isfinite(t) for t in secs)):
            raise ToolTimeError(f"tool-time distribution {self.name!r}: knots need p rising from 0 to 1 and "
                                f"finite, non-decreasing seconds >= 0, got {self.knots}")

    def quantile_s(self, p: float) -> float:
        """Tool time at probability p."""
        probs = [k[0] for k in self.knots]
        i = min(max(bisect.bisect_right(probs, p), 1), len(probs) - 1)
        (p0, t0), (p1, t1) = self.knots[i - 1], self.knots[i]
        f = (min(max(p, p0), p1) - p0) / (p1 - p0)
        if t0 > 0 and t1 > t0:
            return float(t0 * (t1 / t0) ** f)
        return t0 + (t1 - t0) * f

    def sample_s(self, rng: random.Random) -> float:
        """One tool time drawn from the distribution."""
        return self.quantile_s(rng.random())

    def mean_s(self) -> float:
        """The distribution's exact mean (each stretch's mean, weighted by its probability)."""
        total = 0.0
        for (p0, t0), (p1, t1) in itertools.pairwise(self.knots):
            stretch = (t1 - t0) / math.log(t1 / t0) if t0 > 0 and t1 > t0 else (t0 + t1) / 2
            total += (p1 - p0) * stretch
        return total


SOURCES_PATH = Path(__file__).with_name("tool_time_sources.yaml")
SOURCED = "sourced"
RECORDED = "recorded"
TOOL_TIME_MODES = (SOURCED, RECORDED)


def read_sources(path: Path = SOURCES_PATH) -> dict[str, SourcedToolTime]:
    """The published distributions of a sources file, checked (ToolTimeError names the file and entry)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ToolTimeError(f"tool-time sources {path}: cannot be read ({exc})") from exc
    if not isinstance(data, Mapping):
        raise ToolTimeError(f"tool-time sources {path}: must map names to distributions")
    out = {}
    for name, raw in data.items():
        where = f"tool-time sources {path}: {name}"
        if not isinstance(raw, Mapping) or not {"knots", "source"} <= set(raw):
            raise ToolTimeError(f"{where}: needs knots and source (and description, published_mean_s)")
        try:
            knots = tuple((float(k["p"]), float(k["s"])) for k in raw["knots"])
        except (TypeError, KeyError, ValueError) as exc:
            raise ToolTimeError(f"{where}: every knot needs numbers p and s ({exc})") from exc
        mean = raw.get("published_mean_s")
        try:
            out[str(name)] = SourcedToolTime(str(name), knots, str(raw["source"]).strip(),
                                             None if mean is None else float(mean))
        except ToolTimeError as exc:
            raise ToolTimeError(f"tool-time sources {path}: {exc}") from exc
    return out


SOURCED_TOOL_TIME: Mapping[str, SourcedToolTime] = read_sources()


# Fitted by `python -m basin_sim.workload.tool_time --fit data/sessions.parquet` on the session table of
# params.yaml's corpora (qwen3.6 tokens).
TOOL_TIME: Mapping[str, ToolTimeModel] = {
    "swebench-verified": ToolTimeModel(
        "swebench-verified",
        (0.0, 0.0, 0.134, 0.314, 0.703, 0.886, 1.018, 1.101, 1.199, 1.266, 1.612, 1.916, 2.112, 2.266, 2.817,
         3.2, 3.967, 4.907, 6.667, 11.175, 16.761, 30.805, 39.957, 61.64, 113.472),
        latency_base_s=1.568, latency_s_per_token=0.00828, num_gaps=15495),
    "terminal-bench": ToolTimeModel(
        "terminal-bench",
        (0.0, 0.013, 0.015, 0.017, 0.018, 0.02, 0.022, 0.024, 0.027, 0.033, 0.04, 0.054, 0.082, 0.181, 0.391,
         1.283, 2.861, 7.924, 29.173, 29.895, 29.965, 30.015, 30.059, 30.52, 62.069),
        num_gaps=2300),
}
DEFAULT_MODEL = "swebench-verified"

TB = "terminal-bench-shell"  # Terminal-Bench's measured shell commands (agent-sched-bench)
CODING = "tracelab-step"  # coding agents' tool time per step (TraceLab)
GAP_SOURCES: Mapping[str, GapSource] = {
    "swebench-verified": GapSource(True, True, "swebench-verified", True, CODING,
                                   "created stamps at generation start: gap = own latency + tool, 1 s resolution"),
    "terminal-bench": GapSource(True, False, "terminal-bench", False, TB,
                                "terminal recording's print times (answer printed -> observation printed), "
                                "not the command run to completion"),
    "tau-bench-airline": GapSource(False, False, "swebench-verified", False, CODING, "no timestamps recorded"),
    "synthetic-swebench": GapSource(False, False, "swebench-verified", False, CODING,
                                    "synthetic: as SWE-bench without its recorded gaps"),
    "synthetic-terminal": GapSource(False, False, "terminal-bench", False, TB, "synthetic: as Terminal-Bench"),
    "synthetic-tau": GapSource(False, False, "swebench-verified", False, CODING, "synthetic: no timestamps"),
    "paper-terminal-bench": GapSource(False, False, "terminal-bench", False, TB,
                                      "preset on synthetic-terminal: as Terminal-Bench"),
}


def gap_source(benchmark: str) -> GapSource:
    """The benchmark's gap source; an unlisted benchmark's recorded gaps count as real."""
    return GAP_SOURCES.get(benchmark, GapSource(True, True, DEFAULT_MODEL, False, CODING,
                                                "unlisted: recorded gaps are real"))


def has_real_tool_time(benchmark: str) -> bool:
    """Whether the benchmark's recorded gaps are measured tool time."""
    return gap_source(benchmark).is_real


def model_for(benchmark: str) -> ToolTimeModel:
    """The tool-time model that fills the benchmark's missing (or not real) gaps."""
    return TOOL_TIME[gap_source(benchmark).model]


def check_scale(tool_time_scale: float) -> float:
    """The scale itself, or ToolTimeError if it is not a finite number >= 0."""
    if not (math.isfinite(tool_time_scale) and tool_time_scale >= 0):
        raise ToolTimeError(f"tool_time_scale must be a finite number >= 0, got {tool_time_scale!r}")
    return tool_time_scale


def check_mode(mode: str) -> str:
    """The mode itself, or ToolTimeError naming the known ones."""
    if mode not in TOOL_TIME_MODES:
        raise ToolTimeError(f"tool_time must be one of {list(TOOL_TIME_MODES)}, got {mode!r}")
    return mode


def resolve_gaps(session: Session, rng: random.Random, tool_time_scale: float = 1.0,
                 mode: str = SOURCED) -> tuple[float, ...]:
    """Tool time after each call but the last: gaps the mode keeps (latency removed), the rest drawn; all scaled."""
    scale = check_scale(tool_time_scale)
    source = gap_source(session.benchmark)
    model = TOOL_TIME[source.model]
    keeps = source.measures_tool_time if check_mode(mode) == SOURCED else source.is_real
    draw = SOURCED_TOOL_TIME[source.sourced].sample_s if mode == SOURCED else model.sample_s
    gaps: list[float] = []
    for call in session.calls[:-1]:
        if keeps and call.gap_s is not None:
            own_latency_s = model.latency_s(call.completion_tokens) if source.has_own_latency else 0.0
            tool_s = max(0.0, call.gap_s - own_latency_s)
        else:
            tool_s = draw(rng)
        gaps.append(tool_s * scale)
    return tuple(gaps)


# ---- fitting ----------------------------------------------------------------------------------------

def _gaps_and_sizes(sessions: Sequence[Session], benchmark: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(c.gap_s, c.completion_tokens) for s in sessions if s.benchmark == benchmark
             for c in s.calls[:-1] if c.gap_s is not None]
    return np.array([g for g, _ in pairs], float), np.array([n for _, n in pairs], float)


def _pinball(residuals: np.ndarray, q: float) -> float:
    return float(np.mean(np.maximum(q * residuals, (q - 1) * residuals)))


def fit_latency_line(gaps_s: np.ndarray, sizes: np.ndarray, q: float = LATENCY_QUANTILE) -> tuple[float, float]:
    """(base_s, s_per_token): the q-quantile regression line of gaps on call sizes, slope >= 0."""
    def loss(slope: float) -> tuple[float, float]:  # best intercept for a slope: the q-quantile of what is left
        rest = gaps_s - slope * sizes
        base = float(np.quantile(rest, q))
        return _pinball(rest - base, q), base

    low, high = 0.0, 0.1  # s per token; the loss profile is convex in the slope
    for _ in range(80):
        a, b = low + (high - low) / 3, high - (high - low) / 3
        low, high = (low, b) if loss(a)[0] <= loss(b)[0] else (a, high)
    slope = (low + high) / 2
    return round(max(0.0, loss(slope)[1]), 3), round(slope, 5)


def fit_tool_time(sessions: Sequence[Session], benchmark: str) -> ToolTimeModel:
    """Fit a benchmark's model on its recorded gaps (its own latency removed when GAP_SOURCES says so)."""
    gaps_s, sizes = _gaps_and_sizes(sessions, benchmark)
    if len(gaps_s) < 100:
        raise ToolTimeError(f"benchmark {benchmark!r}: {len(gaps_s)} recorded gaps, need at least 100 to fit")
    base_s, per_token = fit_latency_line(gaps_s, sizes) if gap_source(benchmark).has_own_latency else (0.0, 0.0)
    tool_s = np.maximum(0.0, gaps_s - (base_s + per_token * sizes))
    quantiles = tuple(round(float(v), 3) for v in np.quantile(tool_s, QUANTILE_PROBS))
    return ToolTimeModel(benchmark, quantiles, base_s, per_token, len(gaps_s))


def fit_models(sessions: Sequence[Session]) -> dict[str, ToolTimeModel]:
    """A model for every benchmark in the sessions whose recorded gaps are real."""
    benchmarks = sorted({s.benchmark for s in sessions if s.benchmark in GAP_SOURCES})
    return {b: fit_tool_time(sessions, b) for b in benchmarks if has_real_tool_time(b)}


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(len(values))
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]  # ties share their mean rank


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (ties averaged)."""
    return float(np.corrcoef(_ranks(np.asarray(x, float)), _ranks(np.asarray(y, float)))[0, 1])


def evidence(sessions: Sequence[Session], benchmark: str) -> str:
    """One line on what a benchmark's recorded gaps hold: coverage, median, p90, latency correlations."""
    group = [s for s in sessions if s.benchmark == benchmark]
    total = sum(s.n_calls - 1 for s in group)
    triples = [(a.gap_s, a.completion_tokens, b.completion_tokens) for s in group
               for a, b in zip(s.calls, s.calls[1:], strict=False) if a.gap_s is not None]
    if len(triples) < 3:
        return f"{benchmark}: {len(triples)} of {total} gaps recorded"
    gaps = [t[0] for t in triples]
    own, following = spearman(gaps, [t[1] for t in triples]), spearman(gaps, [t[2] for t in triples])
    return (f"{benchmark}: {len(gaps)} of {total} gaps recorded, median {np.median(gaps):.3f} s, "
            f"p90 {np.quantile(gaps, 0.9):.3f} s, Spearman with the call's own completion tokens {own:.2f}, "
            f"with the next call's {following:.2f}")


def main(argv: list[str] | None = None) -> int:
    """Print the evidence per benchmark and the fitted TOOL_TIME constants."""
    parser = argparse.ArgumentParser(prog="python -m basin_sim.workload.tool_time",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--fit", type=Path, required=True, metavar="SESSIONS", help="session table (.parquet)")
    args = parser.parse_args(argv)
    try:
        sessions = read_sessions(args.fit)
        models = fit_models(sessions)
    except (SessionTableError, ToolTimeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    for benchmark in sorted({s.benchmark for s in sessions}):
        print(f"# {evidence(sessions, benchmark)}")
    for model in models.values():
        print(f"{model.benchmark!r}: {model!r},")
    return 0


if __name__ == "__main__":
    sys.exit(main())

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from basin_runtime.session_table import Call, Session, read_sessions, write_sessions
from basin_sim.workload.presets import PRESETS
from basin_sim.workload.synthetic import FAMILIES, generate_corpus
from basin_sim.workload.tool_time import (
    DEFAULT_MODEL,
    GAP_SOURCES,
    QUANTILE_PROBS,
    RECORDED,
    SOURCED_TOOL_TIME,
    TOOL_TIME,
    SourcedToolTime,
    ToolTimeError,
    ToolTimeModel,
    fit_latency_line,
    fit_models,
    fit_tool_time,
    gap_source,
    has_real_tool_time,
    main,
    model_for,
    read_sources,
    resolve_gaps,
    spearman,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "basin_sim" / "workload" / "tool_time_sources.yaml"
SWE = TOOL_TIME["swebench-verified"]
TERMINAL = TOOL_TIME["terminal-bench"]


def _session(benchmark: str, gaps: Sequence[float | None], completions: Sequence[int] | None = None,
             session_id: str = "s") -> Session:
    """A session with one call more than `gaps` (the last call has no gap); prompts grow by 100."""
    sizes = list(completions) if completions is not None else [50] * (len(gaps) + 1)
    calls = tuple(Call(1000 + 100 * k, sizes[k], None, None, gaps[k] if k < len(gaps) else None)
                  for k in range(len(gaps) + 1))
    return Session(session_id, benchmark, "test", "agent", "model", "task", "a task", "", "qwen3.6", calls)


# ---- sourced mode: published distributions ------------------------------------------------------------

SHELL = SOURCED_TOOL_TIME["terminal-bench-shell"]
STEP = SOURCED_TOOL_TIME["tracelab-step"]


@pytest.mark.parametrize(("dist", "points"), [
    # agent-sched-bench latency_summary.csv, row `Terminal-Bench All,exec` (ms): min, p50, p90, p95, p99, max
    (SHELL, {0.0: 0.000477, 0.5: 0.1472, 0.9: 15.409, 0.95: 55.995, 0.99: 227.54, 1.0: 600.108}),
    # TraceLab session_timing_distribution.tex, per step, tool execution: P50 0.1 s, P90 10.0 s, P99 3.2 min
    (STEP, {0.5: 0.1, 0.9: 10.0, 0.99: 192.0}),
])
def test_a_sourced_distribution_passes_through_its_sources_quantiles(dist: SourcedToolTime,
                                                                     points: dict[float, float]) -> None:
    for p, seconds in points.items():
        assert dist.quantile_s(p) == pytest.approx(seconds, rel=1e-9), (dist.name, p)
    rng = random.Random(5)
    draws = np.array([dist.sample_s(rng) for _ in range(200_000)])
    for p, seconds in points.items():
        if 0 < p < 1:
            assert np.quantile(draws, p) == pytest.approx(seconds, rel=0.05), (dist.name, p)
    assert draws.min() >= 0 and draws.max() <= dist.knots[-1][1]  # never past the source's timeout / largest value


def test_a_published_mean_is_met_and_log_linear_stretches_are_log_uniform() -> None:
    assert STEP.published_mean_s == 16.8 and STEP.mean_s() == pytest.approx(16.8, rel=0.01)
    assert SHELL.published_mean_s is None and 10 < SHELL.mean_s() < 13  # derived, reported: ~11.6 s
    # between P90 (10 s) and P99 (192 s) the log of the time is uniform: the geometric midpoint at p = 0.945
    assert STEP.quantile_s(0.945) == pytest.approx(math.sqrt(10.0 * 192.0))
    assert STEP.quantile_s(0.25) == pytest.approx(0.05)  # linear from the 0 s point
    draws = [STEP.sample_s(random.Random(k)) for k in range(100_000)]
    assert statistics.fmean(draws) == pytest.approx(STEP.mean_s(), rel=0.1)  # heavy tail: a loose check


def test_every_number_in_the_sources_file_is_cited() -> None:
    text = SOURCES.read_text()
    for name, dist in read_sources().items():
        assert dist.source, name
        block = text[text.index(f"{name}:"):]
        block = block[:block.index("published_mean_s")]
        for line in block.splitlines():
            if "{p:" in line:
                assert "#" in line and len(line.split("#", 1)[1].strip()) > 5, (name, line)


@pytest.mark.parametrize(("edit", "message"), [
    ("- {p: 0.5, s: 0.1472}", r"'terminal-bench-shell': knots need p rising"),
    ("source: >-", r"needs knots and source"),
])
def test_a_broken_sources_file_is_refused_naming_the_entry(tmp_path: Path, edit: str, message: str) -> None:
    text = SOURCES.read_text()
    bad = tmp_path / "bad.yaml"
    broken = {"- {p: 0.5, s: 0.1472}": "- {p: 0.5, s: 0.0001}",  # below the minimum: not non-decreasing
              "source: >-": "citation: >-"}[edit]
    bad.write_text(text.replace(edit, broken, 1))
    with pytest.raises(ToolTimeError, match=message) as info:
        read_sources(bad)
    assert "bad.yaml" in str(info.value)


def test_sourced_mode_replaces_terminal_bench_print_times_and_keeps_swebench_tool_time() -> None:
    tb = _session("terminal-bench", [0.04, 0.03, None])  # print times, not the command run to completion
    reference = random.Random(2)
    assert resolve_gaps(tb, random.Random(2)) == tuple(SHELL.quantile_s(reference.random()) for _ in range(3))
    swe = _session("swebench-verified", [10.0, None], completions=[100, 5, 5])
    expected_kept = 10.0 - (SWE.latency_base_s + 100 * SWE.latency_s_per_token)
    assert resolve_gaps(swe, random.Random(2)) == pytest.approx(
        (expected_kept, STEP.quantile_s(random.Random(2).random())))


def test_presets_and_synthetic_families_draw_as_the_benchmark_they_mirror() -> None:
    mirrored = {"synthetic-swebench": "swebench-verified", "synthetic-terminal": "terminal-bench",
                "synthetic-tau": "tau-bench-airline"}
    for family in FAMILIES:
        assert gap_source(family.benchmark).sourced == gap_source(mirrored[family.benchmark]).sourced
    for preset in PRESETS.values():  # a preset's sessions carry its own name as their benchmark
        assert preset.name in GAP_SOURCES, preset.name
        assert gap_source(preset.name).sourced == gap_source(preset.base_family).sourced == "terminal-bench-shell"
    with pytest.raises(ToolTimeError, match="tool_time must be one of"):
        resolve_gaps(_session("terminal-bench", [1.0]), random.Random(0), 1.0, "measured")


def test_recorded_mode_keeps_real_gaps_and_scales_them_without_drawing() -> None:
    session = _session("terminal-bench", [0.5, 2.0, 30.0])
    rng = random.Random(1)
    before = rng.getstate()
    assert resolve_gaps(session, rng, 1.0, RECORDED) == (0.5, 2.0, 30.0)
    assert resolve_gaps(session, rng, 2.0, RECORDED) == (1.0, 4.0, 60.0)
    assert resolve_gaps(session, rng, 0.0, RECORDED) == (0.0, 0.0, 0.0)
    assert rng.getstate() == before  # no gap was drawn


def test_swebench_gaps_lose_their_own_latency_floored_at_zero() -> None:
    session = _session("swebench-verified", [10.0, 1.0, 15.0], completions=[100, 0, 1000, 7])
    expected = (10.0 - (SWE.latency_base_s + 100 * SWE.latency_s_per_token), 0.0,
                15.0 - (SWE.latency_base_s + 1000 * SWE.latency_s_per_token))
    assert SWE.latency_base_s > 1.0  # 1.0 s is below the floor, so the second gap is all latency
    assert resolve_gaps(session, random.Random(0), 1.0) == pytest.approx(expected)
    assert resolve_gaps(session, random.Random(0), 3.0) == pytest.approx(tuple(3 * g for g in expected))


def test_recorded_mode_draws_missing_gaps_in_call_order_one_draw_each() -> None:
    session = _session("terminal-bench", [0.25, None, 4.0, None])
    rng, reference = random.Random(9), random.Random(9)
    gaps = resolve_gaps(session, rng, 2.0, RECORDED)
    assert gaps == (0.5, 2 * TERMINAL.quantile_s(reference.random()), 8.0, 2 * TERMINAL.quantile_s(reference.random()))
    assert rng.getstate() == reference.getstate()


@pytest.mark.parametrize(("benchmark", "model"), [("tau-bench-airline", SWE), ("synthetic-terminal", TERMINAL),
                                                  ("synthetic-swebench", SWE), ("paper-terminal-bench", TERMINAL)])
def test_gaps_that_are_not_real_are_all_drawn_from_the_mirrored_model(benchmark: str, model: ToolTimeModel) -> None:
    session = _session(benchmark, [7.0, 7.0, None, 7.0])  # recorded or not, every gap is drawn
    reference = random.Random(3)
    assert not has_real_tool_time(benchmark) and model_for(benchmark) is model
    assert resolve_gaps(session, random.Random(3), 1.0, RECORDED) == tuple(model.quantile_s(reference.random())
                                                                          for _ in range(4))


def test_an_unlisted_benchmark_keeps_its_gaps_and_fills_missing_ones_from_the_default_model() -> None:
    session = _session("gateway-workload", [1.5, None])
    drawn = TOOL_TIME[DEFAULT_MODEL].quantile_s(random.Random(4).random())
    assert has_real_tool_time("gateway-workload")
    assert resolve_gaps(session, random.Random(4), 1.0, RECORDED) == (1.5, drawn)
    sourced = SOURCED_TOOL_TIME["tracelab-step"].quantile_s(random.Random(4).random())
    assert resolve_gaps(session, random.Random(4), 1.0) == (1.5, sourced)  # kept as tool time in both modes


def test_only_a_benchmark_s_own_fit_carries_a_latency_line() -> None:
    for benchmark, source in GAP_SOURCES.items():
        assert source.model in TOOL_TIME, benchmark
        assert not source.has_own_latency or (source.is_real and source.model == benchmark), benchmark
        has_line = TOOL_TIME[source.model].latency_s(1000) > 0
        assert has_line == (source.model in GAP_SOURCES and GAP_SOURCES[source.model].has_own_latency), benchmark


def test_same_seed_same_gaps_other_seed_other_gaps_and_scales_are_exact() -> None:
    sessions = [_session("tau-bench-airline", [None] * 30, session_id="a"), _session("terminal-bench", [1.0, None])]

    def run(seed: int, scale: float) -> list[tuple[float, ...]]:
        rng = random.Random(seed)
        return [resolve_gaps(s, rng, scale) for s in sessions]

    assert run(5, 1.0) == run(5, 1.0) and run(5, 1.0) != run(6, 1.0)
    assert run(5, 2.0) == [tuple(2 * g for g in gaps) for gaps in run(5, 1.0)]
    assert all(g == 0.0 for gaps in run(5, 0.0) for g in gaps)
    assert len(run(5, 1.0)[0]) == 30 and any(g > 0 for g in run(5, 1.0)[0])


def test_a_single_call_session_has_no_gaps() -> None:
    assert resolve_gaps(_session("tau-bench-airline", []), random.Random(0), 1.0) == ()


@pytest.mark.parametrize("scale", [-0.5, math.nan, math.inf])
def test_a_bad_scale_raises_naming_it(scale: float) -> None:
    with pytest.raises(ToolTimeError, match="tool_time_scale"):
        resolve_gaps(_session("terminal-bench", [1.0]), random.Random(0), scale)


def test_quantile_table_interpolates_and_samples_its_own_quantiles() -> None:
    for p, q in zip(QUANTILE_PROBS, SWE.quantiles_s, strict=True):
        assert SWE.quantile_s(p) == pytest.approx(q)
    assert SWE.quantile_s(0.925) == pytest.approx((SWE.quantile_s(0.9) + SWE.quantile_s(0.95)) / 2)
    rng = random.Random(11)
    draws = np.array([SWE.sample_s(rng) for _ in range(40_000)])
    assert np.median(draws) == pytest.approx(SWE.quantile_s(0.5), rel=0.03)
    assert np.quantile(draws, 0.9) == pytest.approx(SWE.quantile_s(0.9), rel=0.03)
    assert draws.min() >= 0 and draws.max() <= SWE.quantiles_s[-1]


def test_a_broken_table_is_refused() -> None:
    with pytest.raises(ToolTimeError, match="non-decreasing"):
        ToolTimeModel("x", (1.0, 0.5, *([2.0] * (len(QUANTILE_PROBS) - 2))))
    with pytest.raises(ToolTimeError, match="non-decreasing"):
        ToolTimeModel("x", (0.0, 1.0))
    with pytest.raises(ToolTimeError, match="latency"):
        ToolTimeModel("x", (0.0,) * len(QUANTILE_PROBS), latency_base_s=-1.0)


def _planted(benchmark: str, n_sessions: int, base_s: float, per_token: float, seed: int) -> list[Session]:
    """Sessions whose gaps are a latency line plus an exponential tool time of mean 3 s."""
    rng = random.Random(seed)
    sessions = []
    for i in range(n_sessions):
        sizes = [int(rng.expovariate(1 / 400)) for _ in range(21)]
        gaps = [base_s + per_token * n + rng.expovariate(1 / 3) for n in sizes[:-1]]
        sessions.append(_session(benchmark, gaps, sizes, session_id=f"{benchmark}-{i}"))
    return sessions


def test_fit_recovers_a_planted_latency_line_and_tool_time() -> None:
    sessions = _planted("swebench-verified", 300, base_s=1.5, per_token=0.008, seed=2)
    model = fit_tool_time(sessions, "swebench-verified")
    q05 = -3 * math.log(0.95)  # the planted tool time's 5% quantile sits on top of the line
    assert model.latency_s_per_token == pytest.approx(0.008, rel=0.05)
    assert model.latency_base_s == pytest.approx(1.5 + q05, abs=0.05)
    assert model.num_gaps == 6000
    assert model.quantile_s(0.5) == pytest.approx(3 * math.log(2) - q05, abs=0.15)


def test_fit_without_own_latency_is_the_empirical_quantile_table() -> None:
    sessions = _planted("terminal-bench", 50, base_s=0.0, per_token=0.0, seed=3)
    gaps = [g for s in sessions for c in s.calls if (g := c.gap_s) is not None]
    model = fit_tool_time(sessions, "terminal-bench")
    assert (model.latency_base_s, model.latency_s_per_token) == (0.0, 0.0)
    assert model.quantiles_s == pytest.approx(np.quantile(gaps, QUANTILE_PROBS), abs=5e-4)
    assert set(fit_models([*sessions, *_planted("tau-bench-airline", 10, 0, 0, 4)])) == {"terminal-bench"}
    with pytest.raises(ToolTimeError, match="at least 100"):
        fit_tool_time(sessions[:2], "terminal-bench")


def test_latency_line_slope_is_never_negative() -> None:
    sizes = np.arange(1000, dtype=float)
    base, slope = fit_latency_line(10.0 - 0.001 * sizes, sizes)
    assert slope == 0.0 and 9.0 <= base <= 10.0


def test_spearman_matches_scipy_with_ties() -> None:
    rng = random.Random(8)
    x = [float(rng.randrange(6)) for _ in range(300)]
    y = [v + rng.randrange(4) for v in x]
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)


def test_fit_command_prints_the_evidence_and_the_constants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sessions.parquet"
    write_sessions(path, [*_planted("swebench-verified", 20, 1.5, 0.008, 1), *_planted("terminal-bench", 20, 0, 0, 2),
                          *generate_corpus(1, 3)])
    assert main(["--fit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# swebench-verified: 400 of 400 gaps recorded" in out and "# synthetic-tau:" in out
    assert "'swebench-verified': ToolTimeModel(benchmark='swebench-verified'" in out
    assert "'terminal-bench': ToolTimeModel(" in out
    assert len([line for line in out.splitlines() if not line.startswith("#")]) == 2  # no model for synthetic gaps
    assert main(["--fit", str(tmp_path / "missing.parquet")]) == 2
    assert "no such session table" in capsys.readouterr().err


# ---- the real corpora ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_sessions(shared_trajectories: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Session]:
    """data/sessions.parquet when it is there, else the three corpora ingested afresh."""
    table = ROOT / "data" / "sessions.parquet"
    if table.exists():
        return read_sessions(table)
    from basin_pipeline.ingest import main as ingest_main

    out = tmp_path_factory.mktemp("tool_time")
    corpora = {"swebench-verified": ("mini-swe-agent", "swebench-verified_mini-swe-agent-1.15_gemini-3-pro"),
               "terminal-bench": ("messages-jsonl", "terminal-bench-core-0.1.1_mini-swe-agent-1.7_claude-sonnet-4"),
               "tau-bench-airline": ("messages-jsonl", "tau-bench-airline_tool-calling-agent_gpt-4o")}
    sessions: list[Session] = []
    for benchmark, (fmt, folder) in corpora.items():
        path = out / f"{benchmark}.parquet"
        assert ingest_main(["--format", fmt, "--benchmark", benchmark, "--out", str(path), "--quiet",
                            str(shared_trajectories / folder)]) == 0
        sessions.extend(read_sessions(path))
    return sessions


@pytest.mark.real_data
def test_the_constants_are_the_fit_of_the_real_table(real_sessions: list[Session]) -> None:
    fitted = fit_models(real_sessions)
    for benchmark in ("swebench-verified", "terminal-bench"):
        model, constant = fitted[benchmark], TOOL_TIME[benchmark]
        assert model.num_gaps == constant.num_gaps
        assert model.quantiles_s == pytest.approx(constant.quantiles_s, rel=0.02, abs=0.01), benchmark
        assert model.latency_base_s == pytest.approx(constant.latency_base_s, abs=0.05)
        assert model.latency_s_per_token == pytest.approx(constant.latency_s_per_token, rel=0.05)


@pytest.mark.real_data
@pytest.mark.parametrize("benchmark", ["swebench-verified", "terminal-bench"])
def test_the_model_reproduces_the_real_median_and_p90(real_sessions: list[Session], benchmark: str) -> None:
    rng = random.Random(0)
    real = [g for s in real_sessions if s.benchmark == benchmark for g in resolve_gaps(s, rng, 1.0, RECORDED)]
    draws = [TOOL_TIME[benchmark].sample_s(rng) for _ in range(50_000)]
    for q in (0.5, 0.9):
        assert np.quantile(draws, q) == pytest.approx(np.quantile(real, q), rel=0.05, abs=0.005), (benchmark, q)
    assert np.mean(draws) == pytest.approx(np.mean(real), rel=0.1)


@pytest.mark.real_data
def test_the_recorded_gaps_hold_what_gap_sources_says(real_sessions: list[Session]) -> None:
    """SWE-bench gaps follow the call's own answer size (its latency is in them); Terminal-Bench's do not."""
    def correlations(benchmark: str) -> tuple[float, float]:
        pairs = [(a.gap_s, a.completion_tokens, b.completion_tokens) for s in real_sessions if s.benchmark == benchmark
                 for a, b in zip(s.calls, s.calls[1:], strict=False) if a.gap_s is not None]
        gaps = [p[0] for p in pairs]
        return spearman(gaps, [p[1] for p in pairs]), spearman(gaps, [p[2] for p in pairs])

    own, following = correlations("swebench-verified")
    assert own > 0.4 and following < 0.1
    assert abs(correlations("terminal-bench")[0]) < 0.1
    tau = [c.gap_s for s in real_sessions if s.benchmark == "tau-bench-airline" for c in s.calls]
    assert tau and all(g is None for g in tau)

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from basin_pipeline.synth import main as synth_main
from basin_runtime.session_table import Session, read_sessions, to_table
from basin_sim.workload.synthetic import _LOADINGS, FAMILIES, fit_family, generate_corpus


def test_same_seed_same_corpus_other_seed_other_corpus(tmp_path: Path) -> None:
    assert synth_main(["--seed", "3", "--sessions-per-benchmark", "20", "--out", str(tmp_path / "a.parquet")]) == 0
    assert synth_main(["--seed", "3", "--sessions-per-benchmark", "20", "--out", str(tmp_path / "b.parquet")]) == 0
    a, b = read_sessions(tmp_path / "a.parquet"), read_sessions(tmp_path / "b.parquet")
    assert a == b and len(a) == 20 * len(FAMILIES)
    assert generate_corpus(4, 20) != a


def test_fit_recovers_the_family_statistics() -> None:
    sessions = generate_corpus(11, 400)
    for family in FAMILIES:
        fitted = fit_family([s for s in sessions if s.benchmark == family.benchmark], family.benchmark)
        assert abs(fitted.n_calls.mu - family.n_calls.mu) < 0.1
        assert abs(fitted.completion_tokens.mu - family.completion_tokens.mu) < 0.1
        assert abs(fitted.task_chars.mu - family.task_chars.mu) < 0.1



def test_task_words_carry_signal_about_the_peak() -> None:
    sessions = generate_corpus(5, 300)
    for family in FAMILIES:
        group = [s for s in sessions if s.benchmark == family.benchmark]
        scores = [sum(_LOADINGS.get(w, 0.0) for w in re.findall(r"[a-z]+", s.task_text.lower())) /
                  max(1, len(s.task_text)) for s in group]
        peaks = [math.log(s.peak_prompt_tokens) for s in group]
        assert np.corrcoef(scores, peaks)[0, 1] > 0.25, family.benchmark


@pytest.mark.integration
@pytest.mark.real_data
def test_synthetic_statistics_fit_the_real_table(shared_trajectories: Path, tmp_path: Path) -> None:
    from basin_pipeline.ingest import main as ingest_main

    real = {"synthetic-swebench": "swebench-verified_mini-swe-agent-1.15_gemini-3-pro",
            "synthetic-terminal": "terminal-bench-core-0.1.1_mini-swe-agent-1.7_claude-sonnet-4"}
    synthetic = generate_corpus(7, 300)
    for name, folder in real.items():
        fmt = "mini-swe-agent" if "swebench" in name else "messages-jsonl"
        out = tmp_path / f"{name}.parquet"
        assert ingest_main(["--format", fmt, "--benchmark", name, "--out", str(out), "--quiet",
                            str(shared_trajectories / folder)]) == 0
        real_sessions = read_sessions(out)
        synth = [s for s in synthetic if s.benchmark == name]
        for stat in ("n_calls", "first_prompt_tokens", "peak_prompt_tokens"):
            r = float(np.median([getattr(s, stat) for s in real_sessions]))
            m = float(np.median([getattr(s, stat) for s in synth]))
            assert abs(m - r) / r < 0.25, (name, stat, r, m)


def test_synthetic_sessions_are_valid_table_rows() -> None:
    sessions: list[Session] = generate_corpus(1, 10)
    table = to_table(sessions)
    assert table.num_rows == 30
    assert all(s.calls[-1].gap_s is None for s in sessions)
    assert all(c.gap_s is not None and c.gap_s >= 0 for s in sessions for c in s.calls[:-1])

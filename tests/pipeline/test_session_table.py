from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from basin_runtime.session_table import (
    SCHEMA,
    Call,
    Session,
    SessionTableError,
    read_sessions,
    to_table,
    write_sessions,
)


def _session(sid: str = "s1", resolved: bool | None = True) -> Session:
    calls = (Call(100, 10, None, 110, 2.5), Call(180, 12, 90, None, None))
    return Session(sid, "bench", "src", "agent", "model", "task-1", "fix it", "desc", "qwen3.6", calls, resolved)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    sessions = [_session("s1"), _session("s2", resolved=None)]
    write_sessions(tmp_path / "t.parquet", sessions)
    assert read_sessions(tmp_path / "t.parquet") == sessions
    s = sessions[0]
    assert (s.task_chars, s.first_prompt_tokens, s.peak_prompt_tokens, s.n_calls) == (6, 100, 180, 2)


def test_a_session_needs_a_call() -> None:
    with pytest.raises(SessionTableError, match="'empty': has no calls"):
        Session("empty", "b", "s", "a", "m", "t", "x", "", "qwen3.6", (), None)


def test_read_rejects_broken_invariants_naming_row_and_column(tmp_path: Path) -> None:
    rows = to_table([_session("s1"), _session("s2")]).to_pylist()
    rows[1]["peak_prompt_tokens"] = 5
    rows[0]["calls"][0]["gap_s"] = -1.0
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), tmp_path / "bad.parquet")
    with pytest.raises(SessionTableError) as info:
        read_sessions(tmp_path / "bad.parquet")
    message = str(info.value)
    assert "bad.parquet: 2 problem(s)" in message
    assert "row 1 ('s2'): peak_prompt_tokens is 5 but the calls give 180" in message
    assert "row 0 ('s1'): call 0: gap_s is -1.0" in message


def test_duplicate_ids_and_wrong_schema_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SessionTableError, match="duplicate session_id"):
        write_sessions(tmp_path / "dup.parquet", [_session("s1"), _session("s1")])
    assert not (tmp_path / "dup.parquet").exists()
    pq.write_table(pa.table({"session_id": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(SessionTableError, match="schema differs"):
        read_sessions(tmp_path / "other.parquet")

from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_pipeline.ingest import main as ingest_main
from basin_runtime.session_table import read_sessions
from tests.pipeline.fixtures import messages_session, write_jsonl, write_mini_swe


def _rejects(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_go_to_the_rejects_report_and_the_rest_is_kept(tmp_path: Path) -> None:
    no_user = messages_session("no-user")
    no_user["messages"] = [m for m in no_user["messages"] if m["role"] != "user"]
    no_answer = messages_session("no-answer")
    no_answer["messages"] = [m for m in no_answer["messages"] if m["role"] != "assistant"]
    lines = [json.dumps(messages_session(f"ok-{i}")) for i in range(7)]
    lines += ["{not json", json.dumps(no_user), json.dumps(no_answer), json.dumps(messages_session("ok-0"))]
    src = write_jsonl(tmp_path / "mixed.jsonl", lines)
    out, rejects = tmp_path / "t.parquet", tmp_path / "rejects.jsonl"
    code = ingest_main(["--format", "messages-jsonl", "--benchmark", "b", "--out", str(out), "--rejects",
                        str(rejects), "--max-reject-fraction", "0.5", "--quiet", str(src)])
    assert code == 0
    assert sorted(s.session_id for s in read_sessions(out)) == [f"ok-{i}" for i in range(7)]
    found = {(r["line"], str(r["reason"]).split(":")[0]) for r in _rejects(rejects)}
    assert {r["file"] for r in _rejects(rejects)} == {str(src)}
    assert found == {(8, "Expecting property name enclosed in double quotes"),
                     (9, "the conversation has no user message"),
                     (10, "the conversation has no assistant message (no model call)"),
                     (11, "duplicate session_id 'ok-0' (first read from " + str(src))}


def test_too_many_rejects_fail_the_run_with_a_clear_message(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = write_jsonl(tmp_path / "s.jsonl", [json.dumps(messages_session("ok")), "[1, 2]"])
    out, rejects = tmp_path / "t.parquet", tmp_path / "r.jsonl"
    code = ingest_main(["--format", "messages-jsonl", "--benchmark", "b", "--out", str(out), "--rejects",
                        str(rejects), "--max-reject-fraction", "0.1", "--quiet", str(src)])
    assert code == 1
    assert "50.0% of inputs were rejected, more than the allowed 10.0%" in caplog.text
    assert _rejects(rejects) == [{"file": str(src), "line": 2, "reason": "a line must be a JSON object"}]


def test_corrupt_gzip_and_missing_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_mini_swe(tmp_path / "c", n=2)
    broken = tmp_path / "c" / "trajs" / "proj__proj-1.traj.json.gz"
    broken.write_bytes(broken.read_bytes()[:40])
    out, rejects = tmp_path / "t.parquet", tmp_path / "r.jsonl"
    code = ingest_main(["--format", "mini-swe-agent", "--benchmark", "b", "--out", str(out), "--rejects",
                        str(rejects), "--quiet", str(tmp_path / "c")])
    assert code == 1  # 1 of 2 rejected is over the default 5%
    (reject,) = _rejects(rejects)
    assert reject["file"] == str(broken) and reject["line"] == 0
    assert str(reject["reason"]).startswith("unreadable trajectory")
    code = ingest_main(["--format", "mini-swe-agent", "--benchmark", "b", "--out", str(out), "--quiet",
                        str(tmp_path / "nowhere")])
    assert code == 2 and "nowhere: no such file or folder" in caplog.text


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        ingest_main(["--out", str(tmp_path / "x.parquet")])
    assert info.value.code == 2

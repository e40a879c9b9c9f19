from __future__ import annotations

import json
from pathlib import Path

import pytest

from basin_pipeline.ingest import main as ingest_main
from basin_runtime.session_log import LoggedCall, SessionLogError, SessionLogRecord
from basin_runtime.session_table import read_sessions
from basin_runtime.tokenizer import get_tokenizer
from tests.pipeline.fixtures import TASK, messages_session, write_jsonl, write_mini_swe


def _ingest(tmp_path: Path, fmt: str, *srcs: Path) -> tuple[int, Path]:
    out = tmp_path / "out.parquet"
    code = ingest_main(["--format", fmt, "--benchmark", "bench-x", "--out", str(out), "--quiet",
                        *[str(s) for s in srcs]])
    return code, out


def test_mini_swe_agent_folder(tmp_path: Path) -> None:
    ids = write_mini_swe(tmp_path / "corpus", n=2)
    code, out = _ingest(tmp_path, "mini-swe-agent", tmp_path / "corpus")
    assert code == 0
    sessions = {s.session_id: s for s in read_sessions(out)}
    assert set(sessions) == set(ids)
    s = sessions[ids[0]]
    assert (s.benchmark, s.source, s.agent, s.model) == ("bench-x", "corpus", "mini-swe-agent 1.15.0", "test/model-x")
    assert s.resolved is True and sessions[ids[1]].resolved is None  # from resolved.json beside the trajs
    assert s.task_text == TASK  # the whole first user message
    assert s.task_description == "Fix the off-by-one in utils.slice()"
    assert s.n_calls == 3
    assert [c.recorded_prompt_tokens for c in s.calls] == [100, 140, 180]
    assert [c.cached_tokens for c in s.calls] == [0, 90, 130]
    assert [c.gap_s for c in s.calls] == [4.0, 0.0, None]  # the step back (jitter) clamps to zero
    prompts = [c.prompt_tokens for c in s.calls]
    assert prompts == sorted(prompts) and s.peak_prompt_tokens == prompts[-1]


def test_plain_json_trajectory_file(tmp_path: Path) -> None:
    write_mini_swe(tmp_path / "c", n=1, gz=False)
    code, out = _ingest(tmp_path, "mini-swe-agent", tmp_path / "c" / "trajs" / "proj__proj-0.traj.json")
    assert code == 0 and len(read_sessions(out)) == 1


def test_messages_jsonl_with_tools_times_and_unknown_fields(tmp_path: Path) -> None:
    lines = [json.dumps(messages_session("a")), json.dumps(messages_session("b", with_times=False, tools=False))]
    path = write_jsonl(tmp_path / "sessions.jsonl", lines, gz=True)
    code, out = _ingest(tmp_path, "messages-jsonl", path)
    assert code == 0
    a, b = sorted(read_sessions(out), key=lambda s: s.session_id)
    assert a.source == "toy-airline" and a.benchmark == "bench-x" and a.resolved is True
    assert a.task_text == "I want to change my flight." and a.task_description == "hidden instruction"
    assert [c.gap_s for c in a.calls] == [0.5, 5.0, None]  # answer t -> t of the message before the next call
    assert [c.gap_s for c in b.calls] == [None, None, None]
    tools_tokens = get_tokenizer().count_tools(messages_session("a")["tools"], has_system=True)
    assert a.first_prompt_tokens - b.first_prompt_tokens == tools_tokens


def test_gateway_log_round_trip(tmp_path: Path) -> None:
    record = SessionLogRecord(
        session_id="gw-1", model="qwen", tokenizer="qwen3.6", task_text="fix the bug", task_chars=11,
        started_at=100.0, ended_at=130.0, end_reason="ended", workload="swe",
        calls=(LoggedCall(100.0, 104.0, 1200, 80, 0), LoggedCall(110.0, 115.0, 1500, 60, 1200)),
        predicted_peak_tokens=4000.0,
    )
    path = write_jsonl(tmp_path / "gateway.jsonl", [record.to_json()])
    code, out = _ingest(tmp_path, "gateway-log", path)
    assert code == 0
    (s,) = read_sessions(out)
    assert (s.session_id, s.task_text, s.peak_prompt_tokens, s.tokenizer) == ("gw-1", "fix the bug", 1500, "qwen3.6")
    assert [c.gap_s for c in s.calls] == [6.0, None] and [c.cached_tokens for c in s.calls] == [0, 1200]


# A line exactly as the version-1 writer wrote it (before call outcomes, `adopted` and reservations).
V1_LINE = ('{"format": "basin-session-log", "version": 1, "session_id": "gw-old", "workload": null, "model": "qwen", '
           '"tokenizer": "qwen3.6", "task_text": "fix the bug", "task_chars": 11, "started_at": 100.0, '
           '"ended_at": 130.0, "end_reason": "ended", "predicted_peak_tokens": 4000.0, "calls": ['
           '{"started_at": 100.0, "ended_at": 104.0, "prompt_tokens": 1200, "completion_tokens": 80, '
           '"cached_tokens": 0},'
           ' {"started_at": 110.0, "ended_at": 115.0, "prompt_tokens": 1500, "completion_tokens": 60, '
           '"cached_tokens": 1200}]}')


def test_a_version_1_log_line_is_still_read_beside_version_2(tmp_path: Path) -> None:
    old = SessionLogRecord.from_json(V1_LINE)
    assert old.adopted is False and old.reserved_peak_tokens is None
    assert [c.outcome for c in old.calls] == [None, None]
    new = SessionLogRecord(
        session_id="gw-new", model="qwen", tokenizer="qwen3.6", task_text="add a test", task_chars=10,
        started_at=200.0, ended_at=230.0, end_reason="ended",
        calls=(LoggedCall(200.0, 204.0, 900, 50, 0, "completed"), LoggedCall(210.0, 215.0, 1100, 40, 900, "completed")),
        predicted_peak_tokens=3000.0, reserved_peak_tokens=5100.0,
    )
    assert json.loads(new.to_json())["version"] == 2
    path = write_jsonl(tmp_path / "gateway.jsonl", [V1_LINE, new.to_json()])
    code, out = _ingest(tmp_path, "gateway-log", path)
    assert code == 0
    sessions = {s.session_id: s for s in read_sessions(out)}
    assert sorted(sessions) == ["gw-new", "gw-old"]
    assert sessions["gw-old"].peak_prompt_tokens == 1500 and sessions["gw-new"].peak_prompt_tokens == 1100


def test_a_log_line_of_an_unknown_version_is_refused_naming_the_versions_read() -> None:
    line = V1_LINE.replace('"version": 1', '"version": 3')
    with pytest.raises(SessionLogError, match=r"version 3.*version 1 or 2"):
        SessionLogRecord.from_json(line)

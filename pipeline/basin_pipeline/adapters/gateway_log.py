"""The gateway's own session log (format in `basin_runtime.session_log`): token counts are final.

Rules:
- A record's `workload` (the `X-Basin-Workload` header the client sent) is its benchmark: a gateway
  log mixes workloads, and the gateway serves `peak_predictor-<workload>.onnx` per workload, so each
  workload trains its own model. Records without a workload get the corpus's benchmark (`--benchmark`,
  or the `benchmark` of the `ingest.corpora` entry); ingest fills it in (the reader leaves it empty).
- A workload is client text but becomes a model file name, so it must be a plain name (letters,
  digits, `.`, `_`, `-`; at most 100 characters, not starting with `.` or `-`), or the record is rejected.
- The task id is a hash of the task text: the gateway knows no task ids, and sessions with the same
  text are the same task to a text model, so they must share a cross-validation fold.
- A record whose raw task text was not kept cannot train a text model, so it is rejected with that
  reason rather than dropped silently; a call's gap runs from its end to the next call's start.
- Restarts (format version 2): a session cut by a graceful shutdown (`end_reason: shutdown`, or `moved`
  to another replica sharing the state) and adopted by the next run or replica (`adopted: true`, same
  session id, later in the same file: replicas that write one log) is one session:
  the two records are joined (calls in order; text, start and prediction from the first part). A cut
  part never resumed in its file, or an adopted part whose first part is not there (the previous run
  was killed, or rotation split them), has an unknown first prompt or peak: rejected, with that reason.
- A session released as `failed` (none of its calls was served) has nothing to learn from: rejected.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from basin_pipeline.adapters.files import open_text
from basin_pipeline.records import Reject, non_negative_gap
from basin_runtime.session_log import CUT_REASONS, SessionLogError, SessionLogRecord
from basin_runtime.session_table import Call, Session

WORKLOAD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")


def task_id_of(task_text: str) -> str:
    """The task id of a logged session: sessions with the same task text share it."""
    return "text-" + hashlib.sha256(task_text.encode("utf-8")).hexdigest()[:16]


def record_to_session(record: SessionLogRecord, source: str) -> Session:
    """A finished gateway session as a session-table row (benchmark = workload; empty when there is none)."""
    if record.task_text is None:
        raise ValueError("the log kept no task text (text-free logging); it cannot train a text model")
    if not record.calls:
        raise ValueError("the session made no call")
    if record.workload is not None and not WORKLOAD_NAME.fullmatch(record.workload):
        raise ValueError(f"workload {record.workload[:120]!r} cannot name a benchmark and its model file "
                         "(letters, digits, '.', '_', '-' only, at most 100)")
    calls = []
    for k, call in enumerate(record.calls):
        following = record.calls[k + 1] if k + 1 < len(record.calls) else None
        gap = (
            non_negative_gap(following.started_at, call.ended_at)
            if following is not None and call.ended_at is not None
            else None
        )
        calls.append(Call(call.prompt_tokens, call.completion_tokens, call.cached_tokens, None, gap))
    return Session(
        session_id=record.session_id,
        benchmark=record.workload or "",
        source=source,
        agent="unknown",
        model=record.model,
        task_id=task_id_of(record.task_text),
        task_text=record.task_text,
        task_description="",
        tokenizer=record.tokenizer,
        calls=tuple(calls),
        resolved=None,
    )


def read_gateway_log(path: Path, source: str) -> Iterator[Session | Reject]:
    """Read every line of a gateway session log, joining the parts of sessions adopted across a restart."""
    cut: dict[str, tuple[int, SessionLogRecord]] = {}  # session id -> (line, record) of a part cut by a shutdown
    try:
        with open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = SessionLogRecord.from_json(line)
                    if record.adopted:
                        first = cut.pop(record.session_id, None)
                        if first is None:
                            raise ValueError("adopted after a gateway restart, but its earlier part is not in this "
                                             "file (the previous run was killed, or rotation split it): its first "
                                             "prompt is mid-session")
                        number, record = first[0], join_parts(first[1], record)
                    if record.end_reason in CUT_REASONS:
                        cut[record.session_id] = (number, record)
                        continue
                    if record.end_reason == "failed":
                        raise ValueError("none of the session's calls was served (end reason `failed`)")
                    yield record_to_session(record, source)
                except (SessionLogError, ValueError) as exc:
                    yield Reject(str(path), number, str(exc))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        yield Reject(str(path), 0, f"unreadable file: {exc}")
        return
    for number, _ in cut.values():
        yield Reject(str(path), number, "cut by a gateway shutdown (or moved to another replica) and not resumed in "
                                        "this file: its peak is unknown")


def join_parts(first: SessionLogRecord, adopted: SessionLogRecord) -> SessionLogRecord:
    """One record of a session cut by a shutdown (`first`) and adopted by the next gateway run."""
    return replace(first, ended_at=adopted.ended_at, end_reason=adopted.end_reason,
                   calls=first.calls + adopted.calls, adopted=False)

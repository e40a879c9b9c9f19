"""The gateway's own session log (format in `basin_runtime.session_log`): token counts are final.

A record whose raw task text was not kept cannot train a text model, so it is rejected with that
reason rather than dropped silently; a call's gap runs from its end to the next call's start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from basin_runtime.session_log import SessionLogError, SessionLogRecord
from basin_runtime.session_table import Call, Session
from pipeline.adapters.files import open_text
from pipeline.records import Reject, non_negative_gap


def record_to_session(record: SessionLogRecord, source: str) -> Session:
    """A finished gateway session as a session-table row (benchmark set by the caller)."""
    if record.task_text is None:
        raise ValueError("the log kept no task text (text-free logging); it cannot train a text model")
    if not record.calls:
        raise ValueError("the session made no call")
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
        benchmark=record.workload or "gateway",
        source=source,
        agent="unknown",
        model=record.model,
        task_id=record.session_id,
        task_text=record.task_text,
        task_description="",
        tokenizer=record.tokenizer,
        calls=tuple(calls),
        resolved=None,
    )


def read_gateway_log(path: Path, source: str) -> Iterator[Session | Reject]:
    """Read every line of a gateway session log."""
    try:
        with open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield record_to_session(SessionLogRecord.from_json(line), source)
                except (SessionLogError, ValueError) as exc:
                    yield Reject(str(path), number, str(exc))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        yield Reject(str(path), 0, f"unreadable file: {exc}")

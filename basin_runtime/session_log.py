"""The gateway's session log: one JSON line per finished session, read back by `basin_pipeline.ingest`.

Format `basin-session-log`, version 2 (version 1 lines are still read). Each line is an object:

    {"format": "basin-session-log", "version": 2,
     "session_id": str, "workload": str | null, "model": str, "tokenizer": str,
     "task_text": str | null,        # null when the gateway keeps no raw text
     "task_chars": int,              # length of the task text, always kept
     "started_at": float, "ended_at": float,   # unix seconds
     "end_reason": "ended" | "idle" | "withdrawn" | "shed" | "failed" | "shutdown" | "moved",
     "predicted_peak_tokens": float | null,
     "reserved_peak_tokens": float | null,   # version 2, optional: m(q) x the prediction, what it reserved
     "adopted": bool,                # version 2: the session was live before a gateway restart and this
                                     # record starts at its adoption call (its earlier calls are in the
                                     # previous run's record, if that run logged it)
     "calls": [{"started_at": float, "ended_at": float | null, "prompt_tokens": int,
                "completion_tokens": int, "cached_tokens": int | null,
                "outcome": str | null}]}    # version 2: the call's outcome (`CallOutcome`)

End reasons: `failed` - released because no call of the session was ever served (its first calls all
failed: upstream down, a 4xx); `shutdown` - still live when the gateway shut down gracefully (the
record is cut there; the session may be adopted by the next run); `moved` - replicas sharing one state
(`--state`): the session's client went on through another replica, which took it over (the record is cut
there, as at a shutdown, and the other replica's record of it is `adopted`). Version 1 lines read as
`adopted: false` with no call outcomes.

Token counts are already the serving tokenizer's (the gateway counts with `basin_runtime.tokenizer`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

LOG_FORMAT = "basin-session-log"
LOG_VERSION = 2
READ_VERSIONS = (1, 2)
END_REASONS = ("ended", "idle", "withdrawn", "shed", "failed", "shutdown", "moved")
CUT_REASONS = ("shutdown", "moved")  # the record stops mid-session; another record goes on with it


class SessionLogError(ValueError):
    """A session-log line that does not follow the format."""


@dataclass(frozen=True)
class LoggedCall:
    """One call the gateway forwarded for a session."""

    started_at: float
    ended_at: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    outcome: str | None = None  # version 2; None when read from a version-1 line


@dataclass(frozen=True)
class SessionLogRecord:
    """What the gateway saw of one finished session."""

    session_id: str
    model: str
    tokenizer: str
    task_text: str | None
    task_chars: int
    started_at: float
    ended_at: float
    end_reason: str
    calls: tuple[LoggedCall, ...]
    workload: str | None = None
    predicted_peak_tokens: float | None = None
    adopted: bool = False
    reserved_peak_tokens: float | None = None

    def to_json(self) -> str:
        """One log line (no trailing newline)."""
        return json.dumps(self.to_object(), ensure_ascii=False)

    def to_object(self) -> dict[str, Any]:
        """The log line as a JSON object (any JSON encoder writes it; the gateway's writer uses orjson)."""
        body = {name: getattr(self, name) for name in _RECORD_FIELDS}  # asdict's deep copy costs 5x more
        body["calls"] = [{name: getattr(c, name) for name in _CALL_FIELDS} for c in self.calls]
        return {"format": LOG_FORMAT, "version": LOG_VERSION, **body}

    @classmethod
    def from_json(cls, line: str) -> SessionLogRecord:
        """Parse one log line, raising `SessionLogError` with the reason."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SessionLogError(f"not JSON: {exc}") from exc
        if not isinstance(obj, Mapping):
            raise SessionLogError("a log line must be a JSON object")
        if obj.get("format") != LOG_FORMAT or obj.get("version") not in READ_VERSIONS:
            raise SessionLogError(f"format {obj.get('format')!r} version {obj.get('version')!r}, expected "
                                  f"{LOG_FORMAT!r} version {' or '.join(map(str, READ_VERSIONS))}")
        return cls._from_mapping(obj)

    @classmethod
    def _from_mapping(cls, obj: Mapping[str, Any]) -> SessionLogRecord:
        try:
            calls = tuple(LoggedCall(**c) for c in obj["calls"])
            record = cls(
                session_id=str(obj["session_id"]),
                model=str(obj["model"]),
                tokenizer=str(obj["tokenizer"]),
                task_text=obj["task_text"],
                task_chars=int(obj["task_chars"]),
                started_at=float(obj["started_at"]),
                ended_at=float(obj["ended_at"]),
                end_reason=str(obj["end_reason"]),
                calls=calls,
                workload=obj.get("workload"),
                predicted_peak_tokens=obj.get("predicted_peak_tokens"),
                adopted=_flag(obj.get("adopted", False)),
                reserved_peak_tokens=obj.get("reserved_peak_tokens"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionLogError(f"missing or malformed field: {exc}") from exc
        record.check()
        return record

    def check(self) -> None:
        """Raise `SessionLogError` if a value is out of range."""
        if self.end_reason not in END_REASONS:
            raise SessionLogError(f"end_reason {self.end_reason!r} is not one of {END_REASONS}")
        if self.task_text is not None and len(self.task_text) != self.task_chars:
            raise SessionLogError(f"task_chars {self.task_chars} != len(task_text) {len(self.task_text)}")
        for k, call in enumerate(self.calls):
            if call.prompt_tokens < 0 or call.completion_tokens < 0:
                raise SessionLogError(f"call {k}: negative token count")
            if not math.isfinite(call.started_at):
                raise SessionLogError(f"call {k}: started_at {call.started_at} is not finite")


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"adopted must be true or false, got {value!r}")
    return value


_RECORD_FIELDS = tuple(f.name for f in fields(SessionLogRecord))
_CALL_FIELDS = tuple(f.name for f in fields(LoggedCall))

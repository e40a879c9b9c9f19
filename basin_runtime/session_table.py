"""The session table: one row per agent session with exact per-call token counts.

The schema is defined here once; `write_sessions` and `read_sessions` validate it on every write and
read. Invariants checked per row: at least one call; `n_calls == len(calls)`; `first_prompt_tokens`
is the first call's prompt and `peak_prompt_tokens` the largest; `task_chars == len(task_text)`;
token counts are non-negative; `gap_s` is non-negative where known; session ids are unique.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_VERSION = "1"

CALL_TYPE = pa.struct(
    [
        pa.field("prompt_tokens", pa.int64(), nullable=False),
        pa.field("completion_tokens", pa.int64(), nullable=False),
        pa.field("cached_tokens", pa.int64(), nullable=True),
        pa.field("recorded_prompt_tokens", pa.int64(), nullable=True),
        pa.field("gap_s", pa.float64(), nullable=True),
    ]
)

SCHEMA = pa.schema(
    [
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("benchmark", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("agent", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("task_id", pa.string(), nullable=False),
        pa.field("task_text", pa.string(), nullable=False),
        pa.field("task_description", pa.string(), nullable=False),
        pa.field("task_chars", pa.int64(), nullable=False),
        pa.field("first_prompt_tokens", pa.int64(), nullable=False),
        pa.field("peak_prompt_tokens", pa.int64(), nullable=False),
        pa.field("n_calls", pa.int64(), nullable=False),
        pa.field("calls", pa.list_(pa.field("item", CALL_TYPE, nullable=False)), nullable=False),
        pa.field("tokenizer", pa.string(), nullable=False),
        pa.field("resolved", pa.bool_(), nullable=True),
    ],
    metadata={"basin.schema_version": SCHEMA_VERSION},
)


class SessionTableError(ValueError):
    """A session table (or a row of one) that breaks the schema or its invariants."""


@dataclass(frozen=True)
class Call:
    """One model call of a session."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    recorded_prompt_tokens: int | None = None
    gap_s: float | None = None


@dataclass(frozen=True)
class Session:
    """One agent session: identity, task text and the token counts of every call."""

    session_id: str
    benchmark: str
    source: str
    agent: str
    model: str
    task_id: str
    task_text: str
    task_description: str
    tokenizer: str
    calls: tuple[Call, ...]
    resolved: bool | None = None
    task_chars: int = field(init=False)
    first_prompt_tokens: int = field(init=False)
    peak_prompt_tokens: int = field(init=False)
    n_calls: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.calls:
            raise SessionTableError(f"session {self.session_id!r}: has no calls")
        object.__setattr__(self, "task_chars", len(self.task_text))
        object.__setattr__(self, "first_prompt_tokens", self.calls[0].prompt_tokens)
        object.__setattr__(self, "peak_prompt_tokens", max(c.prompt_tokens for c in self.calls))
        object.__setattr__(self, "n_calls", len(self.calls))

    def to_row(self) -> dict[str, Any]:
        """The session as a dict in schema column order."""
        row = asdict(self)
        row["calls"] = [asdict(c) for c in self.calls]
        return {name: row[name] for name in SCHEMA.names}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Session:
        """A session from a table row (derived columns are recomputed, then checked)."""
        calls = tuple(Call(**c) for c in row["calls"])
        fields = {k: row[k] for k in SCHEMA.names if k not in _DERIVED and k != "calls"}
        return cls(calls=calls, **fields)


_DERIVED = ("task_chars", "first_prompt_tokens", "peak_prompt_tokens", "n_calls")


def _row_problems(row: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    calls = row["calls"]
    if not calls:
        return ["has no calls"]
    prompts = [c["prompt_tokens"] for c in calls]
    expected = {
        "n_calls": len(calls),
        "first_prompt_tokens": prompts[0],
        "peak_prompt_tokens": max(prompts),
        "task_chars": len(row["task_text"]),
    }
    for column, value in expected.items():
        if row[column] != value:
            problems.append(f"{column} is {row[column]} but the calls give {value}")
    for k, call in enumerate(calls):
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "recorded_prompt_tokens"):
            if call[name] is not None and call[name] < 0:
                problems.append(f"call {k}: {name} is negative ({call[name]})")
        gap = call["gap_s"]
        if gap is not None and (not math.isfinite(gap) or gap < 0):
            problems.append(f"call {k}: gap_s is {gap}, not a finite non-negative number")
    return problems


def validate_table(table: pa.Table, where: str = "session table") -> None:
    """Raise `SessionTableError` naming the place, row and column of every broken rule."""
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise SessionTableError(f"{where}: schema differs from Basin's session table v{SCHEMA_VERSION}:\n"
                                f"expected {SCHEMA}\nfound {table.schema}")
    version = (table.schema.metadata or {}).get(b"basin.schema_version", b"?").decode()
    if version != SCHEMA_VERSION:
        raise SessionTableError(f"{where}: schema version {version}, this code reads {SCHEMA_VERSION}")
    problems: list[str] = []
    seen: set[str] = set()
    for i, row in enumerate(table.to_pylist()):
        if row["session_id"] in seen:
            problems.append(f"row {i} ({row['session_id']!r}): duplicate session_id")
        seen.add(row["session_id"])
        problems.extend(f"row {i} ({row['session_id']!r}): {p}" for p in _row_problems(row))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise SessionTableError(f"{where}: {len(problems)} problem(s):\n  {shown}{more}")


def to_table(sessions: Iterable[Session]) -> pa.Table:
    """An Arrow table of sessions in the session-table schema."""
    rows = [s.to_row() for s in sessions]
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def write_sessions(path: str | Path, sessions: Iterable[Session] | pa.Table) -> pa.Table:
    """Validate and write a session table to parquet; returns the table written."""
    table = sessions if isinstance(sessions, pa.Table) else to_table(sessions)
    validate_table(table, where=str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd")
    return table


def read_table(path: str | Path) -> pa.Table:
    """Read and validate a session table."""
    if not Path(path).exists():
        raise SessionTableError(f"{path}: no such session table")
    table = pq.read_table(path)
    validate_table(table, where=str(path))
    return table


def read_sessions(path: str | Path) -> list[Session]:
    """Read and validate a session table as `Session` objects."""
    return [Session.from_row(row) for row in read_table(path).to_pylist()]


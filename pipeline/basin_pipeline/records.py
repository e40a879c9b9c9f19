"""What adapters hand to ingest: a raw conversation to count, or a reject with its place and reason."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reject:
    """An input that did not become a session: where it was and why."""

    file: str
    line: int  # 1-based line of a JSONL file; 0 for a whole file
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "reason": self.reason}


@dataclass(frozen=True)
class RecordedUsage:
    """What the agent's own API reported for one call (the agent model's tokenizer, not ours)."""

    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True)
class RawSession:
    """One conversation as a source holds it, before token counting."""

    session_id: str
    source: str
    agent: str
    model: str
    task_id: str
    task_description: str
    resolved: bool | None
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    usage: Sequence[RecordedUsage | None]  # one per assistant message
    gaps_s: Sequence[float | None]  # one per assistant message: answer -> next call
    origin: str  # "file" or "file:line", for error messages


def non_negative_gap(later: float, earlier: float) -> float:
    """Seconds between two timestamps; a small step back (clock jitter) counts as zero."""
    return max(0.0, later - earlier)

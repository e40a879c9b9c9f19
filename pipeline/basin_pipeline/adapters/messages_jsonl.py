"""Sessions as JSON lines with an OpenAI-style `messages` list.

Per line: `messages` [{role, content[, t][, name][, tool_calls]}], and optionally `session_id`,
`benchmark` (kept as `source`), `task_id`, `task_description`, `agent`, `model`, `resolved`, and
`tools` (function schemas sent with every call, counted in every prompt). `t` is seconds on any
clock; a call's gap runs from its answer's `t` to the `t` of the last message before the next call.
Unknown fields are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from basin_pipeline.adapters.files import open_text
from basin_pipeline.records import RawSession, Reject, non_negative_gap


def _resolved(value: object) -> bool | None:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return value > 0
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"`resolved` {value!r} is not a boolean")


def _time(message: Mapping[str, Any]) -> float | None:
    t = message.get("t")
    if t is None:
        return None
    return float(t)


def _gaps(messages: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Per assistant message: seconds from its answer to the next call (None when unknown or last)."""
    answers = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    gaps: list[float | None] = []
    for k, i in enumerate(answers):
        if k + 1 == len(answers):
            gaps.append(None)
            continue
        answered, sent = _time(messages[i]), _time(messages[answers[k + 1] - 1])
        gaps.append(non_negative_gap(sent, answered) if answered is not None and sent is not None else None)
    return gaps


def _check_messages(messages: object) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "no `messages` list"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            return f"message {k} is not an object with a `role`"
    return None


def parse_session(obj: Mapping[str, Any], source: str, origin: str, fallback_id: str) -> RawSession:
    """One JSON object as a raw session (raises ValueError/TypeError on malformed fields)."""
    problem = _check_messages(obj.get("messages"))
    if problem:
        raise ValueError(problem)
    messages: list[dict[str, Any]] = obj["messages"]
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("`tools` must be a list of function schemas")
    n_answers = sum(1 for m in messages if m.get("role") == "assistant")
    return RawSession(
        session_id=str(obj.get("session_id") or fallback_id),
        source=str(obj.get("benchmark") or source),
        agent=str(obj.get("agent") or "unknown"),
        model=str(obj.get("model") or "unknown"),
        task_id=str(obj.get("task_id") or obj.get("session_id") or fallback_id),
        task_description=str(obj.get("task_description") or ""),
        resolved=_resolved(obj.get("resolved")),
        messages=messages,
        tools=tools,
        usage=[None] * n_answers,
        gaps_s=_gaps(messages),
        origin=origin,
    )


def read_messages_jsonl(path: Path, source: str) -> Iterator[RawSession | Reject]:
    """Read every line of a messages-JSONL file as a raw session, or a reject with its reason."""
    try:
        with open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError("a line must be a JSON object")
                    yield parse_session(obj, source, f"{path}:{number}", f"{path.name}:{number}")
                except (ValueError, TypeError) as exc:
                    yield Reject(str(path), number, str(exc))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        yield Reject(str(path), 0, f"unreadable file: {exc}")

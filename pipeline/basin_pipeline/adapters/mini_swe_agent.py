"""mini-swe-agent trajectories (`*.traj.json[.gz]`, trajectory_format mini-swe-agent-1).

`messages` is the whole conversation; each assistant message carries `extra.response`, the raw API
response with `usage` and `created` (unix seconds). Only `created` is recorded per call, so a call's
gap is the time between two consecutive `created` stamps: an upper bound on the tool time, since
`created` is stamped when the provider starts a generation, so the gap also holds this call's own
generation latency (it follows this call's completion size; basin_sim/workload/tool_time.py takes a
latency line off). A `resolved.json`
(instance_id -> bool) in the file's folder or the one above it is used when present.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

from basin_pipeline.adapters.files import open_text
from basin_pipeline.records import RawSession, RecordedUsage, Reject, non_negative_gap

_PR_DESCRIPTION = re.compile(r"<pr_description>\s*(?:Consider the following PR description:\s*)?(.*?)</pr_description>",
                             re.DOTALL)


@cache
def _resolved_map(folder: Path) -> dict[str, bool]:
    for candidate in (folder / "resolved.json", folder.parent / "resolved.json"):
        if candidate.is_file():
            data = json.loads(candidate.read_text(encoding="utf-8"))
            return {str(k): bool(v) for k, v in data.items() if v is not None}
    return {}


def _usage(message: Mapping[str, Any]) -> tuple[RecordedUsage | None, float | None]:
    response = (message.get("extra") or {}).get("response") or {}
    usage = response.get("usage") or {}
    created = response.get("created")
    details = usage.get("prompt_tokens_details") or {}
    recorded = RecordedUsage(usage.get("prompt_tokens"), details.get("cached_tokens")) if usage else None
    return recorded, float(created) if isinstance(created, int | float) else None


def _task_description(first_user: str) -> str:
    match = _PR_DESCRIPTION.search(first_user)
    return match.group(1).strip() if match else ""


def read_mini_swe_agent(path: Path, source: str) -> Iterator[RawSession | Reject]:
    """Read one trajectory file as one raw session."""
    try:
        with open_text(path) as handle:
            data = json.load(handle)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        yield Reject(str(path), 0, f"unreadable trajectory: {exc}")
        return
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        yield Reject(str(path), 0, "no `messages` list of objects in the trajectory")
        return
    instance_id = str(data.get("instance_id") or path.name.split(".traj.json")[0])
    assistants = [m for m in messages if m.get("role") == "assistant"]
    usage_and_times = [_usage(m) for m in assistants]
    created = [t for _, t in usage_and_times]
    gaps: list[float | None] = [
        non_negative_gap(b, a) if a is not None and b is not None else None
        for a, b in pairwise(created)
    ]
    gaps.append(None)
    first_user = next((m.get("content") for m in messages if m.get("role") == "user"), "")
    response = ((assistants[0].get("extra") or {}).get("response") or {}) if assistants else {}
    info = data.get("info") or {}
    yield RawSession(
        session_id=instance_id,
        source=source,
        agent=f"mini-swe-agent {info.get('mini_version', '?')}",
        model=str(response.get("model") or "unknown"),
        task_id=instance_id,
        task_description=_task_description(first_user if isinstance(first_user, str) else ""),
        resolved=_resolved_map(path.parent).get(instance_id),
        messages=messages,
        tools=None,
        usage=[u for u, _ in usage_and_times],
        gaps_s=gaps,
        origin=str(path),
    )

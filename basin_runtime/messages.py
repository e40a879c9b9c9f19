"""OpenAI-style chat messages as Basin reads them: role, text content, optional timestamp."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = Mapping[str, Any]


def message_text(content: object) -> str:
    """The text of a message's `content`: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                parts.append(text if isinstance(text, str) else json.dumps(part, sort_keys=True))
        return "".join(parts)
    if isinstance(content, Mapping):
        return json.dumps(content, sort_keys=True)
    raise TypeError(f"message content must be a string, a list of parts or null, not {type(content).__name__}")


def tool_calls_text(message: Message) -> str:
    """OpenAI `tool_calls` of an assistant message, one JSON object per line (as rendered into a prompt)."""
    calls = message.get("tool_calls") or []
    lines = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        lines.append(
            json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}, sort_keys=True)
        )
    return "\n".join(lines)


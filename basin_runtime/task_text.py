"""The task text: what a gateway can see of a session at its first call.

One function cuts it out of the first prompt, and both ingest (training) and the gateway (serving)
call it, so the predictor reads at serving time exactly the text it was trained on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from basin_runtime.messages import Message, message_text


class TaskTextError(ValueError):
    """The prompt holds nothing to cut a task text from."""


@dataclass(frozen=True)
class TaskTextRule:
    """How to cut the task text: the first user message, optionally narrowed by a regex.

    With `pattern`, the named group `task` (or else group 1, or else the whole match) of the first
    match in the first user message is the task text; with no match, the whole message is.
    """

    pattern: str | None = None

    def __post_init__(self) -> None:
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise TaskTextError(f"task text pattern {self.pattern!r} is not a valid regex: {exc}") from exc


DEFAULT_RULE = TaskTextRule()


def first_user_message(messages: Sequence[Message]) -> str:
    """The content of the first user message."""
    for message in messages:
        if message.get("role") == "user":
            return message_text(message.get("content"))
    raise TaskTextError("the conversation has no user message to take the task text from")


def extract_task_text(messages: Sequence[Message], rule: TaskTextRule = DEFAULT_RULE) -> str:
    """The task text of a conversation's first prompt, cut out by `rule`."""
    text = first_user_message(messages)
    if rule.pattern is None:
        return text
    match = re.search(rule.pattern, text, flags=re.DOTALL)
    if match is None:
        return text
    if "task" in match.groupdict():
        return match.group("task") or ""
    return match.group(1) if match.re.groups >= 1 else match.group(0)

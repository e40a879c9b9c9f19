# One inference call as the gateway reads it: which endpoint, the parsed body, what it asks about.
#
# Rules:
# - The body must be a JSON object; a chat call needs a non-empty `messages` list of objects with a
#   string `role`; `/v1/completions` needs `prompt`; `/generate` needs `text` or `input_ids`.
#   Anything else is a `BadRequestError` (400) naming the field; SGLang validates the rest.
# - A chat call whose messages already hold an assistant turn is a continuation: plainly not the
#   first call of its session. Raw-prompt calls (`/v1/completions`, `/generate`) never are.
# - A list of prompts is a batch; the task text of a raw-prompt call is its (first) text prompt.
"""Parse and validate the body of an inference call."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from basin_runtime.gateway.errors import BadRequestError
from basin_runtime.messages import Message

CallKind = Literal["chat", "completion", "generate"]
UPSTREAM_PATHS: dict[CallKind, str] = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "generate": "/generate",
}


@dataclass(frozen=True)
class Call:
    """A parsed inference call."""

    kind: CallKind
    body: dict[str, Any]
    messages: Sequence[Message] | None  # chat calls
    tools: Sequence[Mapping[str, Any]] | None  # chat calls
    texts: tuple[str, ...]  # raw-prompt calls: the text prompts
    token_ids_count: int  # raw-prompt calls: prompt tokens sent as ids
    is_batch: bool
    user: str | None

    @property
    def path(self) -> str:
        """The upstream path this call goes to."""
        return UPSTREAM_PATHS[self.kind]

    @property
    def is_stream(self) -> bool:
        """True if the client asked for a streamed (SSE) answer."""
        return self.body.get("stream") is True

    @property
    def is_continuation(self) -> bool:
        """True if the conversation already holds an assistant turn."""
        return self.messages is not None and any(m.get("role") == "assistant" for m in self.messages)


def parse_call(kind: CallKind, raw: bytes) -> Call:
    """Parse one call's body; raises `BadRequestError` naming what is wrong."""
    body = _json_object(raw)
    user = body.get("user")
    user = user if isinstance(user, str) and user else None
    if kind == "chat":
        messages = _messages(body)
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        return Call(kind, body, messages, tools, (), 0, False, user)
    field = "prompt" if kind == "completion" else ("text" if "text" in body else "input_ids")
    if field not in body:
        wanted = "`prompt`" if kind == "completion" else "`text` or `input_ids`"
        raise BadRequestError(f"the request has no {wanted}")
    texts, ids_count, is_batch = _prompt(field, body[field])
    return Call(kind, body, None, None, texts, ids_count, is_batch, user)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequestError("the request body is nested too deeply to read") from exc
    if not isinstance(body, dict):
        raise BadRequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    try:  # the gateway re-serialises the body as UTF-8 (and logs parts of it): text must be valid Unicode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequestError(f"`{_surrogate_path(body)}` holds a lone UTF-16 surrogate (an escape in "
                              "\\ud800-\\udfff without its pair), which is not valid Unicode text") from exc
    return body


def _surrogate_path(body: object) -> str:
    """Where the first string (or key) that is not encodable as UTF-8 sits, as `a.b[2]`."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                return path or "(the body)"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                key_path = f"{path}.{key}" if path else str(key)
                if not _encodes(str(key)):
                    return f"{path or '(the body)'} key {key!r}"
                stack.append((key_path, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{k}]", item) for k, item in reversed(list(enumerate(value))))
    return "(the body)"


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _messages(body: Mapping[str, Any]) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("the request has no `messages` (a non-empty list is required)")
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{k}] must be an object with a string `role`")
    return messages


def _prompt(field: str, value: object) -> tuple[tuple[str, ...], int, bool]:
    """(text prompts, number of token ids, is batch) of a `prompt`/`text`/`input_ids` value."""
    if isinstance(value, str):
        return (value,), 0, False
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return tuple(value), 0, True
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (), len(value), False
        if all(isinstance(v, list) and all(isinstance(i, int) for i in v) for v in value):
            return (), sum(len(v) for v in value), True
    got = json.dumps(value)[:80]
    raise BadRequestError(f"`{field}` must be a string, a list of strings or token ids, got {got}")

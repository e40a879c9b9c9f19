"""Reading an inference request the way SGLang's HTTP server reads it.

Rules:
- Three endpoints: `/v1/chat/completions` (messages, optional tools), `/v1/completions` (prompt: a
  string or token ids) and `/generate` (text or input_ids; options in `sampling_params`).
- Completion length: `max_completion_tokens`, else `max_tokens` (OpenAI routes), or
  `sampling_params.max_new_tokens` (/generate); a whole number >= 1. None asked: the emulator
  answers DEFAULT_COMPLETION_TOKENS tokens and ends with "stop" (as if the model emitted EOS);
  asked: exactly that many, ending with "length" (synthetic text never stops early).
- `priority` (an integer), `rid` and `session_id` (strings, top level) as SGLang takes them (`session_id`:
  GenerateReqInput's stable session tag, read by the session radix cache; carried whatever the flags); `stream`,
  `stream_options.include_usage`; the router's `bootstrap_host`, `bootstrap_port`, `bootstrap_room`;
  `return_cached_tokens_details` (OpenAI routes: the answer's `sglext.cached_tokens_details`).
- One sequence per request: `n` > 1, prompt lists and batched /generate are refused (400).
- Anything malformed is a `BadRequestError` naming the field.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from basin_emulate.errors import BadRequestError
from basin_runtime.messages import Message

DEFAULT_COMPLETION_TOKENS = 64


class Endpoint(enum.Enum):
    """The inference endpoint a request came to."""

    CHAT = "/v1/chat/completions"
    COMPLETION = "/v1/completions"
    GENERATE = "/generate"


@dataclass(frozen=True)
class Bootstrap:
    """The router's PD fields: where the prefill half's bootstrap server is, and the request's room."""

    host: str | None
    port: int | None
    room: str | None

    @property
    def is_complete(self) -> bool:
        """True when the decode half can find its prefill half."""
        return self.host is not None and self.port is not None and self.room is not None


@dataclass(frozen=True)
class Call:
    """One inference request, validated."""

    endpoint: Endpoint
    messages: list[Message] | None
    tools: list[dict[str, Any]] | None
    text: str | None
    input_ids: list[int] | None
    max_new_tokens: int | None  # as asked; None: not asked
    is_stream: bool
    include_usage: bool
    priority: int | None
    rid: str | None
    bootstrap: Bootstrap
    return_cached_tokens_details: bool = False
    session_id: str | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens the emulator generates for it."""
        return DEFAULT_COMPLETION_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    @property
    def finish_reason(self) -> str:
        """"length" when a length was asked (and reached), else "stop"."""
        return "stop" if self.max_new_tokens is None else "length"


def parse_call(endpoint: Endpoint, raw: bytes) -> Call:
    """The request in `raw` (a JSON body) sent to `endpoint`."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise BadRequestError(f"n={body['n']!r}: the emulator generates one sequence per request")
    messages = tools = text = input_ids = None
    if endpoint == Endpoint.CHAT:
        messages, tools = _messages(body), _tools(body)
        max_new = _whole(body, "max_completion_tokens")
        max_new = _whole(body, "max_tokens") if max_new is None else max_new
    elif endpoint == Endpoint.COMPLETION:
        text, input_ids = _prompt(body.get("prompt"), "prompt")
        max_new = _whole(body, "max_tokens")
    else:
        if body.get("text") is not None:
            text, input_ids = _prompt(body["text"], "text")
        else:
            text, input_ids = _prompt(body.get("input_ids"), "input_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise BadRequestError("sampling_params must be an object")
        max_new = _whole(params, "max_new_tokens")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequestError("stream_options must be an object")
    return Call(endpoint, messages, tools, text, input_ids, max_new, body.get("stream") is True,
                stream_options.get("include_usage") is True, _priority(body), _rid(body), _bootstrap(body),
                body.get("return_cached_tokens_details") is True, _session_id(body))


def _messages(body: dict[str, Any]) -> list[Message]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"messages[{index}] must be an object")
    return messages


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequestError("tools must be a list of objects")
    return tools


def _prompt(value: object, name: str) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise BadRequestError(f"{name} must not be empty")
        return value, None
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return None, value
    raise BadRequestError(f"{name} must be a non-empty string or a list of token ids (one sequence per request)")


def _whole(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequestError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


def _priority(body: dict[str, Any]) -> int | None:
    value = body.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"priority must be an integer, got {value!r}")
    return value


def parse_close_session(raw: bytes) -> str:
    """The session id of a /close_session body (SGLang's CloseSessionReqInput: {"session_id": str})."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"/close_session: the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("session_id"), str):
        raise BadRequestError("/close_session: the body must be an object with a string session_id")
    return str(body["session_id"])


def _session_id(body: dict[str, Any]) -> str | None:
    value = body.get("session_id")
    if value is not None and not isinstance(value, str):
        raise BadRequestError(f"session_id must be a string, got {value!r}")
    return value


def _rid(body: dict[str, Any]) -> str | None:
    value = body.get("rid")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"rid must be a non-empty string, got {value!r}")
    return value


def _bootstrap(body: dict[str, Any]) -> Bootstrap:
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if host is not None and not isinstance(host, str):
        raise BadRequestError(f"bootstrap_host must be a string, got {host!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise BadRequestError(f"bootstrap_port must be a port number, got {port!r}")
    if room is not None and (isinstance(room, bool) or not isinstance(room, int | str)):
        raise BadRequestError(f"bootstrap_room must be an integer, got {room!r}")
    return Bootstrap(host, port, None if room is None else str(room))

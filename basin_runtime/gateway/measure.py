# Measuring a call: its prompt size in the serving model's tokens, and its session's task text.
#
# Rules:
# - Counts are `basin_runtime.tokenizer`'s, the ones ingest trains on: a chat prompt as the chat
#   template renders it (messages, tool schemas, generation prompt; equal to `count_prompt`), raw
#   text with `count_text`, token ids as they are.
# - A session keeps a `PromptMemo`: each message's count under a digest of the message. Agents
#   resend a growing history, so a later call counts only the messages after the longest unchanged
#   prefix; a rewritten history is recounted from the first change. The result stays exact.
# - Task text: `extract_task_text` with the configured rule (the function ingest uses); a
#   conversation without a user message has an empty task text. A raw prompt is read as the first
#   user message.
# - The first prompt of a continuation (a session adopted after a restart) is everything before its
#   first assistant turn, so its prediction equals the one its real first call would have had.
"""Prompt sizes and task text of calls, as ingest counts them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from basin_runtime.gateway.calls import Call
from basin_runtime.gateway.errors import BadRequestError
from basin_runtime.messages import Message
from basin_runtime.task_text import TaskTextError, TaskTextRule, extract_task_text
from basin_runtime.tokenizer import ChatTokenizer, TokenizerError


@dataclass
class PromptMemo:
    """Per-message token counts of a session's last chat prompt, keyed by message digests."""

    keys: list[bytes] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    tools_key: bytes | None = None
    tools_tokens: int = 0


@dataclass(frozen=True)
class FirstCall:
    """What the predictor needs from a session's first call (or the conversation of an adopted one)."""

    task_text: str
    first_prompt_tokens: int
    prompt_tokens: int


class Meter:
    """Counts prompts with the serving tokenizer and cuts task texts with one rule."""

    def __init__(self, tokenizer: ChatTokenizer, rule: TaskTextRule) -> None:
        self.tokenizer = tokenizer
        self._rule = rule

    def prompt_tokens(self, call: Call, memo: PromptMemo) -> int:
        """The call's prompt size; a chat call reuses and updates the session's memo."""
        if call.messages is None:
            return sum(self.tokenizer.count_text(text) for text in call.texts) + call.token_ids_count
        try:
            return self._chat_tokens(call.messages, call.tools, memo)
        except (TokenizerError, TypeError) as exc:
            raise BadRequestError(f"cannot read the messages: {exc}") from exc

    def first_call(self, call: Call, memo: PromptMemo) -> FirstCall:
        """Task text, first prompt size and current prompt size of a session's first call."""
        prompt_tokens = self.prompt_tokens(call, memo)
        if call.messages is None:
            return FirstCall(self._task_text([{"role": "user", "content": "".join(call.texts[:1])}]),
                             prompt_tokens, prompt_tokens)
        first = prompt_tokens
        assistant = next((k for k, m in enumerate(call.messages) if m.get("role") == "assistant"), None)
        if assistant is not None:
            first = sum(memo.tokens[:assistant]) + memo.tools_tokens + self.tokenizer.generation_prompt_tokens
        return FirstCall(self._task_text(call.messages), first, prompt_tokens)

    def _chat_tokens(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None,
                     memo: PromptMemo) -> int:
        keys = [_digest(message) for message in messages]
        same = 0
        while same < min(len(keys), len(memo.keys)) and keys[same] == memo.keys[same]:
            same += 1
        memo.tokens[same:] = [self.tokenizer.count_message(m) for m in messages[same:]]
        memo.keys = keys
        has_system = any(m.get("role") == "system" for m in messages)
        tools_key = _digest([tools, has_system])
        if tools_key != memo.tools_key:
            memo.tools_tokens = self.tokenizer.count_tools(tools, has_system)
            memo.tools_key = tools_key
        return sum(memo.tokens) + memo.tools_tokens + self.tokenizer.generation_prompt_tokens

    def _task_text(self, messages: Sequence[Message]) -> str:
        try:
            return extract_task_text(messages, self._rule)
        except TaskTextError:
            return ""
        except TypeError as exc:
            raise BadRequestError(f"cannot read the first user message: {exc}") from exc


def _digest(value: object) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()

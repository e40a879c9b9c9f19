"""Prompt sizes and task text of calls, as ingest counts them.

Rules:
- Counts are `basin_runtime.tokenizer`'s, the ones ingest trains on: a chat prompt as the chat
  template renders it (messages, tool schemas, generation prompt; equal to `count_prompt`), raw
  text with `count_text`, token ids as they are.
- A session keeps a `PromptMemo`: each message's count under a digest of the message. Agents
  resend a growing history, so a later call counts only the messages after the longest unchanged
  prefix; a rewritten history is recounted from the first change. The result stays exact.
  A call `resend.py` read after its last body's prefix counts its new messages on the memo it was
  read against (`Call.resent.base`), which its prefix came with; the memo then keeps the new prefix
  (within the Meter's `PrefixBudget`).
- A large call is counted in a worker thread (`gateway.py`), possibly beside another call of the
  same session on the event loop: a count reads the memo's counts once and swaps in new ones
  whole, so neither sees half of the other's update (the last one to finish is kept).
- Task text: `extract_task_text` with the configured rule (the function ingest uses); a
  conversation without a user message has an empty task text. A raw prompt is read as the first
  user message.
- The first prompt of a continuation (a session adopted after a restart) is everything before its
  first assistant turn, so its prediction equals the one its real first call would have had.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import orjson

from basin_runtime.gateway.calls import Call
from basin_runtime.gateway.errors import BadRequestError
from basin_runtime.gateway.memo import BodyPrefix, MemoCounts
from basin_runtime.gateway.resend import DEFAULT_MAX_PREFIX_BYTES, PrefixBudget, prefix_of
from basin_runtime.messages import Message
from basin_runtime.task_text import TaskTextError, TaskTextRule, extract_task_text
from basin_runtime.tokenizer import CallTokens, ChatTokenizer, TokenizerError

_LONG_TEXT_CHARS = 1 << 16  # a message text past this is hashed as UTF-8 bytes: re-serialising it costs more


@dataclass
class PromptMemo:
    """The counts of a session's last chat prompt, swapped whole (one attribute) after each count."""

    counts: MemoCounts = field(default_factory=MemoCounts)

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The digests of the last prompt's messages."""
        return self.counts.keys

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token counts of the last prompt's messages."""
        return self.counts.tokens


@dataclass(frozen=True)
class FirstCall:
    """What the predictor needs from a session's first call (or the conversation of an adopted one)."""

    task_text: str
    first_prompt_tokens: int  # before its first assistant turn (what an adopted session's real first call held)
    prompt_tokens: int  # the whole prompt of this call


class Meter:
    """Counts prompts with the serving tokenizer and cuts task texts with one rule."""

    def __init__(self, tokenizer: ChatTokenizer, rule: TaskTextRule, *,
                 max_prefix_bytes: int = DEFAULT_MAX_PREFIX_BYTES) -> None:
        self.tokenizer = tokenizer
        self._rule = rule
        self.prefixes = PrefixBudget(max_prefix_bytes)

    def prompt_tokens(self, call: Call, memo: PromptMemo) -> int:
        """The call's prompt size; a chat call reuses and updates the session's memo."""
        if call.messages is None:
            return sum(self.tokenizer.count_text(text) for text in call.texts) + call.token_ids_count
        return self._total(self._chat_counts(call, memo))

    def first_call(self, call: Call, memo: PromptMemo) -> FirstCall:
        """Task text, first prompt size and current prompt size of a session's first call."""
        if call.resent is not None:  # the gateway reads a session's first call in full (`gateway.py`)
            raise AssertionError("a resent call holds only its new messages: not a session's first call")
        if call.messages is None:
            prompt_tokens = self.prompt_tokens(call, memo)
            return FirstCall(self._task_text([{"role": "user", "content": "".join(call.texts[:1])}]),
                             prompt_tokens, prompt_tokens)
        counts = self._chat_counts(call, memo)
        prompt_tokens = first = self._total(counts)
        assistant = next((k for k, m in enumerate(call.messages) if m.get("role") == "assistant"), None)
        if assistant is not None:
            first = self._total(replace(counts, tokens=counts.tokens[:assistant]))
        return FirstCall(self._task_text(call.messages), first, prompt_tokens)

    def unrecorded_calls(self, call: Call, counts: MemoCounts, num_recorded: int) -> list[CallTokens]:
        """The calls a resumed conversation shows past its first `num_recorded` (the k-th assistant turn answered
        call k, as ingest reads a trajectory): each one's prompt from the counts of `call` (as the gateway counted it
        then) and its answer's tokens."""
        messages = call.messages or ()
        answers = [k for k, m in enumerate(messages) if m.get("role") == "assistant"][num_recorded:]
        try:
            return [CallTokens(self._total(replace(counts, tokens=counts.tokens[:k])),
                               self.tokenizer.count_completion(messages[k])) for k in answers]
        except (TokenizerError, TypeError) as exc:
            raise BadRequestError(f"cannot read the messages: {exc}") from exc

    def _total(self, counts: MemoCounts) -> int:
        return sum(counts.tokens) + counts.tools_tokens + self.tokenizer.generation_prompt_tokens

    def _chat_counts(self, call: Call, memo: PromptMemo) -> MemoCounts:
        """The counts of a chat call, from the memo's unchanged prefix on; the memo then holds them."""
        messages, tools, old = call.messages or (), call.tools, memo.counts
        try:
            if call.resent is not None:  # `messages` are the new ones: the base's counts hold the others
                base = call.resent.base
                keys = base.keys + tuple(_digest(message) for message in messages)
                tokens = base.tokens + tuple(self.tokenizer.count_message(m) for m in messages)
                has_system = call.resent.prefix.has_system
                prefix: BodyPrefix | None = call.resent.prefix
            else:
                keys = tuple(_digest(message) for message in messages)
                same = 0
                while same < min(len(keys), len(old.keys)) and keys[same] == old.keys[same]:
                    same += 1
                tokens = old.tokens[:same] + tuple(self.tokenizer.count_message(m) for m in messages[same:])
                has_system = any(m.get("role") == "system" for m in messages)
                prefix = prefix_of(call)
            tools_key = _digest([tools, has_system])
            tools_tokens = (old.tools_tokens if tools_key == old.tools_key
                            else self.tokenizer.count_tools(tools, has_system))
        except (TokenizerError, TypeError) as exc:
            raise BadRequestError(f"cannot read the messages: {exc}") from exc
        memo.counts = MemoCounts(keys, tokens, tools_key, tools_tokens, self.prefixes.keep(prefix))
        return memo.counts

    def _task_text(self, messages: Sequence[Message]) -> str:
        try:
            return extract_task_text(messages, self._rule)
        except TaskTextError:
            return ""
        except TypeError as exc:
            raise BadRequestError(f"cannot read the first user message: {exc}") from exc


def message_digest(message: object) -> bytes:
    """The digest the prompt memo keeps of a message (what binds a session to its first messages, `identity.py`)."""
    return _digest(message)


def _digest(value: object) -> bytes:
    """A digest of a message (or of the tools): a long text content is hashed as bytes, not re-serialised.

    SHA-256 (cut to 16 bytes): with the CPU's SHA instructions it hashes about twice as fast as BLAKE2b,
    and a long conversation's later call hashes every message it resends."""
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(value, dict) and isinstance(content, str) and len(content) > _LONG_TEXT_CHARS:
        digest = hashlib.sha256(_json({k: v for k, v in value.items() if k != "content"}))
        digest.update(b"\x00content\x00")  # a NUL never appears in JSON text: no collision with the plain form
        digest.update(content.encode("utf-8"))
        return digest.digest()[:16]
    return hashlib.sha256(_json(value)).digest()[:16]


def _json(value: object) -> bytes:
    """Compact JSON of `value` (only ever compared with itself): orjson, or the standard library for an
    integer past 64 bits, which orjson does not write."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

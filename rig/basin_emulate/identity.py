"""What the prefix cache sees of a request: its token counts and which conversation (cache chain) it continues.

The cache counts tokens and never sees text (basin_sim/radix_cache.py), so identity comes from
hashing the prompt.

Rules:
- Chat (`messages`, optional `tools`): each message is rendered with the pipeline's ChatML template
  (`ChatTokenizer.render_message`) and hashed; its token count is memoized by that hash, so a growing
  conversation only tokenizes its new messages. prompt_tokens = sum of message counts + tool schemas
  + generation prompt, which is `ChatTokenizer.count_prompt` term by term.
  conversation key = hash of the tools and the messages up to and including the first user message
  (all messages if there is none); group = hash of the tools and the first message (the system
  prompt when there is one), whose tokens are the group's shared prefix.
- Text (`text`, `prompt`): key = hash of the first KEY_CHARS characters, group = hash of the first
  GROUP_CHARS characters (tokens: that prefix counted alone). Token ids (`input_ids`): the same with
  KEY_IDS and GROUP_IDS ids. BPE can count a cut prefix a token or two above the whole text; the
  cache then sees max(prompt, group) tokens (`cache_tokens`), the response the true count.
- A prompt is a sequence of units (messages, characters or ids) with a digest of each prefix. The
  chain book remembers, per conversation key, the chain the cache holds for it and the digest of the
  units last sent on it. A prompt that repeats or extends them stays on that chain; any other one
  (rewritten, or shorter) starts a new chain `key~N`, the old one being left to eviction, so the
  cache never counts a changed conversation as a hit. A shorter resend that is a true prefix would
  hit in SGLang; here it recomputes past the group, as RadixCache does for a shorter prompt anyway.
- Memo and book are LRU-bounded (MAX_MEMO_ENTRIES, MAX_BOOK_ENTRIES).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from basin_runtime.messages import Message
from basin_runtime.tokenizer import ChatTokenizer

KEY_CHARS = 2048
GROUP_CHARS = 512
KEY_IDS = 512
GROUP_IDS = 128
MAX_MEMO_ENTRIES = 200_000
MAX_BOOK_ENTRIES = 200_000
THREAD_COUNT_CHARS = 20_000  # uncached text longer than this is tokenized off the event loop


def digest(data: bytes) -> bytes:
    """A 16-byte BLAKE2b digest."""
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class Prompt:
    """A prompt as the prefix cache sees it: sizes, conversation key, group, and prefix digests."""

    conversation_key: str
    group_key: str
    group_tokens: int
    prompt_tokens: int
    length: int  # units: messages, characters or ids
    digest_of: Callable[[int], bytes]  # digest of the first n units

    @property
    def cache_tokens(self) -> int:
        """Tokens the cache is told (never fewer than the group's shared prefix)."""
        return max(self.prompt_tokens, self.group_tokens)


class _Lru(OrderedDict[bytes, int]):
    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self.max_entries = max_entries

    def put(self, key: bytes, value: int) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.max_entries:
            self.popitem(last=False)


class PromptCounter:
    """Counts prompts with the pipeline's tokenizer, memoizing per message (or per whole text)."""

    def __init__(self, tokenizer: ChatTokenizer, max_entries: int = MAX_MEMO_ENTRIES) -> None:
        self.tokenizer = tokenizer
        self._counts = _Lru(max_entries)

    async def chat(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None) -> Prompt:
        """A chat prompt (raises `TokenizerError` for a role the template cannot render)."""
        rendered = [self.tokenizer.render_message(m) for m in messages]
        has_system = any(m.get("role") == "system" for m in messages)
        tools_text = json.dumps(list(tools), sort_keys=True) if tools else ""
        tools_key = digest(f"tools|{has_system}|{tools_text}".encode())
        digests = [digest(text.encode()) for text in rendered]
        counts = await self._count_all(list(zip(digests, rendered, strict=True)))
        tools_tokens = self._counts.get(tools_key)
        if tools_tokens is None:
            tools_tokens = self.tokenizer.count_tools(tools, has_system)
            self._counts.put(tools_key, tools_tokens)
        rolling = [tools_key]
        for message_digest in digests:
            rolling.append(digest(rolling[-1] + message_digest))
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        opening = users[0] + 1 if users else len(messages)
        prompt_tokens = sum(counts) + tools_tokens + self.tokenizer.generation_prompt_tokens
        first = counts[0] if counts else 0
        return Prompt(conversation_key="chat:" + rolling[opening].hex(), group_key="group:" + rolling[1].hex(),
                      group_tokens=first + tools_tokens, prompt_tokens=prompt_tokens, length=len(messages),
                      digest_of=lambda n: rolling[n])

    async def text(self, text: str) -> Prompt:
        """A plain-text prompt."""
        group_text = text[:GROUP_CHARS]
        prompt_tokens, group_tokens = await self._count_all([(digest(b"text|" + text.encode()), text),
                                                             (digest(b"text|" + group_text.encode()), group_text)])
        return Prompt(conversation_key="text:" + digest(text[:KEY_CHARS].encode()).hex(),
                      group_key="text-group:" + digest(group_text.encode()).hex(), group_tokens=group_tokens,
                      prompt_tokens=prompt_tokens, length=len(text), digest_of=lambda n: digest(text[:n].encode()))

    async def continuation(self, prompt: Prompt, answer_text: str) -> tuple[int, bytes, int]:
        """(units, prefix digest, tokens through them) of a chat `prompt` continued by its answer as an assistant
        message: how the next call's prompt starts when the client sends the answer back unchanged."""
        rendered = self.tokenizer.render_message({"role": "assistant", "content": answer_text})
        key = digest(rendered.encode())
        (tokens,) = await self._count_all([(key, rendered)])
        through = prompt.prompt_tokens - self.tokenizer.generation_prompt_tokens + tokens
        return prompt.length + 1, digest(prompt.digest_of(prompt.length) + key), through

    @staticmethod
    def ids(ids: Sequence[int]) -> Prompt:
        """A prompt of token ids (counted by its length)."""
        def ids_digest(n: int) -> bytes:
            return digest(json.dumps(list(ids[:n])).encode())

        return Prompt(conversation_key="ids:" + ids_digest(KEY_IDS).hex(),
                      group_key="ids-group:" + ids_digest(GROUP_IDS).hex(), group_tokens=min(len(ids), GROUP_IDS),
                      prompt_tokens=len(ids), length=len(ids), digest_of=ids_digest)

    async def _count_all(self, items: list[tuple[bytes, str]]) -> list[int]:
        """Token counts of (digest, text) items in order, from the memo or counted (each new text once)."""
        known: dict[bytes, int] = {}
        missing: dict[bytes, str] = {}
        for key, text in items:
            count = self._counts.get(key)
            if count is None:
                missing[key] = text
            else:
                self._counts.move_to_end(key)
                known[key] = count
        if missing:
            texts = list(missing.values())
            if sum(len(t) for t in texts) > THREAD_COUNT_CHARS:  # tiktoken releases the GIL
                found = await asyncio.to_thread(self._count_texts, texts)
            else:
                found = self._count_texts(texts)
            for key, tokens in zip(missing, found, strict=True):
                self._counts.put(key, tokens)
                known[key] = tokens
        return [known[key] for key, _ in items]

    def _count_texts(self, texts: list[str]) -> list[int]:
        return [self.tokenizer.count_text(text) for text in texts]


@dataclass(frozen=True)
class _Chain:
    generation: int
    length: int
    digest: bytes


class ChainBook:
    """The cache chain each conversation continues, with a fingerprint of what was last sent on it."""

    def __init__(self, max_entries: int = MAX_BOOK_ENTRIES) -> None:
        self.max_entries = max_entries
        self._chains: OrderedDict[str, _Chain] = OrderedDict()

    def chain_key(self, prompt: Prompt) -> str:
        """The cache chain this prompt continues (a new one unless it repeats or extends the last); records it."""
        key = prompt.conversation_key
        known = self._chains.get(key)
        generation = 0
        if known is not None:
            extends = prompt.length >= known.length and prompt.digest_of(known.length) == known.digest
            generation = known.generation if extends else known.generation + 1
        self._chains[key] = _Chain(generation, prompt.length, prompt.digest_of(prompt.length))
        self._chains.move_to_end(key)
        while len(self._chains) > self.max_entries:
            self._chains.popitem(last=False)
        return key if generation == 0 else f"{key}~{generation}"

    def clear(self) -> None:
        """Forget every conversation (the cache was flushed)."""
        self._chains.clear()

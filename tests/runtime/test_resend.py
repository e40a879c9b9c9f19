"""Reading a resent conversation from its new part on (`basin_runtime/gateway/resend.py`).

The reference is always the full read: real agent conversations (the shared corpora) are replayed call
by call, each body read both ways, and the parsed call, its prompt count and the forwarded bytes must
be the same. Every irregular body must fall back to the full read (None), which then names the error.
"""

from __future__ import annotations

import gc
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from basin_pipeline.adapters.messages_jsonl import read_messages_jsonl
from basin_pipeline.records import RawSession
from basin_runtime.gateway import resend
from basin_runtime.gateway.calls import Call, parse_call
from basin_runtime.gateway.errors import BadRequestError, NestingTooDeepError
from basin_runtime.gateway.gateway import _ask_for_usage
from basin_runtime.gateway.limits import Limits
from basin_runtime.gateway.measure import Meter, PromptMemo
from basin_runtime.gateway.memo import BodyPrefix, MemoCounts
from basin_runtime.gateway.priority import stamp
from basin_runtime.gateway.resend import PrefixBudget, prefix_of, read_resent
from basin_runtime.task_text import TaskTextRule
from basin_runtime.tokenizer import get_tokenizer

TOKENIZER = get_tokenizer("qwen3.6")
LIMITS = Limits(max_json_depth=64)
Encoder = Callable[[dict[str, Any]], bytes]
ENCODERS: dict[str, Encoder] = {  # how clients write JSON: Python's default (the openai client), compact, pretty
    "default": lambda body: json.dumps(body).encode(),
    "compact-utf8": lambda body: json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
    "indented": lambda body: json.dumps(body, indent=2).encode(),
}


@pytest.fixture(autouse=True)
def every_body_gets_a_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real calls are often under RESEND_MIN_BYTES; the reading is the same at any size."""
    monkeypatch.setattr(resend, "RESEND_MIN_BYTES", 0)


def real_sessions(shared_trajectories: Path, corpus: str, count: int) -> list[RawSession]:
    path = shared_trajectories / corpus / "sessions.jsonl.gz"
    sessions = (s for s in read_messages_jsonl(path, corpus) if isinstance(s, RawSession))
    return list(itertools.islice((s for s in sessions if sum(m.get("role") == "assistant" for m in s.messages) >= 3),
                                 count))


def calls_of(session: RawSession, **fields: Any) -> Iterator[dict[str, Any]]:
    """The body of each call the agent made: the conversation up to each assistant turn."""
    messages = [dict(m) for m in session.messages]
    for k, message in enumerate(messages):
        if message.get("role") == "assistant":
            body: dict[str, Any] = {"model": "m", "messages": messages[:k]}
            if session.tools:
                body["tools"] = session.tools
            yield {**body, **fields}
    yield {"model": "m", "messages": messages, **({"tools": session.tools} if session.tools else {}), **fields}


def forwarded(call: Call) -> bytes:
    """What the gateway sends upstream for this call (stamped as `gateway.handle` does)."""
    stamp(call.body, 3, "rid-1")
    _ask_for_usage(call)
    return call.encode()


def replay(bodies: list[bytes]) -> list[Call]:
    """Read each body after the previous one as the gateway does; check it against the full read."""
    fast_meter, full_meter = Meter(TOKENIZER, TaskTextRule()), Meter(TOKENIZER, TaskTextRule())
    fast_memo, full_memo = PromptMemo(), PromptMemo()
    calls = []
    for raw in bodies:
        full = parse_call("chat", raw, LIMITS)
        call = read_resent(raw, fast_memo.counts, LIMITS) or parse_call("chat", raw, LIMITS)
        if call.resent is not None:
            known = call.resent.num_known
            assert full.messages is not None and call.messages == full.messages[known:]
            assert {**call.body, "messages": full.body["messages"]} == full.body
            assert list(call.body) == list(full.body)  # the same top-level order (re-serialised bodies keep it)
            assert (call.tools, call.user, call.sent, call.is_stream, call.is_continuation) == (
                full.tools, full.user, full.sent, full.is_stream, full.is_continuation)
        assert fast_meter.prompt_tokens(call, fast_memo) == full_meter.prompt_tokens(full, full_memo)
        assert fast_memo.counts.keys == full_memo.counts.keys and fast_memo.counts.tokens == full_memo.counts.tokens
        assert forwarded(call) == forwarded(full)
        calls.append(call)
    return calls


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("corpus", ["terminal-bench-core-0.1.1_mini-swe-agent-1.7_claude-sonnet-4",
                                    "tau-bench-airline_tool-calling-agent_gpt-4o"])
def test_real_conversations_read_from_their_new_part_equal_the_full_read(shared_trajectories: Path, corpus: str,
                                                                         encoder: str) -> None:
    sessions = real_sessions(shared_trajectories, corpus, 4)
    assert len(sessions) == 4
    for session in sessions:
        bodies = [ENCODERS[encoder](body) for body in calls_of(session)]
        calls = replay(bodies)
        assert all(c.resent is not None for c in calls[1:])  # every later call was read from its new part
        assert calls[-1].read_bytes < len(bodies[-1])


def test_streamed_calls_with_and_without_stream_options_read_alike(shared_trajectories: Path) -> None:
    session = real_sessions(shared_trajectories, "terminal-bench-core-0.1.1_mini-swe-agent-1.7_claude-sonnet-4", 1)[0]
    plain = replay([json.dumps(b).encode() for b in calls_of(session, stream=True)])
    assert all(c.resent is not None for c in plain[1:])  # the gateway adds `stream_options`: spliced in
    usage = replay([json.dumps(b).encode() for b in calls_of(session, stream=True,
                                                              stream_options={"include_usage": True})])
    assert all(c.resent is not None for c in usage[1:])


def test_new_messages_with_quotes_backslashes_braces_and_unicode_are_read_exactly() -> None:
    tricky = ['say "hi" \\ {not a brace} [nor a bracket] \\"', "\\\\", "emoji \U0001f600 and \u00e9", "}]},{",
              '{"role": "assistant"}', "\\u005d\\u007d"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    bodies = [json.dumps({"model": "m", "messages": messages}).encode()]
    for k, text in enumerate(tricky):
        messages = [*messages, {"role": "assistant", "content": text, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": text})}}]},
            {"role": "tool", "tool_call_id": f"c{k}", "content": [{"type": "text", "text": text}]}]
        bodies.append(json.dumps({"model": "m", "messages": messages, "temperature": 0.5}).encode())
    calls = replay(bodies)
    assert all(c.resent is not None for c in calls[1:])


def _memo_after(raw: bytes) -> MemoCounts:
    memo = PromptMemo()
    Meter(TOKENIZER, TaskTextRule()).prompt_tokens(parse_call("chat", raw, LIMITS), memo)
    assert memo.counts.prefix is not None
    return memo.counts


FIRST = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "ok"}]
FIRST_BODY = json.dumps({"model": "m", "messages": FIRST, "max_tokens": 5}).encode()
HEAD = FIRST_BODY[:FIRST_BODY.index(b"}]") + 1]  # up to the end of the last message


@pytest.mark.parametrize(("why", "raw"), [
    ("history rewritten", json.dumps({"model": "m", "messages": [{"role": "user", "content": "task!"}]}).encode()),
    ("a new message is not an object", HEAD + b', "hello"], "max_tokens": 5}'),
    ("a new message is not JSON", HEAD + b', {"role": "user", "content": nope}], "max_tokens": 5}'),
    ("a new message has no role", HEAD + b', {"content": "x"}], "max_tokens": 5}'),
    ("the array does not end", HEAD + b', {"role": "user", "content": "x"}'),
    ("junk after the object", HEAD + b'], "max_tokens": 5} trailing'),
    ("junk between messages", HEAD + b' ; {"role": "user", "content": "x"}], "max_tokens": 5}'),
    ("a second messages key", HEAD + b'], "messages": [{"role": "user", "content": "x"}]}'),
    ("the client's own priority", HEAD + b'], "priority": 1}'),
    ("the client's own rid", HEAD + b'], "rid": "mine"}'),
    ("stream options the gateway rewrites", HEAD + b'], "stream": true, "stream_options": {}}'),
    ("a bad field shape", HEAD + b'], "stream": "yes"}'),
    ("a bad tools shape", HEAD + b'], "tools": [1]}'),
    ("an integer past 64 bits", HEAD + b', {"role": "user", "content": "x", "n": 123456789012345678901234567890}]}'),
    ("a lone surrogate", HEAD + b', {"role": "user", "content": "\\ud800"}]}'),
    ("too deep", HEAD + b', {"role": "user", "content": "x", "deep": ' + b"[" * 70 + b"]" * 70 + b"}]}"),
    ("invalid UTF-8", HEAD + b', {"role": "user", "content": "\xff"}]}'),
    ("nothing more", HEAD),
])
def test_an_irregular_resent_body_is_read_in_full(why: str, raw: bytes) -> None:
    base = _memo_after(FIRST_BODY)
    assert read_resent(raw, base, LIMITS) is None, why
    try:  # the full read then accepts it or names the error, as it always did
        parse_call("chat", raw, LIMITS)
    except (BadRequestError, NestingTooDeepError) as exc:
        assert str(exc)


def test_a_body_with_a_repeated_top_level_key_in_any_spelling_gets_no_prefix() -> None:
    for raw in (b'{"model": "a", "messages": [{"role": "user", "content": "x"}], "model": "b"}',
                b'{"x": [{"role": "user"}], "messages": [{"role": "user", "content": "x"}], "x": [{"a": 1}]}',
                b'{"messages": [{"role": "user", "content": "x"}], "\\u006dessages": [{"role": "user"}]}'):
        assert prefix_of(parse_call("chat", raw, LIMITS)) is None, raw


def test_an_escaped_key_is_read_as_the_parser_reads_it() -> None:
    raw = b'{"\\u006dodel": "m", "\\u006dessages": [{"role": "user", "content": "x"}]}'
    prefix = prefix_of(parse_call("chat", raw, LIMITS))
    assert prefix is not None and prefix.head == {"model": "m"} and raw[prefix.end - 1:] == b"}]}"


def test_small_bodies_get_no_prefix_at_the_real_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resend, "RESEND_MIN_BYTES", 64 << 10)
    assert prefix_of(parse_call("chat", FIRST_BODY, LIMITS)) is None
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (64 << 10)}]}).encode()
    prefix = prefix_of(parse_call("chat", big, LIMITS))
    assert prefix is not None and big[prefix.end - 1:] == b"}]}"


def test_the_budget_bounds_the_bytes_prefixes_hold_and_frees_those_no_longer_used() -> None:
    budget = PrefixBudget(max_bytes=250)

    def prefix(size: int) -> BodyPrefix:
        return BodyPrefix(b"x" * size, size, {}, 1, False, False)

    first = budget.keep(prefix(200))
    assert first is not None and budget.held_bytes == 200
    assert budget.keep(prefix(100)) is None  # would pass 250
    assert budget.keep(first) is first  # already held: still kept
    del first
    gc.collect()
    assert budget.held_bytes == 0
    assert budget.keep(prefix(100)) is not None


def test_a_meter_without_budget_reads_every_body_in_full() -> None:
    meter, memo = Meter(TOKENIZER, TaskTextRule(), max_prefix_bytes=0), PromptMemo()
    meter.prompt_tokens(parse_call("chat", FIRST_BODY, LIMITS), memo)
    assert memo.counts.prefix is None


# --- through the gateway -------------------------------------------------------------------------


def _big_conversation(session: RawSession, min_bytes: int) -> list[dict[str, Any]]:
    """The real conversation with its system prompt padded past `min_bytes` (the real RESEND_MIN_BYTES)."""
    messages = [dict(m) for m in session.messages]
    pad = "\n".join(m.get("content") or "" for m in messages if isinstance(m.get("content"), str))
    messages.insert(0, {"role": "system", "content": (pad * (min_bytes // max(1, len(pad)) + 1))[:min_bytes]})
    return messages


@pytest.mark.asyncio
async def test_the_gateway_reads_a_big_resent_conversation_from_its_new_part_and_forwards_it_whole(
        shared_trajectories: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from basin_runtime.gateway import gateway as gateway_module
    from tests.runtime.test_gateway_app import CHAT, rig_for

    monkeypatch.setattr(resend, "RESEND_MIN_BYTES", 64 << 10)
    full_reads: list[int] = []
    parse = gateway_module.parse_call
    monkeypatch.setattr(gateway_module, "parse_call", lambda *a: full_reads.append(len(a[1])) or parse(*a))
    session = real_sessions(shared_trajectories, "terminal-bench-core-0.1.1_mini-swe-agent-1.7_claude-sonnet-4", 1)[0]
    messages = _big_conversation(session, 70_000)
    turns = [k for k, m in enumerate(messages) if m.get("role") == "assistant"][:4]
    async with rig_for() as rig:
        for k in turns:
            response = await rig.client.post(CHAT, json={"model": "m", "messages": messages[:k]},
                                             headers={"X-Session-ID": "big"})
            assert response.status_code == 200, response.text
        entry = rig.room.registry.get("big")
        assert entry is not None
        assert [c.prompt_tokens for c in entry.calls] == [TOKENIZER.count_prompt(messages[:k]) for k in turns]
        assert len(full_reads) == 1  # only the session's first call was read in full
        assert [b["messages"] for b in rig.upstream.bodies()] == [messages[:k] for k in turns]  # forwarded whole
        assert entry.memo.counts.prefix is not None and entry.memo.counts.prefix.num_messages == turns[-1]


@pytest.mark.asyncio
async def test_a_resent_call_whose_session_ended_meanwhile_is_read_in_full_as_a_new_session(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from basin_runtime.gateway import gateway as gateway_module
    from basin_runtime.state.steps import Step
    from tests.runtime.test_gateway_app import CHAT, rig_for

    messages: list[dict[str, Any]] = [{"role": "user", "content": "task " + "x" * 70_000}]
    async with rig_for() as rig:
        assert (await rig.client.post(CHAT, json={"model": "m", "messages": messages},
                                      headers={"X-Session-ID": "s"})).status_code == 200

        def read_then_end(raw: bytes, base: MemoCounts, limits: Limits) -> Call | None:
            call = read_resent(raw, base, limits)
            assert call is not None and call.resent is not None
            entry = rig.room.registry.get("s")
            assert entry is not None
            rig.room.registry.remove("s")  # as if its end landed between reading and admitting (`room.release`)
            rig.room.backend.apply(Step("finish", "s", (), rig.clock.now()))
            return call

        monkeypatch.setattr(gateway_module, "read_resent", read_then_end)
        grown = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
        response = await rig.client.post(CHAT, json={"model": "m", "messages": grown}, headers={"X-Session-ID": "s"})
        assert response.status_code == 200, response.text
        entry = rig.room.registry.get("s")
        assert entry is not None and [c.prompt_tokens for c in entry.calls] == [TOKENIZER.count_prompt(grown)]
        assert len(rig.model.asked) == 2  # arrived again: predicted from the whole conversation


def test_the_budget_is_kept_from_several_threads_at_once() -> None:
    """Large calls count in worker threads while small ones count on the loop: one budget for all."""
    import threading

    budget = PrefixBudget(max_bytes=1 << 30)
    errors: list[BaseException] = []
    kept: list[list[BodyPrefix]] = [[] for _ in range(4)]

    def churn(mine: list[BodyPrefix]) -> None:
        try:
            for k in range(2_000):
                prefix = budget.keep(BodyPrefix(b"x" * 100, 100, {}, 1, False, False))
                assert prefix is not None
                mine.append(prefix)
                if k % 3 == 0:
                    mine.pop(0)  # released: its bytes leave the budget while the others iterate it
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(mine,)) for mine in kept]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    gc.collect()
    assert budget.held_bytes == 100 * sum(len(mine) for mine in kept)

"""The gateway under fuzzed input (issue 16): Hypothesis-made requests through the real ASGI app, in-process.

Every example builds a fresh rig (`test_gateway_app.rig_for`: real gateway, tokenizer and policy; a stub
predictor; a fake upstream that checks what it is sent and answers JSON, or SSE to a streamed call) whose
gateway writes to one session log shared by the whole test, and drives it straight through ASGI, so any
header bytes and body chunking can be sent:

- schema-aware OpenAI chat-completions and completions bodies and SGLang `/generate` bodies (roles,
  content strings and part lists, tool calls, tools, stream/stream_options, user, stop, max_tokens,
  rid, priority, ...), then mutated: a node replaced by a value of another type, a huge number, a long
  string or a deep nest; a field deleted; an extra field added;
- hostile strings everywhere (lone surrogates, NUL and control characters, RTL and zero-width marks,
  special tokens, CRLF, very long), bodies encoded with escaped or raw surrogates, raw non-JSON bytes,
  truncated JSON, nesting bombs, 5000-digit numbers;
- hostile headers: the session header (non-ASCII bytes, control characters, `\\r\\n` injection, too
  long), the workload header, content-type, a Content-Length that lies or is not a number, chunked
  bodies;
- multi-call sessions: a first call, then continuations that grow the same conversation (sometimes
  mutated), sessions ended midway and called again, ended twice;
- the two-step and ride shapes (issue 46): sessions admitted on a tiny first call whose later calls carry
  made-up histories, and calls under another live session's id (header or `user`; chat, completions,
  `/generate`; another API key) against a small budget with admission always engaged: after every step the
  reserved total passes the budget only with one session live, held calls wait (never forwarded while
  held), every ride is a session of its own, and at the end nothing is held or reserved;
- item counts (issue 36): chat bodies with numbers of messages, content parts, tools and other values drawn
  around lowered limits: served within them, 413 `too_many_items` naming the first one passed otherwise, whole
  or resent by a known session.

Paths and heads (issue 36) go over TCP to one gateway served as the CLI serves it (its own HTTP protocol,
8 KiB heads, 40 headers: `served.py`): any method, route with any path bytes appended (escapes, dots, controls,
non-ASCII), any header names and values (hostile bytes, CRLF injection, Transfer-Encoding, Expect, Upgrade,
values up to 4 KiB, 30-60 headers, one of 6-20 KB), sent in up to four pieces. Every request gets an answer
(even a refused one: the close lingers), never a 5xx; every answer from 300 up is JSON with a string `type` and
its status as `code`; then `/health` still answers 200.

After EVERY request: the answer is the upstream's (forwarded) or a JSON 4xx the gateway made (the body
parses and has `error.type`), never a 5xx; a session id echoed in the answer is printable ASCII; what
reached the upstream is a UTF-8 JSON object carrying an integer `priority`; `/basin/state` and
`/basin/sessions` answer, and the policy's totals equal the sums over the sessions (live and queued
sets, working set = sum of last prompts, reserved = sum of max(peak, last prompt)); no call is in
flight; the session-log writer thread is alive and has failed or dropped nothing. At the end of each
example every session is ended through `/basin/sessions/{id}/end`: then nothing is live, queued,
reserved or in flight, and `/metrics` renders. At the end of the test the session log is read back:
every line is a valid record.

Reproducible: `derandomize=True` (a fixed seed per test) and no example database. `BASIN_FUZZ_SCALE=10`
runs ten times as many examples (locally, to look harder).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
import os
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httptools
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from basin_runtime.gateway.admin import sessions_view
from basin_runtime.gateway.limits import Limits
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.session_log import SessionLogRecord
from tests.runtime.redis_policy import LoopThread
from tests.runtime.served import Served, serving
from tests.runtime.test_gateway_app import ANSWER, Rig, rig_for
from tests.runtime.test_gateway_limits import Driven

pytestmark = pytest.mark.integration  # thousands of examples through the whole ASGI app: minutes, not seconds
SCALE = int(os.environ.get("BASIN_FUZZ_SCALE", "1"))
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}
SSE_ANSWER = (b'data: {"id": "c1", "choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
              b'data: {"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}\n\n'
              b"data: [DONE]\n\n")

# --- strategies: strings and JSON values ---------------------------------------------------------

HOSTILE = ["\ud800", "\udfff", "\ud83d", "\x00", "\x01", "\x1b[31m", "\x7f", "\x85", "\u2028", "\u202e", "\u200b",
           "\ufeff", "\r\n", "\n", "\t", '"', "\\", "\\u0000", "é", "𝕏", "🙂", "<|im_start|>", "<|im_end|>",
           "<tool_call>", "{", "]", "%2e%2e/", " "]
LONG = ["x" * 257, "long words " * 1500, "🙂" * 3000]
texts = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=4)), max_size=6).map("".join),
    st.sampled_from(["", "fix the failing test", *LONG]),
)
ids = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=24)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 2**31, 2**63, 10**300, 1e308]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(texts, inner, max_size=3)), max_leaves=6)


def nest(depth: int) -> Any:
    value: Any = "deep"
    for k in range(depth):
        value = [value] if k % 2 else {"d": value}
    return value


hostile_values = st.one_of(values, st.builds(nest, st.sampled_from([60, 130])), st.just("y" * 50_000),
                           st.builds(lambda: [0] * 5_000))  # built afresh: a mutation never changes a shared one

# --- strategies: OpenAI / SGLang bodies ----------------------------------------------------------


def body_strategies(texts: st.SearchStrategy[str], *, any_role: bool = True) -> dict[str, st.SearchStrategy[Any]]:
    """Chat, completion and generate bodies whose strings are drawn from `texts` (and roles, with `any_role`)."""
    roles = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
    parts = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": texts})}),
    )
    contents = st.one_of(texts, st.none(), st.lists(parts, max_size=3))
    messages = st.one_of(
        st.fixed_dictionaries(
            {"role": st.one_of(*[roles] * 6, texts) if any_role else roles,
             "content": contents},
            optional={"name": texts, "tool_calls": tool_calls_of(texts), "tool_call_id": ids}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts),
                               "tool_calls": tool_calls_of(texts)}),  # an agent's turn
    )
    tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": texts, "parameters": st.one_of(st.just({"type": "object"}), values)},
        optional={"description": texts})}), max_size=2)
    stream_options = st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                         "continuous_usage_stats": st.booleans()})
    common = {"model": texts, "stream": st.booleans(), "stream_options": stream_options, "user": texts,
              "stop": st.one_of(texts, st.lists(texts, max_size=3)), "max_tokens": st.integers(0, 10**6),
              "temperature": st.floats(0, 2), "n": st.integers(1, 3), "seed": st.integers(), "rid": ids,
              "priority": st.integers(-(2**40), 2**40)}
    token_ids = st.lists(st.integers(0, 150_000), min_size=1, max_size=6)
    prompts = st.one_of(texts, st.lists(texts, min_size=1, max_size=3), token_ids,
                        st.lists(token_ids, min_size=1, max_size=2))
    generate_prompts = st.one_of(
        st.fixed_dictionaries({"text": st.one_of(texts, st.lists(texts, min_size=1, max_size=2))}),
        st.fixed_dictionaries({"input_ids": st.one_of(token_ids, st.lists(token_ids, min_size=1))}))
    return {
        "messages": messages,
        "chat": st.fixed_dictionaries({"messages": st.lists(messages, min_size=1, max_size=5)},
                                      optional={**common, "tools": tools,
                                                "tool_choice": st.sampled_from(["auto", "none"])}),
        "completion": st.fixed_dictionaries({"prompt": prompts}, optional={**common, "echo": st.booleans()}),
        "generate": generate_prompts.flatmap(lambda body: st.fixed_dictionaries(
            {k: st.just(v) for k, v in body.items()},
            optional={"sampling_params": st.dictionaries(texts, values, max_size=3), "stream": st.booleans(),
                      "rid": ids})),
    }


def tool_calls_of(texts: st.SearchStrategy[str]) -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.lists(st.fixed_dictionaries({
        "id": ids, "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": texts, "arguments": st.one_of(texts, st.just('{"cmd": "ls"}'))}),
    }), max_size=2)


# An example's strings are hostile, or ordinary Unicode (so its body reaches the checks past the first hostile
# string: a lone surrogate anywhere stops a body at parsing).
ordinary_texts = st.one_of(st.text(max_size=30), st.sampled_from(LONG))
BODIES = {True: body_strategies(texts), False: body_strategies(ordinary_texts)}
WELL_FORMED = body_strategies(ordinary_texts, any_role=False)
tool_calls = tool_calls_of(texts)


# Any method on known and made-up paths; no admin change (a budget of 1 would queue every later call of the
# sequential driver), though a session may be ended.
known_paths = st.sampled_from(["/health", "/metrics", "/v1/models", "/v1/models/m", "/get_model_info", "/basin/state",
                               "/basin/sessions", "/basin/budget", "/basin/sessions/s/end", *PATHS.values()])
paths = st.one_of(known_paths, st.tuples(known_paths, st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                                              max_size=12)).map("".join))
routes = st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]), paths).filter(
    lambda route: route[0] in ("GET", "HEAD") or not route[1].startswith(("/basin/budget", "/basin/reload",
                                                                          "/basin/shadow")))


def locations(value: Any, max_depth: int = 12, max_paths: int = 400) -> list[tuple[Any, ...]]:
    """Paths to the nodes of a JSON value (the root excluded), down to `max_depth`, at most `max_paths`."""
    found: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack and len(found) < max_paths:
        path, node = stack.pop(0)
        if path:
            found.append(path)
        if len(path) < max_depth:
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            stack.extend(((*path, key), item) for key, item in items)
    return found


# The fields the gateway reads: a mutation lands on one of them (or on what they hold) half of the time.
READ_FIELDS = {"messages", "role", "content", "type", "text", "tool_calls", "function", "name", "arguments", "tools",
               "stream", "stream_options", "include_usage", "user", "model", "prompt", "input_ids", "rid",
               "priority"}
wrong_types = st.sampled_from([0, -7, 1.5, 10**30, math.nan, math.inf, True, False, None, "", "s", [], [1], ["s"], {},
                               {"a": 1}, {"type": 3}])


def read_field(path: tuple[Any, ...]) -> str | None:
    """The field the gateway reads that `path` is (`content`) or is an item of (`content[2]`), if any."""
    for key in reversed(path[-2:]):
        if isinstance(key, str):
            return key if key in READ_FIELDS else None
    return None


def retype_one_read_field(data: st.DataObject, body: dict[str, Any]) -> dict[str, Any]:
    """`body` (a deep copy) with one occurrence of one field the gateway reads (each field alike) given a value of
    another type, or deleted."""
    body = copy.deepcopy(body)
    by_field: dict[str, list[tuple[Any, ...]]] = {}
    for candidate in locations(body):
        name = read_field(candidate)
        if name is not None:
            by_field.setdefault(name, []).append(candidate)
    field = data.draw(st.sampled_from(sorted(by_field)), label="field")
    path = data.draw(st.sampled_from(by_field[field]), label="retyped at")
    parent: Any = body
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.integers(0, 9), label="delete?") == 0:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(data.draw(wrong_types, label="value"))
    return body


def mutate(data: st.DataObject, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with 0 to 3 nodes replaced by a value of another type or a hostile one, deleted, or given an extra
    field; half of the mutations land on a field the gateway reads. Works on a deep copy, and inserts deep copies:
    strategies share their `just` and `sampled_from` values between examples, which must never change."""
    body = copy.deepcopy(body)
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 1, 2, 3]), label="mutations")):
        paths = locations(body)
        if not paths:
            break
        by_field: dict[str, list[tuple[Any, ...]]] = {}
        for candidate in paths:
            name = read_field(candidate)
            if name is not None:
                by_field.setdefault(name, []).append(candidate)
        if by_field and data.draw(st.booleans(), label="a read field"):  # each field alike, however often it occurs
            field = data.draw(st.sampled_from(sorted(by_field)), label="field")
            path = data.draw(st.sampled_from(by_field[field]), label="mutated at")
        else:
            path = data.draw(st.sampled_from(paths), label="mutated at")
        parent: Any = body
        for key in path[:-1]:
            parent = parent[key]
        operation = data.draw(st.sampled_from(["retype", "retype", "replace", "delete", "add"]), label="operation")
        if operation in ("retype", "replace"):
            parent[path[-1]] = copy.deepcopy(data.draw(wrong_types if operation == "retype" else hostile_values,
                                                       label="value"))
        elif operation == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(texts, label="extra key")] = copy.deepcopy(data.draw(values, label="extra value"))
    return body


# --- strategies: bytes and headers ---------------------------------------------------------------


def encode(data: st.DataObject, body: Any) -> bytes:
    """`body` as bytes: escaped or raw UTF-8 (raw surrogates stay, as invalid UTF-8), or broken on purpose."""
    how = data.draw(st.sampled_from(["ascii"] * 10 + ["utf-8"] * 6 + ["truncated", "garbage", "bomb", "digits"]),
                    label="encoding")
    if how == "garbage":
        return data.draw(st.binary(max_size=64), label="garbage")
    if how == "bomb":
        depth = data.draw(st.sampled_from([129, 900, 100_000]), label="bomb depth")
        return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    if how == "digits":
        return b'{"max_tokens": ' + b"9" * 5000 + b', "messages": [{"role": "user", "content": "x"}], "prompt": "p"}'
    raw = json.dumps(body, ensure_ascii=(how != "utf-8")).encode("utf-8", "surrogatepass")
    if how == "truncated":
        return raw[:data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut at")]
    return raw


def header_value(data: st.DataObject, good: str | None) -> bytes | None:
    """A header value: `good`, absent, or hostile bytes (non-ASCII, control characters, CRLF injection, long)."""
    choice = data.draw(st.sampled_from(["good"] * 6 + ["absent", "hostile"]), label="header")
    if choice == "good":
        return None if good is None else good.encode()
    if choice == "absent":
        return None
    hostile = data.draw(st.one_of(texts, st.sampled_from(["s1\r\nX-Evil: 1", "s1\x00", "  padded  ", "s" * 300])),
                        label="hostile header")
    return hostile.encode("utf-8", "surrogatepass")


def request_headers(data: st.DataObject, session: str | None, raw: bytes) -> dict[str, bytes]:
    headers: dict[str, bytes] = {}
    for name, good in (("x-session-id", session), ("x-basin-workload", None),
                       ("content-type", "application/json")):
        value = header_value(data, good)
        if value is not None:
            headers[name] = value
    length = data.draw(st.sampled_from(["right"] * 8 + ["absent"] * 2 + ["short", "long", "garbage"]), label="length")
    if length != "absent":
        headers["content-length"] = {"right": str(len(raw)), "short": str(max(0, len(raw) - 1)),
                                     "long": str(len(raw) + 7), "garbage": "12x"}[length].encode()
    return headers


def chunks_of(data: st.DataObject, raw: bytes) -> list[bytes]:
    if len(raw) < 2 or not data.draw(st.booleans(), label="chunked"):
        return [raw]
    cut = data.draw(st.integers(1, len(raw) - 1), label="chunk cut")
    return [raw[:cut], b"", raw[cut:]]


# --- the rig and the checks ----------------------------------------------------------------------


class Checked:
    """A rig whose fake upstream checks what reaches it, and the checks run after every request."""

    def __init__(self, rig: Rig, log: SessionLogWriter) -> None:
        self.rig = rig
        self.log = log
        self.forwarded_problems: list[str] = []
        rig.upstream.handler = self.upstream

    async def upstream(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST":  # pass-through GET (and HEAD)
            return httpx.Response(200, json={"path": request.url.path})
        try:  # strict JSON, as SGLang's parser reads it: no NaN or Infinity
            body = json.loads(request.content.decode("utf-8"), parse_constant=_not_json)
        except (UnicodeDecodeError, ValueError) as exc:
            self.forwarded_problems.append(f"forwarded a body that is not UTF-8 JSON: {exc}")
            return httpx.Response(200, json=ANSWER)
        if not isinstance(body, dict) or type(body.get("priority")) is not int:
            self.forwarded_problems.append(f"forwarded body without an integer priority: {str(body)[:200]}")
            return httpx.Response(200, json=ANSWER)
        if body.get("stream") is True:
            return httpx.Response(200, content=SSE_ANSWER, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=ANSWER, headers={"x-smg-routed-worker-id": "http://d1"})

    async def send(self, path: str, headers: dict[str, bytes], chunks: list[bytes], method: str = "POST") -> Driven:
        """One request straight into the app, then every check."""
        call = await Driven(headers, chunks, path=path, method=method).run(self.rig.app)
        if path in PATHS.values() and method == "POST":
            self.check_answer(call)
        else:
            self.check_other_answer(call)
        await self.check_state()
        return call

    def check_other_answer(self, call: Driven) -> None:
        """Any other route: forwarded or answered by the gateway, but never a 5xx, and a JSON error if an error."""
        body = b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body")
        assert call.status < 500, (call.method, call.path, call.status, body[:300])
        if call.status >= 400:
            error = json.loads(body)["error"]
            assert isinstance(error["type"], str) and error["code"] == call.status, error

    def check_answer(self, call: Driven) -> None:
        assert not self.forwarded_problems, self.forwarded_problems
        body = b"".join(m.get("body", b"") for m in call.sent if m["type"] == "http.response.body")
        assert call.status < 500, (call.status, body[:500])
        start = next(m for m in call.sent if m["type"] == "http.response.start")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]}
        echoed = headers.get("x-session-id")
        assert echoed is None or (echoed.isascii() and echoed.isprintable()), echoed
        if call.status == 200:  # an SSE answer loses the usage chunk when the gateway asked for it itself
            is_sse = headers.get("content-type", "").startswith("text/event-stream")
            assert (body.startswith(SSE_ANSWER[:60]) and body.endswith(b"data: [DONE]\n\n") if is_sse
                    else json.loads(body) == ANSWER), body[:300]
            return
        error = json.loads(body)["error"]
        assert 400 <= call.status < 500 and isinstance(error["type"], str) and error["code"] == call.status, error
        assert headers["content-type"] == "application/json", headers

    async def check_state(self, *, over_http: bool = False) -> dict[str, Any]:
        """The accounting checks; `/basin/state` and `/basin/sessions` answered in-process (as the endpoints
        render them) after each request, over HTTP at the end of an example (cheaper, same JSON)."""
        if over_http:
            state = await self.rig.client.get("/basin/state")
            listed = await self.rig.client.get("/basin/sessions")
            assert (state.status_code, listed.status_code) == (200, 200), (state.text[:300], listed.text[:300])
            policy, sessions = state.json()["policy"], listed.json()["sessions"]
        else:
            policy = json.loads(JSONResponse(self.rig.policy.snapshot().to_dict()).body)
            sessions = json.loads(JSONResponse(sessions_view(self.rig.gateway)).body)
        live = [s for s in sessions if s["state"] == "live"]
        assert sorted(policy["live"]) == sorted(s["session_id"] for s in live), (policy, sessions)
        assert sorted(policy["queued"]) == sorted(s["session_id"] for s in sessions if s["state"] == "queued")
        assert policy["working_set_tokens"] == sum(s["last_prompt_tokens"] for s in live), (policy, sessions)
        assert policy["reserved_tokens"] == sum(s["reserved_tokens"] for s in live), (policy, sessions)
        assert all(s["reserved_tokens"] >= max(math.ceil(s["reserved_peak_tokens"]), s["last_prompt_tokens"])
                   for s in live), sessions  # (more once a call outgrew it: context + predicted growth, issue 46)
        assert all(s["in_flight"] == 0 and s["num_calls"] >= 1 for s in sessions), sessions
        assert self.rig.gateway.telemetry.metrics.calls_in_flight._value.get() == 0
        assert self.log._thread.is_alive() and (self.log.num_failed, self.log.num_dropped) == (0, 0)
        return {s["session_id"]: s for s in sessions}

    async def end_everything(self) -> None:
        for session_id in await self.check_state(over_http=True):
            response = await self.rig.client.post(f"/basin/sessions/{quote(session_id, safe='')}/end")
            assert response.status_code == 200, (session_id, response.text[:300])
        assert await self.check_state(over_http=True) == {}
        snapshot = self.rig.policy.snapshot()
        assert (snapshot.live, snapshot.queued, snapshot.reserved_tokens, snapshot.working_set_tokens) == ((), (), 0, 0)
        assert len(self.rig.room.registry) == 0
        assert (await self.rig.client.get("/metrics")).status_code == 200


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


@pytest.fixture(scope="module")
def session_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionLogWriter]:
    """One session log for the module's examples; read back whole at the end."""
    writer = SessionLogWriter(tmp_path_factory.mktemp("fuzz-log") / "sessions.jsonl")
    yield writer
    writer.close()
    assert writer.num_failed == writer.num_dropped == 0
    with writer.path.open(encoding="utf-8") as handle:  # split into lines as ingest splits them
        lines = list(handle)
    assert len(lines) == writer.num_written > 0
    for line in lines:
        SessionLogRecord.from_json(line).check()


def run_example(log: SessionLogWriter, scenario: Any, limits: Limits | None = None) -> None:
    async def main() -> None:
        options: dict[str, Any] = {"session_log": log} | ({} if limits is None else {"limits": limits})
        async with rig_for(gateway_options=options) as rig:
            checked = Checked(rig, log)
            await scenario(checked)
            await checked.end_everything()

    asyncio.run(main())


# --- the fuzz tests ------------------------------------------------------------------------------


@settings(FUZZ, max_examples=1000 * SCALE)
@given(data=st.data())
def test_one_hostile_request_at_a_time(session_log: SessionLogWriter, data: st.DataObject) -> None:
    async def scenario(checked: Checked) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="requests")):
            kind = data.draw(st.sampled_from(["chat", "chat", "chat", "completion", "generate", "route"]),
                             label="endpoint")
            bodies = BODIES[data.draw(st.booleans(), label="hostile strings")]
            if kind == "route":
                method, path = data.draw(routes, label="route")
                await checked.send(path, {}, [data.draw(st.binary(max_size=32), label="route body")], method)
                continue
            body = mutate(data, data.draw(bodies[kind], label="body"))
            raw = encode(data, body)
            session = data.draw(st.one_of(st.none(), st.none(), ids), label="session")
            await checked.send(PATHS[kind], request_headers(data, session, raw), chunks_of(data, raw))

    run_example(session_log, scenario)


@settings(FUZZ, max_examples=500 * SCALE)
@given(data=st.data())
def test_well_formed_bodies_with_one_field_of_the_wrong_shape(session_log: SessionLogWriter,
                                                              data: st.DataObject) -> None:
    # Issue 16 item 7: ordinary bodies (valid roles, no hostile strings, honest headers) but for one field the
    # gateway reads, so every example gets past parsing to where that field is used.
    async def scenario(checked: Checked) -> None:
        kind = data.draw(st.sampled_from(["chat"] * 6 + ["completion", "generate"]), label="endpoint")
        body = retype_one_read_field(data, data.draw(WELL_FORMED[kind], label="body"))
        raw = json.dumps(body).encode()
        headers = {"content-type": b"application/json", "content-length": str(len(raw)).encode()}
        if data.draw(st.booleans(), label="session header"):
            headers["x-session-id"] = b"s1"
        await checked.send(PATHS[kind], headers, [raw])

    run_example(session_log, scenario)


@settings(FUZZ, max_examples=600 * SCALE)
@given(data=st.data())
def test_multi_call_sessions(session_log: SessionLogWriter, data: st.DataObject) -> None:
    async def scenario(checked: Checked) -> None:
        sessions = data.draw(st.lists(st.tuples(st.sampled_from(["header", "user", "hash"]), ids), min_size=1,
                                      max_size=3, unique_by=lambda s: s[1]), label="sessions")
        messages = BODIES[data.draw(st.booleans(), label="hostile strings")]["messages"]
        histories = {sid: data.draw(st.lists(messages, min_size=1, max_size=3), label="first messages")
                     for _, sid in sessions}
        for _ in range(data.draw(st.integers(2, 6), label="steps")):
            how, sid = data.draw(st.sampled_from(sessions), label="session")
            step = data.draw(st.sampled_from(["call", "call", "call", "mutated call", "end"]), label="step")
            if step == "end":
                response = await checked.rig.client.post(f"/basin/sessions/{quote(sid, safe='')}/end")
                assert response.status_code in (200, 404), response.text[:300]
                await checked.check_state()
                continue
            history = histories[sid]
            body: dict[str, Any] = {"model": "m", "messages": copy.deepcopy(history)}
            if how == "user":
                body["user"] = sid
            if data.draw(st.booleans(), label="stream"):
                body["stream"] = True
            if step == "mutated call":
                body = mutate(data, body)
            raw = encode(data, body) if step == "mutated call" else json.dumps(body).encode()
            headers = {"content-type": b"application/json"}
            if how == "header":
                headers["x-session-id"] = sid.encode()
            call = await checked.send(PATHS["chat"], headers, [raw])
            if call.status == 200:  # the agent goes on: the answer (a tool call or text), then a new turn
                answer = data.draw(st.one_of(st.just({"role": "assistant", "content": "ran it"}), st.fixed_dictionaries(
                    {"role": st.just("assistant"), "content": st.none(), "tool_calls": tool_calls})), label="answer")
                history += [answer, {"role": data.draw(st.sampled_from(["user", "tool"]), label="next role"),
                                     "content": data.draw(texts, label="next turn")}]

    run_example(session_log, scenario)


# --- issue 46: the two-step and the ride ----------------------------------------------------------------------

SHAPE_BUDGET = 6_000
FILLER = "word " * 600  # ~600 tokens a turn


def shaped_call(data: st.DataObject, owner: str, task: str) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """A two-step growth of `owner`'s conversation, or a ride on its id; (path, body, headers)."""
    shape = data.draw(st.sampled_from(["grow", "grow", "ride chat", "ride user", "ride completion", "ride generate",
                                       "other key"]), label="shape")
    turns = data.draw(st.integers(0, 12), label="made-up turns")
    history: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for _ in range(turns):
        history += [{"role": "assistant", "content": FILLER}, {"role": "user", "content": FILLER}]
    headers = {"content-type": b"application/json", "x-session-id": owner.encode()}
    if shape in ("grow", "other key"):
        if shape == "other key":
            headers["authorization"] = b"Bearer someone-else"
        return PATHS["chat"], {"messages": history}, headers
    if shape == "ride user":
        del headers["x-session-id"]
        return PATHS["chat"], {"messages": [{"role": "user", "content": "unrelated"}, *history[1:]], "user": owner}, \
            headers
    if shape == "ride chat":
        return PATHS["chat"], {"messages": [{"role": "user", "content": "unrelated"}, *history[1:]]}, headers
    prompt = "unrelated " + FILLER * turns
    return (PATHS["completion"], {"prompt": prompt}, headers) if shape == "ride completion" else \
        (PATHS["generate"], {"text": prompt}, headers)


@settings(FUZZ, max_examples=150 * SCALE)
@given(data=st.data())
def test_two_step_and_ride_shapes_never_take_the_reservations_past_the_budget(session_log: SessionLogWriter,
                                                                              data: st.DataObject) -> None:
    async def main() -> None:
        async with rig_for(budget_tokens=SHAPE_BUDGET, always_engaged=True,
                           gateway_options={"session_log": session_log}) as rig:
            Checked(rig, session_log)  # its upstream checks what is forwarded
            pending: list[asyncio.Task[Driven]] = []
            owners = [f"o{k}" for k in range(data.draw(st.integers(1, 3), label="owners"))]
            for owner in owners:
                raw = json.dumps({"messages": [{"role": "user", "content": f"task {owner}"}]}).encode()
                pending.append(asyncio.create_task(Driven({"content-type": b"application/json",
                                                           "x-session-id": owner.encode()}, [raw]).run(rig.app)))
                await settled(rig)
            for _ in range(data.draw(st.integers(1, 5), label="steps")):
                owner = data.draw(st.sampled_from(owners), label="owner")
                if data.draw(st.integers(0, 4), label="end?") == 0:
                    await rig.client.post(f"/basin/sessions/{owner}/end")
                else:
                    path, body, headers = shaped_call(data, owner, f"task {owner}")
                    raw = json.dumps(body).encode()
                    pending.append(asyncio.create_task(Driven(headers, [raw], path=path).run(rig.app)))
                await settled(rig)
                check_budget(rig)
            while rig.room.registry or not all(t.done() for t in pending):  # end everyone, head first: every
                for entry in list(rig.room.registry):  # held call goes in (alone at worst) or is told it ended
                    await rig.client.post(f"/basin/sessions/{quote(entry.session_id, safe='')}/end")
                    await settled(rig)
                    check_budget(rig)
                await asyncio.wait(pending, timeout=0.05)
            for call in await asyncio.gather(*pending):
                assert call.status in (200, 409), (call.status, call.sent[-1:])
            snapshot = rig.policy.snapshot()
            assert (snapshot.live, snapshot.queued, snapshot.reserved_tokens, snapshot.working_set_tokens) == (
                (), (), 0, 0)

    asyncio.run(main())


async def settled(rig: Rig) -> None:
    """Let the calls in progress go on (a large body is read in a worker thread); the checks hold at any point."""
    for _ in range(5):
        await asyncio.sleep(0.002)


def check_budget(rig: Rig) -> None:
    """The rule of issue 46 item 1: with admission engaged, the reservations pass the budget only with one live."""
    snapshot = rig.policy.snapshot()
    assert len(snapshot.live) <= 1 or snapshot.reserved_tokens <= snapshot.budget_tokens, snapshot
    views = {v["session_id"]: v for v in sessions_view(rig.gateway)}
    assert sum(v["reserved_tokens"] for v in views.values() if v["state"] == "live") == snapshot.reserved_tokens
    for sid in snapshot.queued:
        assert views[sid]["in_flight"] == 0  # a held call is never forwarded


# --- issue 36: item counts in-process; paths and heads over TCP through the gateway's own protocol --------------

COUNT_LIMITS = Limits(max_messages=12, max_tools=4, max_content_parts=9, max_json_items=400)


def counted_body(data: st.DataObject) -> tuple[dict[str, Any], str | None]:
    """A chat body with drawn numbers of messages, content parts and tools around `COUNT_LIMITS`, and the limit it
    passes first (the gateway checks values before parsing, then messages, tools, parts), or None."""
    num_messages = data.draw(st.integers(1, 16), label="messages")
    parts = [data.draw(st.integers(0, 4), label="parts") for _ in range(num_messages)]
    num_tools = data.draw(st.integers(0, 6), label="tools")
    messages: list[dict[str, Any]] = [
        {"role": "user" if k % 2 == 0 else "assistant",
         "content": f"turn {k}" if not n else [{"type": "text", "text": f"part {j}"} for j in range(n)]}
        for k, n in enumerate(parts)]
    tools = [{"type": "function", "function": {"name": f"t{k}", "parameters": {"type": "object"}}}
             for k in range(num_tools)]
    filler = data.draw(st.integers(0, 60), label="filler values")  # extra values elsewhere: `max_json_items` first
    body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {}), "stop": ["x"] * filler}
    values = sum(1 for _ in _walk(body))
    for passed, limit in ((values > COUNT_LIMITS.max_json_items, "max_json_items"),
                          (num_messages > COUNT_LIMITS.max_messages, "max_messages"),
                          (num_tools > COUNT_LIMITS.max_tools, "max_tools"),
                          (sum(parts) > COUNT_LIMITS.max_content_parts, "max_content_parts")):
        if passed:
            return body, limit
    return body, None


def _walk(value: Any) -> Iterator[Any]:
    yield value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        yield from _walk(child)


@settings(FUZZ, max_examples=300 * SCALE)
@given(data=st.data())
def test_item_counts_around_their_limits(session_log: SessionLogWriter, data: st.DataObject) -> None:
    """Every body within the item limits is served, every one past one gets 413 `too_many_items` naming the first
    it passes, whole or resent by a known session (read from its new messages on)."""
    async def scenario(checked: Checked) -> None:
        body, limit = counted_body(data)
        for _ in range(data.draw(st.integers(1, 2), label="sends")):  # the second: resent by a known session
            raw = json.dumps(body).encode()
            call = await checked.send(PATHS["chat"], {"content-type": b"application/json", "x-session-id": b"s"},
                                      [raw])
            if limit is None:
                assert call.status == 200, (call.status, call.sent[-1])
            else:
                assert (call.status, call.error["type"], call.error["limit"]) == (413, "too_many_items", limit)

    run_example(session_log, scenario, limits=COUNT_LIMITS)


ROUTES = [b"/health", b"/metrics", b"/v1/models", b"/v1/models/", b"/server_info", b"/v1/chat/completions",
          b"/generate", b"/basin/state", b"/basin/sessions/s/end", b"/get_model_info", b"/"]
printable = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8)
token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=1, max_size=12)
# Half of the requests are what a client may send (they reach the app: paths, limits, routes); the other half may
# hold hostile bytes anywhere (they are refused: llhttp, the head limits, the path check).
PATH_PIECES = {
    False: st.one_of(st.sampled_from([b"/", b"/m", b"/qwen%2Fqwen3", b"/a%20b", b"/%c3%a9", b"?x=1", b"?x=%20&y", b"//",
                                      b"/.", b"/..", b"%2e%2e", b"%5c", b"%ff", b"%e2%82", b"%00", b"%25"]),
                     printable.filter(lambda t: "%" not in t and "#" not in t).map(str.encode)),
    True: st.one_of(st.sampled_from([b"%", b"%zz", b"#", b"\\", b" ", b"\t", b"?x=%ff"]), st.binary(min_size=1,
                                                                                                max_size=6)),
}
HEADER_NAMES = {
    False: st.one_of(st.sampled_from([b"X-Session-ID", b"Content-Type", b"X-Basin-Workload", b"Authorization",
                                      b"Accept", b"X-Basin-Session-Key", b"Expect", b"Upgrade"]),
                     token.map(str.encode)),
    True: st.one_of(st.sampled_from([b"Transfer-Encoding", b"Connection", b"Host", b"Content-Length"]),
                    st.binary(min_size=1, max_size=12)),
}
HEADER_VALUES = {
    False: st.one_of(printable.map(str.encode), st.sampled_from([b"100-continue", b"websocket", b"close", b" padded "]),
                     st.integers(1, 12).map(lambda k: b"v" * (1 << k))),  # up to 4 KiB a value
    True: st.one_of(st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=20),
                    st.sampled_from([b"chunked", b"s1\r\nX-Evil: 1", b"\x00", b"12", b"-1"])),
}


@pytest.fixture(scope="module")
def live_server() -> Iterator[Served]:
    """One gateway served as the CLI serves it (its HTTP protocol, 8 KiB heads, 40 headers) for the module."""
    loop = LoopThread()
    ready: concurrent.futures.Future[Served] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def hold() -> None:
        async with serving(max_header_bytes=8192, max_headers=40) as served:
            ready.set_result(served)
            await stop.wait()

    held = asyncio.run_coroutine_threadsafe(hold(), loop.loop)
    try:
        yield ready.result(30)
    finally:
        loop.loop.call_soon_threadsafe(stop.set)
        held.result(60)
        loop.close()


def exchange(port: int, pieces: list[bytes]) -> tuple[int | None, dict[str, str], bytes]:
    """Send `pieces` on a new connection, read one answer (None: the connection closed without one)."""
    parser_target = _Answer()
    parser = httptools.HttpResponseParser(parser_target)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
        except OSError:
            pass  # refused mid-way: the answer may already be there
        while not parser_target.is_complete:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            parser.feed_data(data)
    status = parser.get_status_code() if parser_target.has_head else None
    return status, parser_target.headers, bytes(parser_target.body)


class _Answer:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.has_head = self.is_complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.has_head = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.is_complete = True


@settings(FUZZ, max_examples=400 * SCALE)
@given(data=st.data())
def test_hostile_paths_and_heads_over_tcp(live_server: Served, data: st.DataObject) -> None:
    """Any method, path bytes and headers, sent in any pieces, to the real server: every answer is the app's or a
    JSON error with a stable `type` and its status as `code` (400 for what llhttp refuses, 431 past the head limits,
    4xx for a path), never a 5xx or plain text, and the server goes on serving."""
    hostile = {part: data.draw(st.integers(0, 5), label=f"hostile {part}?") == 0 for part in ("method", "path",
                                                                                            "names", "values")}
    methods = [b"G\x00T", b"GET /x", b""] if hostile["method"] else [b"GET"] * 4 + [b"POST"] * 3 + [
        b"PUT", b"HEAD", b"OPTIONS", b"DELETE"]
    method = data.draw(st.sampled_from(methods), label="method")
    pieces_of_path = st.one_of(PATH_PIECES[False], PATH_PIECES[hostile["path"]])
    path = data.draw(st.sampled_from(ROUTES), label="route") + b"".join(data.draw(st.lists(pieces_of_path, max_size=4),
                                                                                label="path"))
    header = st.tuples(st.one_of(HEADER_NAMES[False], HEADER_NAMES[hostile["names"]]),
                       st.one_of(HEADER_VALUES[False], HEADER_VALUES[hostile["values"]]))
    headers = data.draw(st.lists(header, max_size=6), label="headers")
    if data.draw(st.integers(0, 9), label="many headers?") == 0:
        headers += [(b"X-H%d" % k, b"v") for k in range(data.draw(st.integers(30, 60), label="how many"))]
    if data.draw(st.integers(0, 9), label="huge header?") == 0:
        headers.append((b"X-Big", b"b" * data.draw(st.integers(6000, 20000), label="size")))
    body = data.draw(st.sampled_from([b"", b'{"messages": [{"role": "user", "content": "task"}]}', b"{nope"]),
                     label="body")
    head = method + b" " + path + b" HTTP/1.1\r\nHost: gateway\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    if not any(name.lower() in (b"transfer-encoding", b"content-length") for name, _ in headers):
        head += b"Content-Length: " + str(len(body)).encode() + b"\r\n"
    head += b"Connection: close\r\n\r\n"
    request = head + body
    cuts = sorted(data.draw(st.lists(st.integers(1, max(1, len(request) - 1)), max_size=3), label="cuts"))
    pieces = [request[a:b] for a, b in zip([0, *cuts], [*cuts, len(request)], strict=True) if a < b]

    status, answer_headers, answer = exchange(live_server.port, pieces)
    assert status is not None and status < 500, (status, answer[:300])  # an answer, even to a refused request
    if method != b"HEAD" and status >= 300:  # (a HEAD answer has no body)
        assert answer_headers.get("content-type") == "application/json", (status, answer_headers, answer[:300])
        error = json.loads(answer)["error"]
        assert isinstance(error["type"], str) and error["code"] == status, error
    health_status, _, _ = exchange(live_server.port, [b"GET /health HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n"])
    assert health_status == 200


# Regressions the suite found, kept by name.

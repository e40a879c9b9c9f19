"""A small in-process OpenAI-compatible server for the replay tests (Starlette + uvicorn on loopback).

It answers streamed chat completions with usage: prompt tokens counted with the serving tokenizer,
cached tokens = the tokens of the longest message prefix this session sent before (what a prefix
cache would hit), forgetting the least recently used sessions beyond `capacity_tokens` (so hits fall
as load grows). It sheds chosen sessions with the gateway's 503 (Retry-After, `session_shed` body),
holds chosen ones unanswered until released (or reset), counts `sglang:prefill_effective_tokens_total{mode=...}` and
reports `sglang:max_total_num_tokens` on /metrics, and records every request (with the time on the
test's clock, `now`) and session end.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from basin_runtime.tokenizer import get_tokenizer

MODEL = "fake-model"
RETRY_AFTER_S = 7


@dataclass
class FakeEngine:
    """The fake's behaviour (set by a test) and what it saw."""

    capacity_tokens: int = 10_000_000
    shed: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)  # sessions answered only once `released` is set
    released: threading.Event = field(default_factory=threading.Event)
    now: Callable[[], float] = time.monotonic  # the clock a request's arrival is recorded on
    delay_s: float = 0.002  # before the first token of every call
    requests: list[dict[str, Any]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    cached_total: int = 0
    computed_total: int = 0
    _chains: OrderedDict[str, list[tuple[str, int]]] = field(default_factory=OrderedDict)
    _held_tokens: int = 0  # sum of the remembered chains
    _counts: dict[str, int] = field(default_factory=dict)

    def reset(self, **settings: Any) -> FakeEngine:
        """Forget everything and apply new settings."""
        fresh = FakeEngine(**settings)
        self.__dict__.update(fresh.__dict__)
        return self

    def _message_tokens(self, message: dict[str, Any]) -> tuple[str, int]:
        key = json.dumps(message, sort_keys=True)
        if key not in self._counts:
            self._counts[key] = get_tokenizer().count_message(message)
        return key, self._counts[key]

    def serve(self, session: str, messages: list[dict[str, Any]]) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of one request; remembers it as the session's cached chain."""
        chain = [self._message_tokens(m) for m in messages]
        previous = self._chains.pop(session, [])
        self._held_tokens -= sum(t for _, t in previous)
        cached = 0
        for (key, tokens), (old, _) in zip(chain, previous, strict=False):
            if key != old:
                break
            cached += tokens
        body = sum(tokens for _, tokens in chain)
        prompt = body + get_tokenizer().generation_prompt_tokens
        self._chains[session] = chain
        self._held_tokens += body
        while self._held_tokens > self.capacity_tokens and len(self._chains) > 1:
            _, dropped = self._chains.popitem(last=False)  # the least recently used session is forgotten
            self._held_tokens -= sum(t for _, t in dropped)
        self.cached_total += cached
        self.computed_total += prompt - cached
        return prompt, cached

    def metrics_text(self) -> str:
        """SGLang-style Prometheus text."""
        return (
            "# TYPE sglang:prefill_effective_tokens_total counter\n"
            f'sglang:prefill_effective_tokens_total{{mode="device_hit",model_name="{MODEL}"}} {self.cached_total}\n'
            f'sglang:prefill_effective_tokens_total{{mode="compute",model_name="{MODEL}"}} {self.computed_total}\n'
            "# TYPE sglang:max_total_num_tokens gauge\n"
            f'sglang:max_total_num_tokens{{model_name="{MODEL}"}} {self.capacity_tokens}\n'
        )


def _chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def build_app(engine: FakeEngine) -> Starlette:
    """The fake's routes."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                         "owned_by": "sglang"}]})

    async def chat(request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:  # the replay was stopped while this request was on its way
            return Response(status_code=499)
        session = request.headers.get("x-session-id", "")
        engine.requests.append({"session": session, "workload": request.headers.get("x-basin-workload"),
                                "body": body, "time": engine.now()})
        released = engine.released
        while session in engine.held and not released.is_set():  # a reset (new set, new event) also frees it
            await asyncio.sleep(0.01)
        if session in engine.shed:
            error = {"message": f"session {session!r} was shed: arrival rate above the completion rate",
                     "type": "session_shed", "code": 503, "reason": "arrival rate above the completion rate",
                     "session_id": session, "waited_s": 0.0, "retry_after_s": RETRY_AFTER_S}
            return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        prompt, cached = engine.serve(session, body["messages"])
        words = max(1, int(body.get("max_tokens") or 1))

        async def stream() -> AsyncIterator[bytes]:
            yield _chunk({"role": "assistant", "content": ""})
            await asyncio.sleep(engine.delay_s)
            yield _chunk({"content": " ".join(["ok"] * words)})
            yield _chunk({}, finish="length")
            yield _chunk({}, usage={"prompt_tokens": prompt, "completion_tokens": words,
                                    "total_tokens": prompt + words, "prompt_tokens_details": {"cached_tokens": cached}})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def end(request: Request) -> Response:
        engine.ended.append(request.path_params["session"])
        return JSONResponse({"ended": request.path_params["session"]})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(engine.metrics_text())

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/basin/sessions/{session}/end", end, methods=["POST"]),
                             Route("/metrics", metrics)])


@dataclass(frozen=True)
class FakeServer:
    """A running fake: its root URL and its engine."""

    url: str
    engine: FakeEngine

    @property
    def base_url(self) -> str:
        """The OpenAI base URL."""
        return f"{self.url}/v1"


@contextmanager
def running_fake() -> Iterator[FakeServer]:
    """Serve a fake on a free loopback port in a background thread until the block ends."""
    engine = FakeEngine()
    with serving(build_app(engine)) as url:
        yield FakeServer(url, engine)


@contextmanager
def serving(app: Starlette, lifespan: Literal["on", "off"] = "off") -> Iterator[str]:
    """Serve `app` on a free loopback port in a background thread until the block ends; its root URL."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and a
    # plain socket.socket() says 0, which costs every response a 40 ms delayed-ACK stall.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan, ws="none", http="h11", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

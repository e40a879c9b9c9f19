"""A stand-in SGLang worker (prefill or decode) for the end-to-end test; runs on CPU in milliseconds.

It answers what `smg` 1.13.0 checks when it registers a worker: `GET /health`, `GET /v1/models`
(with `owned_by: "sglang"`, which is how smg tells SGLang from vLLM), `GET /server_info` and
`GET /model_info`. It answers 404 on `GET /version`: a worker that answers both `/version` and
`/server_info` is taken for vLLM, and smg then runs vLLM's PD protocol (prefill first with
`max_tokens: 1`, no bootstrap fields) instead of SGLang's. A prefill worker also listens on its
bootstrap port (smg probes it with a TCP connect at registration and only warns if it is closed).

It records every inference request (`GET /_records`) and answers chat completions streamed and not,
with `usage.prompt_tokens_details.cached_tokens` (as SGLang with `--enable-cache-report`).

A fault is scripted per request by its last user message, `fault:<kind> ...`, and acted out by the
decode worker (the one whose answer smg returns; the prefill worker answers as usual):
`status-429`, `status-500`, `status-503` (SGLang's JSON error body with that status), `garbage` (200,
`application/json`, a body that is not JSON), `truncate` (a stream that ends cleanly after two
chunks, without `[DONE]`), `hang` (a stream that sends one chunk, then nothing until the client
leaves) and `kill` (one chunk, then the worker SIGKILLs itself).

    python -m tests.e2e.standin_worker --role prefill --port P --bootstrap-port B
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "standin-model"
RECORDED_FIELDS = ("priority", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "stream", "user")
FAULT_PREFIX = "fault:"
STATUS_FAULTS = {"status-429": 429, "status-500": 500, "status-503": 503}
STREAM_FAULTS = ("truncate", "hang", "kill")


def create_app(role: str, bootstrap_port: int | None) -> Starlette:
    """The worker app for `role` ("prefill" or "decode"); a decode worker acts out scripted faults."""
    records: list[dict[str, Any]] = []

    async def inference(request: Request) -> Response:
        body = json.loads(await request.body())
        content = _last_user_text(body)
        record = {key: body.get(key) for key in RECORDED_FIELDS}
        record.update(path=request.url.path, role=role, at=time.time(),
                      authorization=request.headers.get("authorization"), content=content,
                      routing_key=request.headers.get("x-smg-routing-key"))
        records.append(record)
        fault = _fault_of(content) if role == "decode" else None
        if fault in STATUS_FAULTS:
            return JSONResponse({"object": "error", "message": f"stand-in {role} scripted {fault}",
                                 "type": "BadRequestError" if fault == "status-429" else "InternalServerError",
                                 "param": None, "code": STATUS_FAULTS[fault]}, status_code=STATUS_FAULTS[fault])
        if fault == "garbage":
            return Response(b"<html>stand-in garbage, not JSON", media_type="application/json")
        if fault in STREAM_FAULTS:
            return StreamingResponse(_faulty_chunks(body, fault), media_type="text/event-stream")
        if body.get("stream"):
            return StreamingResponse(_chunks(body), media_type="text/event-stream")
        return JSONResponse(_completion(body))

    async def get_records(request: Request) -> Response:
        return JSONResponse(records)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]})

    async def server_info(request: Request) -> Response:
        return JSONResponse({"model_path": MODEL, "served_model_name": MODEL, "disaggregation_mode": role,
                             "max_running_requests": 64, "enable_priority_scheduling": True,
                             "schedule_low_priority_values_first": True})

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": MODEL, "is_generation": True})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server = None
        if bootstrap_port is not None:
            server = await asyncio.start_server(_close_at_once, "127.0.0.1", bootstrap_port)
        try:
            yield
        finally:
            if server is not None:
                server.close()

    routes = [Route(p, inference, methods=["POST"]) for p in ("/v1/chat/completions", "/v1/completions", "/generate")]
    routes += [
        Route("/_records", get_records), Route("/v1/models", models), Route("/server_info", server_info),
        Route("/get_server_info", server_info), Route("/model_info", model_info),
        Route("/get_model_info", model_info), Route("/health", health), Route("/health_generate", health),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def _last_user_text(body: dict[str, Any]) -> str | None:
    users = [m for m in body.get("messages") or [] if m.get("role") == "user"]
    return str(users[-1].get("content")) if users else None


def _fault_of(content: str | None) -> str | None:
    """The fault a request's last user message scripts (`fault:<kind> ...`), if any."""
    if content is None or not content.startswith(FAULT_PREFIX):
        return None
    return content[len(FAULT_PREFIX):].split(maxsplit=1)[0]


def _usage(body: dict[str, Any]) -> dict[str, Any]:
    prompt = len(json.dumps(body.get("messages") or body.get("prompt") or body.get("text") or "")) // 4
    return {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3,
            "prompt_tokens_details": {"cached_tokens": prompt // 2}}


def _completion(body: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-standin", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "stand-in answer"},
                         "finish_reason": "stop"}],
            "usage": _usage(body)}


async def _chunks(body: dict[str, Any]) -> AsyncIterator[bytes]:
    base = {"id": "cmpl-standin", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
    for k, piece in enumerate(("stand-in ", "streamed ", "answer")):
        delta = {"role": "assistant", "content": piece} if k == 0 else {"content": piece}
        yield _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await asyncio.sleep(0.02)
    yield _sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    if (body.get("stream_options") or {}).get("include_usage"):
        yield _sse({**base, "choices": [], "usage": _usage(body)})
    yield b"data: [DONE]\n\n"


async def _faulty_chunks(body: dict[str, Any], fault: str) -> AsyncIterator[bytes]:
    """A stream that goes wrong after its first chunk(s): `truncate`, `hang` or `kill`."""
    base = {"id": "cmpl-standin", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
    yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "cut "},
                                     "finish_reason": None}]})
    await asyncio.sleep(0.02)
    if fault == "truncate":
        yield _sse({**base, "choices": [{"index": 0, "delta": {"content": "short"}, "finish_reason": None}]})
        return  # a clean end of the body, without [DONE]
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.Event().wait()  # hang: nothing more, until the client leaves


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def main() -> None:
    """Serve one stand-in worker on loopback."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int)
    args = parser.parse_args()
    uvicorn.run(create_app(args.role, args.bootstrap_port), host="127.0.0.1", port=args.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()

r"""The answers, in SGLang's shapes, with synthetic text: bodies and stream chunks for chat, completions, /generate.

Rules:
- Token k of every answer is WORDS[k % len(WORDS)] followed by a space (cheap, and the same on every
  server); its id is FIRST_WORD_ID + k % len(WORDS).
- The response id is the request's `rid` when given (SGLang answers with it), else a fresh one.
- usage.prompt_tokens_details.cached_tokens only with --enable-cache-report (else null), as SGLang;
  /generate's meta_info.cached_tokens always, and meta_info.cached_tokens_details (by source: device,
  host[, storage, storage_backend]) when anything was cached; OpenAI answers carry the same details as
  the response-level `sglext.cached_tokens_details` only when the request asked
  (`return_cached_tokens_details`), as SGLang's serving_chat does.
- Streams are SSE: `data: {json}\n\n` ... `data: [DONE]\n\n`. Chat opens with a role chunk, then
  content deltas, a finish chunk, and with stream_options.include_usage a usage chunk (no choices).
  /generate chunks carry the whole text so far and meta_info, as SGLang's non-incremental stream.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from basin_emulate.calls import Call, Endpoint

WORDS = ("the", "model", "reads", "a", "long", "conversation", "and", "answers", "with", "tokens", "that",
         "carry", "no", "meaning", "but", "arrive", "on", "time", "from", "an", "emulated", "engine")
FIRST_WORD_ID = 1000


def synthetic_text(start: int, end: int) -> str:
    """The text of answer tokens [start, end)."""
    return "".join(f"{WORDS[k % len(WORDS)]} " for k in range(start, end))


def synthetic_ids(start: int, end: int) -> list[int]:
    """The token ids of answer tokens [start, end)."""
    return [FIRST_WORD_ID + k % len(WORDS) for k in range(start, end)]


def new_rid() -> str:
    """A fresh request id (SGLang's are uuid4 hex)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Answer:
    """Everything a finished answer reports."""

    rid: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    e2e_latency_s: float
    is_cache_report: bool
    cached_details: dict[str, int | str] | None = None  # by source; None: nothing cached


def usage(answer: Answer) -> dict[str, Any]:
    """OpenAI usage, with cached tokens only when the server reports them."""
    details = {"cached_tokens": answer.cached_tokens} if answer.is_cache_report else None
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens, "prompt_tokens_details": details}


def meta_info(answer: Answer, tokens_out: int, is_finished: bool) -> dict[str, Any]:
    """/generate's meta_info after `tokens_out` tokens."""
    finish = None
    if is_finished:
        finish = {"type": "length", "length": answer.completion_tokens} if answer.finish_reason == "length" \
            else {"type": "stop", "matched": FIRST_WORD_ID - 1}
    meta: dict[str, Any] = {"id": answer.rid, "finish_reason": finish, "prompt_tokens": answer.prompt_tokens,
                            "completion_tokens": tokens_out, "cached_tokens": answer.cached_tokens,
                            "e2e_latency": answer.e2e_latency_s if is_finished else None}
    if answer.cached_tokens > 0 and answer.cached_details is not None:
        meta["cached_tokens_details"] = answer.cached_details
    return meta


def response_body(call: Call, answer: Answer) -> dict[str, Any]:
    """The non-streamed answer."""
    text = synthetic_text(0, answer.completion_tokens)
    created = int(time.time())
    if call.endpoint == Endpoint.GENERATE:
        return {"text": text, "output_ids": synthetic_ids(0, answer.completion_tokens),
                "meta_info": meta_info(answer, answer.completion_tokens, is_finished=True)}
    if call.endpoint == Endpoint.CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text,
                                                          "reasoning_content": None, "tool_calls": None},
                                  "logprobs": None, "finish_reason": answer.finish_reason, "matched_stop": None}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": answer.finish_reason,
                  "matched_stop": None}
        kind = "text_completion"
    body = {"id": answer.rid, "object": kind, "created": created, "model": answer.model, "choices": [choice],
            "usage": usage(answer)}
    if call.return_cached_tokens_details and answer.cached_tokens > 0 and answer.cached_details is not None:
        body["sglext"] = {"cached_tokens_details": answer.cached_details}
    return body


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class StreamWriter:
    """The chunks of one streamed answer, in the endpoint's shape."""

    def __init__(self, call: Call, rid: str, model: str) -> None:
        self.call = call
        self.rid = rid
        self.model = model
        self.created = int(time.time())

    def opening(self) -> bytes:
        """What is sent before the first token (chat's role chunk)."""
        if self.call.endpoint != Endpoint.CHAT:
            return b""
        return sse(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None, "matched_stop": None}))

    def tokens(self, start: int, end: int, answer: Answer) -> bytes:
        """Tokens [start, end) of the answer."""
        if self.call.endpoint == Endpoint.GENERATE:
            return sse({"text": synthetic_text(0, end), "output_ids": synthetic_ids(0, end),
                        "meta_info": meta_info(answer, end, is_finished=False)})
        return sse(self._chunk(self._choice(synthetic_text(start, end), None)))

    def closing(self, answer: Answer) -> bytes:
        """The finish chunk, the usage chunk when asked, and the end of the stream."""
        if self.call.endpoint == Endpoint.GENERATE:
            end = answer.completion_tokens
            return sse({"text": synthetic_text(0, end), "output_ids": synthetic_ids(0, end),
                        "meta_info": meta_info(answer, end, is_finished=True)}) + sse("[DONE]")
        out = sse(self._chunk(self._choice(None, answer.finish_reason)))
        if self.call.include_usage:
            out += sse({**self._chunk(None), "choices": [], "usage": usage(answer)})
        return out + sse("[DONE]")

    def _choice(self, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if self.call.endpoint == Endpoint.CHAT:
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                    "matched_stop": None}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason,
                "matched_stop": None}

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.call.endpoint == Endpoint.CHAT else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice], "usage": None}

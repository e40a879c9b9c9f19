"""CPU seconds and peak memory of the gateway's SSE relay (`proxy.UpstreamResponse`), in-process.

Cases, each relayed through the real `UpstreamResponse` to an ASGI `send` that drops what it gets
(no network, no app: only the relay's own framing and parsing is measured):
- one 64 MiB event without a blank line until its end, in 64 KiB upstream chunks (issue 16, item 12);
- a normal stream: 10,000 token events, one per upstream chunk, then the usage chunk and `[DONE]`,
  framed with LF and with CRLF, with the gateway's own usage chunk dropped or not.
CPU is `time.process_time` over one relay; peak memory is tracemalloc's peak over a second one.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sse_relay.py [--event-mib 64] [--events 10000]

Run it with `PYTHONPATH` pointing at another checkout to measure that one (the relay's constructor
is called with its long-standing arguments only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import tracemalloc
from collections.abc import AsyncGenerator, Callable, Mapping, MutableMapping
from typing import Any

from basin_runtime.gateway.proxy import CallEnd, UpstreamResponse

CHUNK_BYTES = 64 << 10


class ReplayedAnswer:
    """An upstream SSE answer whose body is a fixed list of chunks (the `UpstreamAnswer` protocol)."""

    def __init__(self, chunks: Callable[[], list[bytes]]) -> None:
        self._make = chunks

    status_code = 200
    reason = "OK"
    url = "http://bench/v1/chat/completions"

    @property
    def headers(self) -> Mapping[str, str]:
        return {"content-type": "text/event-stream"}

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        for chunk in self._make():
            yield chunk

    async def read(self, limit: int) -> bytes:
        return b"".join(self._make())[:limit]

    async def aclose(self) -> None:
        pass


def big_event(mib: int) -> Callable[[], list[bytes]]:
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * (mib << 20) + b'"}}]}\n\ndata: [DONE]\n\n'
    pieces = [event[k:k + CHUNK_BYTES] for k in range(0, len(event), CHUNK_BYTES)]
    return lambda: pieces


def token_stream(events: int, separator: bytes) -> Callable[[], list[bytes]]:
    def sse(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + separator

    pieces = [sse({"id": "c", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": {"content": f"tok{k} "}, "finish_reason": None}]})
              for k in range(events)]
    pieces.append(sse({"id": "c", "choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": events,
                                                            "prompt_tokens_details": {"cached_tokens": 800}}}))
    pieces.append(b"data: [DONE]" + separator)
    return lambda: pieces


async def relay_once(chunks: Callable[[], list[bytes]], drop_usage_chunk: bool) -> tuple[int, CallEnd]:
    """Relay one answer; the bytes the client got and how the call ended."""
    got = 0
    ends: list[CallEnd] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal got
        got += len(message.get("body", b""))

    async def receive() -> MutableMapping[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def on_end(end: CallEnd) -> None:
        ends.append(end)

    response = UpstreamResponse(ReplayedAnswer(chunks), on_end, drop_usage_chunk=drop_usage_chunk)  # type: ignore[arg-type]
    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    return got, ends[0]


def measure(chunks: Callable[[], list[bytes]], drop_usage_chunk: bool) -> tuple[float, float, int, CallEnd]:
    """CPU seconds of one relay, tracemalloc's peak MiB over another, bytes relayed, the call's end."""
    chunks()  # built once, outside both measurements
    started = time.process_time()
    got, end = asyncio.run(relay_once(chunks, drop_usage_chunk))
    cpu_s = time.process_time() - started
    tracemalloc.start()
    asyncio.run(relay_once(chunks, drop_usage_chunk))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return cpu_s, peak / (1 << 20), got, end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--event-mib", type=int, default=64, help="size of the single big event (MiB)")
    parser.add_argument("--events", type=int, default=10_000, help="token events in the normal stream")
    args = parser.parse_args(argv)
    cases = [
        (f"one {args.event_mib} MiB event, {CHUNK_BYTES >> 10} KiB chunks", big_event(args.event_mib), False),
        (f"{args.events} events, LF", token_stream(args.events, b"\n\n"), False),
        (f"{args.events} events, LF, usage chunk dropped", token_stream(args.events, b"\n\n"), True),
        (f"{args.events} events, CRLF", token_stream(args.events, b"\r\n\r\n"), False),
    ]
    print(f"{'case':<44} {'CPU s':>7} {'peak MiB':>9} {'relayed MiB':>12}  outcome, usage")
    for name, chunks, drop in cases:
        cpu_s, peak_mib, got, end = measure(chunks, drop)
        usage = None if end.usage is None else (end.usage.completion_tokens, end.usage.cached_tokens)
        print(f"{name:<44} {cpu_s:>7.3f} {peak_mib:>9.2f} {got / (1 << 20):>12.1f}  {end.outcome}, {usage}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

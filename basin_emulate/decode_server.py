# The decode server's request path: SGLang PD's decode half.
#
# Rules:
# - A request must carry the router's bootstrap fields (host, port, room): without them it is a bad
#   request (400), as a decode-only server cannot prefill.
# - Order: reserve memory (the pre-allocation queue), tell the prefill half over its bootstrap port
#   and wait for the KV, join the running batch, answer. The KV's arrival time is the prefill's
#   transfer end (clock.at_unix), not the HTTP hop's.
# - The answer reports the prefill side's cached tokens. A non-streamed answer comes when the last
#   token is out; a streamed one starts with the first token (response headers included, so a
#   bootstrap failure is still a clean 500) and sends tokens as the engine's flushes make them due.
# - Whatever ends the request early (client gone, bootstrap failure) gives its memory back at once; a
#   request refused before it reserved anything (malformed, too large) tells the prefill half so.
"""The decode role: pre-allocation, KV rendezvous, running batch, streamed tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from basin_emulate.bootstrap import BootstrapClient, KvArrival
from basin_emulate.calls import Call
from basin_emulate.context import ServerContext, prompt_of
from basin_emulate.decode_engine import DecodeEngine, DecodeStage, DecodeTicket
from basin_emulate.errors import BadRequestError, ClientGoneError, EmulatorError
from basin_emulate.metrics import EngineState
from basin_emulate.responses import Answer, StreamWriter, new_rid, response_body
from basin_runtime.disconnect import race_client


class DecodeServer:
    """The decode half of a PD deployment."""

    def __init__(self, context: ServerContext) -> None:
        config = context.config
        self.context = context
        self.engine = DecodeEngine(config.profile, context.clock, config.max_total_tokens)
        self.bootstrap = BootstrapClient(config.bootstrap_timeout_s)

    async def start(self) -> None:
        """Open the HTTP client for bootstrap rendezvous."""
        await self.bootstrap.start()

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.bootstrap.close()

    async def answer(self, call: Call, receive: Receive) -> Response:
        """Serve one request."""
        if not call.bootstrap.is_complete:
            raise BadRequestError("a decode server needs bootstrap_host, bootstrap_port and bootstrap_room (send the "
                                  "request through the PD router, which adds them)")
        context, bootstrap = self.context, call.bootstrap
        assert bootstrap.host is not None and bootstrap.port is not None and bootstrap.room is not None
        arrival_s = context.clock.catch_up()
        try:
            prompt = await prompt_of(context.counter, call)
            ticket = self.engine.submit(prompt.prompt_tokens, call.max_new_tokens, call.completion_tokens,
                                        context.order.key(call.priority), call.is_stream, arrival_s)
        except EmulatorError as exc:  # refused before reserving: the prefill half need not wait for us
            await self.bootstrap.abort(bootstrap.host, bootstrap.port, bootstrap.room, str(exc))
            raise
        is_streaming = False
        try:
            kv = await race_client(self._meet(call, ticket), receive, ClientGoneError)
            self.engine.join(ticket, context.clock.at_unix(kv.transfer_done_unix_s))
            answer = Answer(call.rid or new_rid(), context.config.model_name, prompt.prompt_tokens,
                            call.completion_tokens, min(kv.cached_tokens, prompt.prompt_tokens), call.finish_reason,
                            0.0, context.config.enable_cache_report)
            if call.is_stream:
                is_streaming = True
                return StreamingResponse(self._stream(call, ticket, answer), media_type="text/event-stream")
            finish_s = await race_client(self.engine.wait_finished(ticket), receive, ClientGoneError)
            return JSONResponse(response_body(call, self._finished(ticket, answer, finish_s)))
        finally:
            if not is_streaming:
                self.engine.withdraw(ticket)  # no-op once it has finished

    async def _meet(self, call: Call, ticket: DecodeTicket) -> KvArrival:
        """Reserve the memory, then fetch the KV from the prefill half."""
        granted_s = await self.engine.wait_granted(ticket)
        bootstrap = call.bootstrap
        assert bootstrap.host is not None and bootstrap.port is not None and bootstrap.room is not None
        return await self.bootstrap.fetch_kv(bootstrap.host, bootstrap.port, bootstrap.room,
                                             self.context.clock.unix_of(granted_s))

    async def _stream(self, call: Call, ticket: DecodeTicket, answer: Answer) -> AsyncIterator[bytes]:
        writer = StreamWriter(call, answer.rid, answer.model)
        try:
            yield writer.opening()
            sent = 0
            while True:
                ticket.progress.clear()
                out = ticket.emitted
                if out > sent:
                    yield writer.tokens(sent, out, answer)
                    sent = out
                if ticket.finished.done() and sent == ticket.total_tokens:
                    break
                await ticket.progress.wait()
            yield writer.closing(self._finished(ticket, answer, ticket.finished.result()))
        finally:
            self.engine.withdraw(ticket)

    def _finished(self, ticket: DecodeTicket, answer: Answer, finish_s: float) -> Answer:
        """The answer with its latency, recorded in the metrics."""
        context = self.context
        e2e_s = context.latency_s(ticket.arrival_s, finish_s)
        context.metrics.finished(answer.prompt_tokens, answer.completion_tokens,
                                 context.latency_s(ticket.arrival_s, ticket.join_s), e2e_s)
        return dataclasses.replace(answer, e2e_latency_s=e2e_s)

    def flush(self) -> bool:
        """Decode keeps no prefix cache: succeeds when idle, as SGLang's flush does."""
        return self.engine.is_idle

    def state(self) -> EngineState:
        """Load and memory now."""
        engine, instance = self.engine, self.engine.instance
        now = engine.clock.now_s
        return EngineState(
            num_running_reqs=instance.batch_size, num_queue_reqs=engine.count(DecodeStage.PREALLOC),
            num_used_tokens=round(instance.used_tokens(now)), max_total_num_tokens=instance.capacity_tokens,
            kv_available_tokens=max(0, int(instance.free_tokens(now))), kv_evictable_tokens=0, cache_hit_rate=0.0,
            pd_queues={"num_decode_prealloc_queue_reqs": engine.count(DecodeStage.PREALLOC),
                       "num_decode_transfer_queue_reqs": engine.count(DecodeStage.TRANSFER)},
            effective_tokens={"input": 0, "device_hit": 0, "host_hit": 0}, cached_tokens={"device": 0, "host": 0},
            generation_tokens=engine.generated_tokens)

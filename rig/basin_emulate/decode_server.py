"""The decode role's request path: SGLang PD's decode half (pre-allocation, KV rendezvous, running batch, tokens).

Rules:
- A request must carry the router's bootstrap fields (host, port, room): without them it is a bad
  request (400), as a decode-only server cannot prefill.
- Order: reserve memory (the pre-allocation queue), tell the prefill half over its bootstrap port
  and wait for the KV, join the running batch, answer. The KV's arrival time is the prefill's
  transfer end (clock.at_unix), not the HTTP hop's.
- The answer reports the prefill side's cached tokens. A non-streamed answer comes when the last
  token is out; a streamed one starts with the first token (response headers included, so a
  bootstrap failure is still a clean 500) and sends tokens as the engine's flushes make them due.
- Whatever ends the request early (client gone, bootstrap failure) gives its memory back at once; a
  request refused before it reserved anything (malformed, too large) tells the prefill half so.
- --disaggregation-decode-enable-offload-kvcache: a finished chat request's KV past its prompt's whole
  pages (prompt tail + answer but its last token, whole strides; basin_sim/storage.py) is written to the
  storage folder under the key its next call's prompt will have (the conversation with this answer
  appended as an assistant message, storage.py), so prefill can read it back. Text and token-id
  prompts are not offloaded (their continuation is not keyed here).
- --disaggregation-decode-enable-radix-cache: decode keeps a finished request's KV (prompt + answer)
  in idle memory, evicted oldest first whenever a request or a step needs the room (the instance's
  lent memory); a request continuing it tells prefill `decode_prefix_len`, so only the rest is
  transferred. With offload on as well, SGLang 0.5.23 frees finished requests through the offload
  manager instead of inserting them in decode's tree (`_release_finished_req`), so nothing is kept.
- Assumption (--enable-session-radix-cache on decode): the kept KV above is an oldest-first list, not a
  radix tree with an eviction order, so decode takes no session reference; `/close_session` is answered
  and counted (`basin_emulate_session_closes_total`). SGLang's decode with its radix cache on would take
  references (its requests finish normally); the emulator does not model that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive

from basin_emulate.bootstrap import BootstrapClient, KvArrival
from basin_emulate.calls import Call
from basin_emulate.context import ServerContext, prompt_of
from basin_emulate.decode_engine import DecodeEngine, DecodeStage, DecodeTicket
from basin_emulate.errors import BadRequestError, ClientGoneError, EmulatorError
from basin_emulate.identity import Prompt
from basin_emulate.metrics import EngineState
from basin_emulate.responses import Answer, StreamWriter, new_rid, response_body, synthetic_text
from basin_emulate.storage import FileStore
from basin_runtime.disconnect import race_client
from basin_sim.storage import decode_offload_range, page_floor


class DecodeServer:
    """The decode half of a PD deployment."""

    def __init__(self, context: ServerContext) -> None:
        config = context.config
        self.context = context
        self.engine = DecodeEngine(config.profile, context.clock, config.max_total_tokens)
        self.bootstrap = BootstrapClient(config.bootstrap_timeout_s, context.clock.base)
        self.store = FileStore(config.storage_dir, config.model_name) \
            if config.enable_offload_kvcache and config.storage_dir is not None else None
        self.offloaded_tokens = 0  # written to storage (sglang:backuped_tokens_total)
        self.keeps_finished = config.enable_decode_radix_cache and not config.enable_offload_kvcache
        self.held: OrderedDict[str, tuple[int, bytes, int]] = OrderedDict()  # conversation -> units, digest, tokens
        self.engine.instance.reclaim = self._evict
        self.sessions_closed = 0  # /close_session calls
        self.tagged_requests = 0  # requests carrying a session_id

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
        if call.session_id is not None:
            self.tagged_requests += 1
        assert bootstrap.host is not None and bootstrap.port is not None and bootstrap.room is not None
        arrival_s = context.clock.catch_up()
        try:
            prompt = await prompt_of(context.counter, call)
            decode_prefix_len = self._take_held(prompt)
            ticket = self.engine.submit(prompt.prompt_tokens, call.max_new_tokens, call.completion_tokens,
                                        context.order.key(call.priority), call.is_stream, arrival_s)
        except EmulatorError as exc:  # refused before reserving: the prefill half need not wait for us
            await self.bootstrap.abort(bootstrap.host, bootstrap.port, bootstrap.room, str(exc))
            raise
        is_streaming = False
        try:
            kv = await race_client(self._meet(call, ticket, decode_prefix_len), receive, ClientGoneError)
            self.engine.join(ticket, context.clock.at_unix(kv.transfer_done_unix_s))
            answer = Answer(call.rid or new_rid(), context.config.model_name, prompt.prompt_tokens,
                            call.completion_tokens, min(kv.cached_tokens, prompt.prompt_tokens), call.finish_reason,
                            0.0, context.config.enable_cache_report, kv.cached_details)
            if call.is_stream:
                is_streaming = True
                return StreamingResponse(self._stream(call, prompt, ticket, answer), media_type="text/event-stream")
            finish_s = await race_client(self.engine.wait_finished(ticket), receive, ClientGoneError)
            finished = self._finished(ticket, answer, finish_s, call.priority)
            await self._keep(call, prompt, answer.completion_tokens)
            return JSONResponse(response_body(call, finished))
        finally:
            if not is_streaming:
                self.engine.withdraw(ticket)  # no-op once it has finished

    async def _meet(self, call: Call, ticket: DecodeTicket, decode_prefix_len: int) -> KvArrival:
        """Reserve the memory, then fetch the KV from the prefill half."""
        granted_s = await self.engine.wait_granted(ticket)
        bootstrap = call.bootstrap
        assert bootstrap.host is not None and bootstrap.port is not None and bootstrap.room is not None
        return await self.bootstrap.fetch_kv(bootstrap.host, bootstrap.port, bootstrap.room,
                                             self.context.clock.unix_of(granted_s), decode_prefix_len)

    # --- what decode keeps of a finished request ---------------------------------------------------------

    async def _keep(self, call: Call, prompt: Prompt, completion_tokens: int) -> None:
        """Offload the finished request's KV to storage, and/or keep it in decode's radix cache."""
        if call.messages is None or not (self.store is not None or self.keeps_finished):
            return
        config = self.context.config
        units, digest, through = await self.context.counter.continuation(prompt, synthetic_text(0, completion_tokens))
        if self.store is not None:
            start, end = decode_offload_range(prompt.prompt_tokens, completion_tokens, config.page_size,
                                              config.offload_stride_tokens)
            end = min(end, page_floor(through, config.page_size))
            if await asyncio.to_thread(self.store.put, prompt.conversation_key, units, digest, start, end):
                self.offloaded_tokens += end - start
        if self.keeps_finished:
            tokens = min(through, prompt.prompt_tokens + completion_tokens - 1)
            instance = self.engine.instance
            self.held[prompt.conversation_key] = (units, digest, tokens)
            self.held.move_to_end(prompt.conversation_key)
            instance.lent_tokens += tokens
            now = self.context.clock.now_s
            while instance.free_tokens(now) < 0 and self.held:
                self._evict(1)  # keep only what idle memory holds

    def _take_held(self, prompt: Prompt) -> int:
        """Tokens of the prompt decode's radix cache holds (they become the request's); 0 if none."""
        held = self.held.pop(prompt.conversation_key, None)
        if held is None:
            return 0
        units, digest, tokens = held
        self.engine.instance.lent_tokens -= tokens
        if units > prompt.length or prompt.digest_of(units) != digest:
            return 0
        return page_floor(min(tokens, prompt.prompt_tokens - 1), self.context.config.page_size)

    def _evict(self, tokens: int) -> None:
        """Give back at least `tokens` of kept KV, oldest first (decode's own requests win)."""
        instance, freed = self.engine.instance, 0
        while self.held and freed < tokens:
            _, (_, _, held_tokens) = self.held.popitem(last=False)
            instance.lent_tokens -= held_tokens
            freed += held_tokens

    async def _stream(self, call: Call, prompt: Prompt, ticket: DecodeTicket, answer: Answer) -> AsyncIterator[bytes]:
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
            finished = self._finished(ticket, answer, ticket.finished.result(), call.priority)
            await self._keep(call, prompt, answer.completion_tokens)
            yield writer.closing(finished)
        finally:
            self.engine.withdraw(ticket)

    def _finished(self, ticket: DecodeTicket, answer: Answer, finish_s: float, priority: int | None) -> Answer:
        """The answer with its latency, recorded in the metrics."""
        context = self.context
        e2e_s = context.latency_s(ticket.arrival_s, finish_s)
        context.metrics.finished(answer.prompt_tokens, answer.completion_tokens,
                                 context.latency_s(ticket.arrival_s, ticket.join_s), e2e_s, answer.cached_details,
                                 context.order.label(priority))
        return dataclasses.replace(answer, e2e_latency_s=e2e_s)

    def flush(self) -> bool:
        """Succeeds when idle, as SGLang's flush does, emptying the radix cache's kept KV (never storage)."""
        if not self.engine.is_idle:
            return False
        self._evict(self.engine.instance.lent_tokens)
        return True

    def close_session(self, session_id: str) -> None:
        """SGLang's /close_session: counted; this decode keeps no session references (see the module's rules)."""
        self.sessions_closed += 1

    def clear_storage(self) -> bool:
        """Empty the storage tier this decode offloads to; False without one."""
        if self.store is None:
            return False
        self.store.clear()
        return True

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
            effective_tokens={"input": 0, "device_hit": 0, "host_hit": 0, "storage_hit": 0},
            generation_tokens=engine.generated_tokens, backed_up_tokens=self.offloaded_tokens,
            session_cache={"tagged_requests": self.tagged_requests, "references_taken": 0, "late_finishes": 0,
                           "sessions_closed": self.sessions_closed, "references_dropped": 0, "open_sessions": 0}
            if self.context.config.enable_session_radix_cache else None)

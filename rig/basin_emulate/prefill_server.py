"""The prefill role's request path: SGLang PD's prefill half, or a prefill-only server.

The bootstrap rendezvous, the prefix cache, prefill batches and the KV transfer.

Rules:
- A request with a `bootstrap_room` is half of a PD request: it waits in the bootstrap queue until
  the decode half has reserved its memory (bootstrap.py), enters the prefill queue at that moment,
  is prefilled, and its outcome (with the cached tokens) is published on the room once its KV has
  reached decode. Without a room it is prefilled alone (prefill-only serving).
- The cache chain comes from the chain book (identity.py); the prefill engine serializes requests on
  one chain (prefill_engine.py).
- The answer is the usual JSON (or SSE) with the first token: SGLang's prefill server answers its
  half of the request after the transfer; the router reads it only to check it succeeded.
- With a storage tier (`--hicache-storage-backend file`, storage.py): before queueing, the prompt is
  looked up in storage past what the device and host hold; a hit of at least the prefetch threshold
  is prefetched (`basin_sim.storage.plan_prefetch`: waited for in model time per
  --hicache-storage-prefetch-policy, at the profile's storage_load_bytes_per_s) and is not computed.
  Once prefilled, the prompt's whole pages are backed up to storage (write-through). The answer
  reports cached tokens by source (`meta_info.cached_tokens_details`,
  `sglang:cached_tokens_total{cache_source}`), as SGLang does.
- A request's top-level `session_id` goes with it to the prefill engine (prefill_engine.py says what the
  session radix cache does with it); `/close_session` reaches the engine's `close_session`.
- Any failure (or the client leaving) is published on the room too, so the decode half fails at once
  instead of waiting for its timeout; what the request held is given back either way.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from basin_emulate.bootstrap import Room, Rooms
from basin_emulate.calls import Call
from basin_emulate.context import ServerContext, prompt_of
from basin_emulate.errors import ClientGoneError, EmulatorError
from basin_emulate.identity import ChainBook, Prompt
from basin_emulate.metrics import EngineState, session_counts
from basin_emulate.prefill_engine import PrefillEngine, PrefillOutcome
from basin_emulate.responses import Answer, StreamWriter, new_rid, response_body
from basin_emulate.storage import FileStore
from basin_runtime.disconnect import race_client
from basin_sim.storage import plan_prefetch, prompt_backup_end, storage_hit_tokens


class PrefillServer:
    """The prefill half of a PD deployment (or a prefill-only server)."""

    def __init__(self, context: ServerContext) -> None:
        config = context.config
        self.context = context
        self.engine = PrefillEngine(config.profile, context.clock, config.max_total_tokens, config.host_cache_tokens,
                                    session_cache=config.enable_session_radix_cache,
                                    takes_references=config.enable_session_radix_cache
                                    and config.session_radix_cache_mode == "true")
        self.book = ChainBook()
        self.rooms = Rooms(config.bootstrap_timeout_s, context.clock.base)
        self.store = None if config.storage_dir is None else FileStore(config.storage_dir, config.model_name)
        self.prefetched_tokens = 0  # sglang:prefetched_tokens_total
        self.backed_up_tokens = 0  # sglang:backuped_tokens_total

    async def start(self) -> None:
        """Open the bootstrap port."""
        await self.rooms.serve(self.context.config.host, self.context.config.bootstrap_port)

    async def close(self) -> None:
        """Close the bootstrap port."""
        await self.rooms.close()

    async def answer(self, call: Call, receive: Receive) -> Response:
        """Serve one request."""
        arrival_s = self.context.clock.catch_up()
        room = None if call.bootstrap.room is None else self.rooms.get(call.bootstrap.room)
        try:
            prompt = await prompt_of(self.context.counter, call)
            outcome = await race_client(self._prefill(call, prompt, room), receive, ClientGoneError)
        except (EmulatorError, ClientGoneError) as exc:
            if room is not None:  # kept until the decode half reads it, or the room expires
                reason = "its client disconnected" if isinstance(exc, ClientGoneError) else str(exc)
                self.rooms.publish(room, {"error": f"the prefill half of room {room.room_id} failed: {reason}"})
            raise
        context, config = self.context, self.context.config
        e2e_s = context.latency_s(arrival_s, outcome.transfer_done_s)
        answer = Answer(call.rid or new_rid(), config.model_name, prompt.prompt_tokens, 1,
                        min(outcome.cached_tokens, prompt.prompt_tokens), "length", e2e_s, config.enable_cache_report,
                        self.details(outcome))
        context.metrics.finished(prompt.prompt_tokens, 1, context.latency_s(arrival_s, outcome.prefill_done_s), e2e_s,
                                 answer.cached_details, context.order.label(call.priority))
        if call.is_stream:
            writer = StreamWriter(call, answer.rid, answer.model)
            body = writer.opening() + writer.tokens(0, 1, answer) + writer.closing(answer)
            return Response(body, media_type="text/event-stream")
        return JSONResponse(response_body(call, answer))

    async def _prefill(self, call: Call, prompt: Prompt, room: Room | None) -> PrefillOutcome:
        clock = self.context.clock
        arrival_s = clock.now_s
        if room is not None:
            arrival_s = clock.at_unix(await self.rooms.wait_ready(room))
        chain_key = self.book.chain_key(prompt)
        storage_end = await self._prefetch(prompt, chain_key)
        outcome = await self.engine.prefill(chain_key, prompt.group_key, prompt.group_tokens, prompt.cache_tokens,
                                            self.context.order.key(call.priority), clock.now_s if storage_end
                                            else arrival_s, storage_end,
                                            0 if room is None else room.decode_prefix_len, call.session_id)
        if self.store is not None:  # write-through: the prompt's whole pages reach storage
            end = prompt_backup_end(prompt.prompt_tokens, self.context.config.page_size)
            if await asyncio.to_thread(self.store.put, prompt.conversation_key, prompt.length,
                                       prompt.digest_of(prompt.length), 0, end):
                self.backed_up_tokens += end
        if room is not None:
            self.rooms.publish(room, {
                "room": room.room_id, "prompt_tokens": prompt.prompt_tokens,
                "cached_tokens": min(outcome.cached_tokens, prompt.prompt_tokens),
                "device_hit_tokens": outcome.device_hit_tokens, "host_hit_tokens": outcome.host_hit_tokens,
                "storage_hit_tokens": outcome.storage_hit_tokens, "computed_tokens": outcome.computed_tokens,
                "cached_tokens_details": self.details(outcome),
                "transfer_done_unix_s": clock.unix_of(outcome.transfer_done_s)})
        return outcome

    async def _prefetch(self, prompt: Prompt, chain_key: str) -> int:
        """Look the prompt up in storage past the device and host hit and wait for its prefetch; the prompt position
        it reached (0: nothing from storage)."""
        if self.store is None:
            return 0
        config, clock = self.context.config, self.context.clock
        cached = self.engine.cached_tokens(chain_key, prompt.group_key)
        stored_end = await asyncio.to_thread(self.store.stored_end, prompt)
        tokens = storage_hit_tokens(stored_end, cached, prompt.cache_tokens, config.page_size)
        if tokens <= 0:
            return 0
        prefetch = plan_prefetch(config.prefetch_policy, config.profile.storage_fetch_s(tokens), tokens)
        if prefetch.wait_s > 0:
            done = asyncio.Event()
            clock.call_at(clock.now_s + prefetch.wait_s, done.set)
            await done.wait()
        self.prefetched_tokens += prefetch.arrived_tokens
        return cached + prefetch.arrived_tokens

    def details(self, outcome: PrefillOutcome) -> dict[str, int | str]:
        """SGLang's cached_tokens_details: device and host, with storage when a storage backend is on."""
        details: dict[str, int | str] = {"device": outcome.device_hit_tokens, "host": outcome.host_hit_tokens}
        if self.store is not None or outcome.storage_hit_tokens:
            details["storage"] = outcome.storage_hit_tokens
        if self.store is not None:
            details["storage_backend"] = "HiCacheFile"
        return details

    def close_session(self, session_id: str) -> None:
        """SGLang's /close_session: the tag's references dropped (a no-op without the session cache)."""
        self.engine.close_session(session_id)

    def clear_storage(self) -> bool:
        """Empty the storage tier (SGLang's /hicache/storage-backend/clear); False without one."""
        if self.store is None:
            return False
        self.store.clear()
        return True

    def flush(self) -> bool:
        """Empty the prefix cache if idle."""
        if not self.engine.flush():
            return False
        self.book.clear()
        return True

    def state(self) -> EngineState:
        """Load, memory and cache counters now."""
        engine, cache, totals = self.engine, self.engine.cache, self.engine.totals
        return EngineState(
            num_running_reqs=engine.num_running, num_queue_reqs=engine.num_waiting,
            num_used_tokens=cache.pinned_tokens, max_total_num_tokens=cache.capacity_tokens,
            kv_available_tokens=cache.capacity_tokens - cache.device_used_tokens,
            kv_evictable_tokens=cache.evictable_tokens, cache_hit_rate=totals.last_batch_hit_rate,
            pd_queues={"num_prefill_bootstrap_queue_reqs": self.rooms.num_waiting_ready,
                       "num_prefill_inflight_queue_reqs": engine.num_transferring},
            effective_tokens={"input": totals.computed_tokens, "device_hit": totals.device_hit_tokens,
                              "host_hit": totals.host_hit_tokens, "storage_hit": totals.storage_hit_tokens},
            generation_tokens=0, prefetched_tokens=self.prefetched_tokens, backed_up_tokens=self.backed_up_tokens,
            session_cache=None if engine.session_refs is None else session_counts(engine.session_refs))


"""A request's way through the PD deployment: routed, pre-allocated on decode, prefilled, moved, decoded, answered.

Rules:
- A call is routed at once (router.py: smg's cache_aware, one router for the prefill pool and one for
  the decode pool; each counts the request in flight from routing until its answer ends or it is
  withdrawn, and forgets a session's entries when it ends). A call larger than the prefill cache or
  than an empty decode instance is refused (SGLang rejects it): its session is aborted.
- The request waits for its decode pre-allocation (decode.py: SGLang's admission rule, re-evaluated
  whenever decode memory or the running batch changes), then (after its storage prefetch, if the KV
  tier prefetches) for prefill; it is prefilled (cache hit free, the rest computed), its KV moves to
  decode at the profile's bandwidth (the prefill cache keeps it pinned until then), and it decodes
  `completion_tokens` steps; decode may retract it when its memory runs out and resume it later,
  which this path does not see beyond the timing.
- What the KV tier (kv_tiers.py) and the pins between calls (pins.py) do is theirs: this path calls
  their hooks at the points named there.
- The hit-rate window is fed with each answer's prompt and cached (device + host + storage) tokens,
  as the gateway reads them from the usage; the latency window with each call's time to first token
  from its first send (retries count).
- Session radix cache (`Deployment.session_radix_cache`, radix_cache.py): under "faithful" no reference
  is taken: SGLang's PD prefill runs `cache_finished_req` before it sets `finished_reason`, so
  `register_session_ref` never runs there (field-sources.md section 2) and the key is inert on the
  prefill tree, the only radix cache this model keeps (decode's is off in SGLang PD by default).
  Assumption (true, hypothetical under PD): the prefill side's normal finish is its KV reaching decode
  (where SGLang's prefill calls `cache_finished_req`), and it takes the session's reference, as if
  SGLang set the finish reason first; a withdrawal is an abort and takes none. Either way an ended
  session (finished, killed, aborted or abandoned; a session shed at the door never reached a cache)
  is closed on every prefill instance at its end (`forget_session`): the gateway POSTs
  `/close_session` to each engine, since smg has no such route.
- Withdrawing a request (a kill, a client timeout, a client giving up) takes it out wherever it is, as
  SGLang aborts a request whose client went away: it gives back its decode pre-allocation (queued or
  held), its prefill job and its cache pin at once, except a job inside a running prefill batch,
  which the batch finishes (its compute is spent) and then drops. Whatever was prefilled stays in the
  radix cache as unpinned, evictable KV; this model appends a call's whole prompt when its hit is
  decided, so a job withdrawn mid-way through a chunked prefill leaves its not-yet-computed chunks
  counted as cached too. The caller hands the freed memory out again (`resume`) once every
  withdrawal of the moment is done.
Invariant: every request in flight is in `requests` under its id.
"""

from __future__ import annotations

from collections.abc import Callable

from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.session_table import Call
from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.events import EventLoop
from basin_sim.kv_tiers import make_kv_tier
from basin_sim.lifecycle import Request, SessionRun, SessionSpec, Stage
from basin_sim.pins import pins_for
from basin_sim.policies.base import SessionPolicy
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.profile import Deployment
from basin_sim.radix_cache import RadixCache
from basin_sim.router import CacheAwareRouter
from basin_sim.timeline import Timeline

RunHook = Callable[[SessionRun], None]
RequestHook = Callable[[Request], None]


class RequestFlow:
    """The deployment's instances and routers, and every request in flight through them."""

    def __init__(self, deployment: Deployment, policy: SessionPolicy, loop: EventLoop, timeline: Timeline,
                 hit_window: HitRateWindow, *, step_slo_s: float, router_seed: int) -> None:
        self.deployment = deployment
        self.profile = profile = deployment.profile
        self.policy = policy
        self.timeline = timeline
        self.hit_window = hit_window
        self.latency_window = LatencyWindow()
        self.prefill = [PrefillInstance(i, profile, RadixCache(deployment.prefill_cache_tokens,
                                                               deployment.host_cache_tokens,
                                                               session_refs=deployment.takes_session_refs))
                        for i in range(deployment.num_prefill)]
        self.decode = [DecodeInstance(i, profile, deployment.decode_kv_tokens, step_slo_s,
                                      reserved_decode_tokens=deployment.decode_reserved_tokens,
                                      clip_max_new_tokens=deployment.decode_clip_max_new_tokens,
                                      retraction_policy=deployment.retraction_policy)
                       for i in range(deployment.num_decode)]
        self.prefill_router = CacheAwareRouter(deployment.num_prefill, seed=router_seed)
        self.decode_router = CacheAwareRouter(deployment.num_decode, seed=router_seed + 1)
        self.holds = pins_for(policy.pins)
        self.kv_tier = make_kv_tier(deployment, self.prefill, self.decode, self.schedule_decode)
        self.requests: dict[int, Request] = {}
        self._next_request_id = 0
        self._loop = loop
        self._prefill_done = loop.kind(self._on_prefill_done)
        self._transfer_done = loop.kind(self._on_transfer_done)
        self._decode_next = loop.kind(self._on_decode_next)
        self._prefetch_done = loop.kind(self._on_prefetch_done)
        self.on_sent: RequestHook = _unbound  # the clients start the attempt's timeout
        self.on_answered: RunHook = _unbound  # the clients send the next call after the tool time, or finish
        self.on_refused: RunHook = _unbound  # the session is aborted

    # --- a call in -------------------------------------------------------------------------------

    def send(self, run: SessionRun, call: Call) -> None:
        """Send a call of a live session as a new request: route it and queue it for decode memory."""
        slot = DecodeSlot(0.0, call.prompt_tokens, call.completion_tokens)  # agents set no max_tokens
        if call.prompt_tokens > self.deployment.prefill_cache_tokens or not self.decode[0].can_ever_fit(slot):
            self.on_refused(run)  # SGLang rejects a request larger than an instance's memory
            return
        spec, now = run.spec, self._loop.now
        priority = self.policy.priority(spec.session_id, now)
        rid = self._next_request_id
        self._next_request_id += 1
        prefill, decode = self._route(spec, call.prompt_tokens)
        job = PrefillJob(priority, rid, spec.session_id, spec.group_key, spec.group_tokens, call.prompt_tokens)
        slot.priority, slot.request_id = priority, rid
        request = run.request = self.requests[rid] = Request(rid, run, now, prefill, decode, job, slot,
                                                             attempt=run.attempt)
        self.on_sent(request)
        decode.enqueue(request.slot)
        self.grant(decode)

    def _route(self, spec: SessionSpec, prompt_tokens: int) -> tuple[PrefillInstance, DecodeInstance]:
        """smg's choice of (prefill, decode) for a call; both count it in flight from now."""
        keys = (spec.session_id, spec.group_key, spec.group_tokens, prompt_tokens)
        prefill = self.prefill[self.prefill_router.route(*keys).worker]
        return prefill, self.decode[self.decode_router.route(*keys).worker]

    def _finish_route(self, request: Request) -> None:
        """The request's response ended (answered or withdrawn): it leaves both routers' in-flight counts."""
        self.prefill_router.finish(request.prefill.index)
        self.decode_router.finish(request.decode.index)

    # --- decode memory, then prefill ----------------------------------------------------------------

    def grant(self, decode: DecodeInstance) -> None:
        """Hand out decode memory (decode.py `grant`): each request granted goes on to prefill."""
        version = decode.version
        decode.grant(self._loop.now, self._granted)
        if decode.version != version:  # resumed requests rejoined the batch, or memory moved
            self.schedule_decode(decode)

    def _granted(self, slot: DecodeSlot) -> None:
        request = self.requests[slot.request_id]
        request.stage = Stage.PREFILL_WAIT
        now = self._loop.now
        wait_s = self.kv_tier.prefetch_wait_s(request, now)
        if wait_s > 0:
            self._loop.at(now + wait_s, self._prefetch_done, request)
            return
        request.prefill.enqueue(request.job)
        self.kick(request.prefill)

    def _on_prefetch_done(self, request: Request) -> None:
        if request.is_aborted:  # withdrawn while its prefetch ran: it held nothing on prefill
            return
        self.kv_tier.prefetch_done(request)
        request.prefill.enqueue(request.job)
        self.kick(request.prefill)

    def kick(self, prefill: PrefillInstance) -> None:
        """Start the instance's next batch if it is idle and has work."""
        now = self._loop.now
        self.holds.expire(prefill, now)
        batch = prefill.start_batch(now)
        if batch is None:
            return
        for job in batch.started:
            self.requests[job.request_id].stage = Stage.PREFILLING
            self.timeline.record_prefill(now, job.prompt_tokens, job.device_hit_tokens,
                                         job.host_hit_tokens + job.storage_hit_tokens)
            self.holds.scheduled(job, now)
        self._loop.at(batch.ends_s, self._prefill_done, prefill)

    def _on_prefill_done(self, prefill: PrefillInstance) -> None:
        done = prefill.finish_batch()
        dropped = [self.requests[job.request_id] for job in done if job.is_cancelled]
        for request in dropped:  # every withdrawn job lets go before anything is admitted (a retry may be queued)
            self._drop(request)
        now = self._loop.now
        for job in done:
            if not job.is_cancelled:
                request = self.requests[job.request_id]
                request.stage = Stage.TRANSFER
                self.kv_tier.prefilled(job)
                self._loop.at(now + self.profile.transfer_s(job.prompt_tokens), self._transfer_done, request)
        for request in dropped:
            self.grant(request.decode)
        self.kick(prefill)

    # --- decode ------------------------------------------------------------------------------------

    def _on_transfer_done(self, request: Request) -> None:
        if request.is_aborted:  # withdrawn during the transfer: it gave everything back then
            return
        now = self._loop.now
        request.prefill.cache.release(request.run.spec.session_id, now, self.holds.hold_until_s, finished=True)
        self.kick(request.prefill)
        run = request.run
        sent_s = request.sent_s if run.call_sent_s is None else run.call_sent_s
        self.timeline.record_ttft(now, now - sent_s)  # from the call's first send (retries count)
        self.latency_window.record(now, now - sent_s)
        if run.next_call == 0 and run.first_token_s is None:
            run.first_token_s = now
        request.stage = Stage.DECODING
        request.decode.join(request.slot, now)
        self.grant(request.decode)  # a longer running batch changes SGLang's admission terms
        self.schedule_decode(request.decode)

    def schedule_decode(self, decode: DecodeInstance) -> None:
        """Plan the instance's next event (a completion, or memory running out); older plans go void."""
        when = decode.next_event_s()
        if when is not None:
            self._loop.at(when, self._decode_next, (decode, decode.version))

    def _on_decode_next(self, payload: tuple[DecodeInstance, int]) -> None:
        decode, version = payload
        if version != decode.version:
            return
        decode.pop_finished(self._loop.now, self._answer)
        self.grant(decode)
        self.schedule_decode(decode)

    def _answer(self, slot: DecodeSlot) -> None:
        request = self.requests.pop(slot.request_id)
        self._finish_route(request)
        job, now = request.job, self._loop.now
        self.hit_window.record(now, job.prompt_tokens,
                               job.device_hit_tokens + job.host_hit_tokens + job.storage_hit_tokens)
        self.kv_tier.answered(job, slot)
        run = request.run
        run.request, run.attempt = None, 0
        session_id = run.spec.session_id
        ttl_s = self.holds.ttl_after_answer_s(session_id, now, job.prompt_tokens + slot.completion_tokens)
        if run.next_call + 1 < run.spec.session.n_calls:  # KV kept for the next call
            if self.holds.after_answer(request.prefill, session_id, ttl_s, now):
                self.kick(request.prefill)
            self.kv_tier.keep(request, slot, now)
        run.steps += slot.steps
        run.good_steps += slot.good_steps
        run.next_call += 1
        self.on_answered(run)

    # --- withdrawal --------------------------------------------------------------------------------

    def withdraw(self, request: Request) -> None:
        """Abort a request (see the rules); a job in a running prefill batch gives its part back when it ends."""
        stage = request.stage
        request.is_aborted = True
        if stage == Stage.PREFILLING:
            request.prefill.cancel(request.job)  # dropped when its batch ends
        else:
            if stage == Stage.PREFILL_WAIT:
                if self.kv_tier.cancel_prefetch(request):  # not queued on prefill yet
                    request.job.is_cancelled = True
                else:
                    request.prefill.cancel(request.job)
            elif stage == Stage.TRANSFER:  # both ends of the transfer let go now
                self._release_chain(request)
            elif stage == Stage.DECODING:
                self.holds.withdrawn(request.prefill, request.run.spec.session_id)
            request.decode.withdraw(request.slot, self._loop.now)
            del self.requests[request.request_id]
        self._finish_route(request)  # the client went away: smg stops counting it now, not when it is dropped
        request.run.request = None

    def resume(self, request: Request) -> None:
        """Hand out again what a withdrawn request gave back (decode memory, a decode epoch, prefill room)."""
        self.grant(request.decode)
        self.schedule_decode(request.decode)
        self.kick(request.prefill)

    def resume_all(self) -> None:
        """Hand out again everything given back at this moment, on every instance."""
        for decode in self.decode:
            self.grant(decode)
            self.schedule_decode(decode)
        for prefill in self.prefill:
            self.kick(prefill)

    def forget_session(self, session_id: str) -> None:
        """An ended session: its hold, its kept KV and its routing entries go; with the session radix cache, the
        gateway closes it on every prefill instance (smg routes no `/close_session`)."""
        for prefill in self.prefill:
            if self.deployment.session_radix_cache is not False:
                prefill.cache.close_session(session_id)
            if self.holds.forget(prefill, session_id):
                self.kick(prefill)  # what the hold pinned may now go to a request waiting for room
        self.kv_tier.forget(session_id)
        self.prefill_router.forget(session_id)
        self.decode_router.forget(session_id)

    def close_engine_session(self, session_id: str) -> None:
        """A live session held at its tool boundary: with the session radix cache, the gateway closes it on every
        prefill instance, so its KV is unreferenced (evictable first) while it waits. Its next call reopens it
        (SGLang's `open_radix_session` drops the tombstone), so no tombstone is kept here."""
        if self.deployment.session_radix_cache is False:
            return
        for prefill in self.prefill:
            prefill.cache.drop_reference(session_id)

    def expire_holds(self) -> None:
        """Unpin expired holds everywhere (a tick); an instance that freed room may start a batch."""
        for prefill in self.prefill:
            if self.holds.expire(prefill, self._loop.now):
                self.kick(prefill)

    def ttft_s(self) -> float | None:
        """The windowed median time to first token, counting how long each request short of it has waited."""
        now = self._loop.now
        waiting = [now - (r.sent_s if r.run.call_sent_s is None else r.run.call_sent_s)
                   for r in self.requests.values() if r.stage is not Stage.DECODING]
        return self.latency_window.median_s(now, waiting)

    def _drop(self, request: Request) -> None:
        """Release a withdrawn request whose prefill batch ended (the caller grants and kicks after)."""
        self._release_chain(request)
        request.decode.free(request.slot)
        del self.requests[request.request_id]

    def _release_chain(self, request: Request) -> None:
        """Unpin a withdrawn request's chain."""
        request.prefill.cache.release(request.run.spec.session_id, self._loop.now)


def _unbound(_: object) -> None:
    raise AssertionError("a RequestFlow hook was not bound by its engine")

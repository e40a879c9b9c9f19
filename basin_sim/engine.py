# The discrete-event model of a PD-disaggregated SGLang deployment with a session policy in front.
#
# Rules:
# - Time advances from event to event (a heap of (time, seq, kind, payload); seq makes ties
#   deterministic). There is no fixed tick for the work itself: prefill batches, KV transfers and
#   decode completions are events; decode steps are aggregated (see decode.py). A policy tick (and a
#   timeline sample) comes every `tick_s` when ticks are on.
# - A session's call is sent at its arrival (first call) or after the previous answer plus the tool
#   gap. The request is routed at once (router.py: smg's cache_aware, one router for the prefill pool
#   and one for the decode pool; each counts the request in flight from routing until its answer ends
#   or it is cancelled, and forgets a session's entries when it ends), waits for its decode
#   pre-allocation (decode.py: SGLang's admission rule, re-evaluated whenever decode memory or the
#   running batch changes; a request that cannot fit an empty instance aborts its session), then for
#   prefill, is prefilled (cache hit free, the rest computed), its KV moves to decode at the
#   profile's bandwidth (the prefill cache keeps it pinned until then), and it decodes
#   `completion_tokens` steps; decode may retract it when its memory runs out and resume it
#   later (decode.py), which the engine does not see beyond the timing.
# - The policy sees every arrival, call, end and tick (policies/base.py); a held session waits at the
#   door and its waiting counts in its end-to-end time. The tick's hit rate is the gateway's own
#   signal: `basin_runtime.policy.hit_rate.HitRateWindow` fed with each call's prompt and cached
#   (device + host hit) tokens when its answer ends, as the gateway reads them from the usage. Its
#   first-token latency is `basin_runtime.policy.latency.LatencyWindow`: each call's time to first
#   token from its first send, and how long each request not yet decoding has waited.
# - Suspension (a policy's `suspend` decision): the session stays live; the call it sends next (or
#   the one being sent when the decision comes) is parked at the door, told to the policy, but not
#   sent, until the policy resumes the session; the call then goes as sent at its parking (TTFT
#   counts the wait). A resume before the next call only lifts the suspension. Client timers do not
#   run for a parked call (it is the gateway's hold, like the door's); the session time limit does.
# - Working set = sum of the latest prompt of every live session (tool-running and parked included).
# - Aborting a request (a kill, a client timeout, a client giving up) withdraws it wherever it is, as
#   SGLang aborts a request whose client went away: it gives back its decode pre-allocation (queued or
#   held), its prefill job and its cache pin at once, except a job inside a running prefill batch,
#   which the batch finishes (its compute is spent) and then drops. Whatever was prefilled stays in the
#   radix cache as unpinned, evictable KV (SGLang caches an aborted request's computed prefix); this
#   model appends a call's whole prompt when its hit is decided, so a job aborted mid-way through a
#   chunked prefill leaves its not-yet-computed chunks counted as cached too (at most the chunks left).
#   An aborted request is never held between calls (Continuum pins only a call that was answered).
# - A kill ends sessions at once, their requests aborted.
# - Clients (`clients`, clients.py; None: nobody gives up): an attempt not answered `call_timeout_s`
#   after it was sent is timed out and aborted; after the client's or the harness's wait the same call
#   is sent again as a new request (new id, routed again, the policy told of the call again: a gateway
#   sees every attempt); when the call's attempts are used up, or `session_time_limit_s` after the
#   session's arrival, the session ends ABANDONED (the policy told once, as of any end). A held
#   session's clock for call timeouts starts when it is admitted (the door's wait is the policy's;
#   the session time limit covers it). Waits between attempts count in the end-to-end time.
# - `on_session_over(run)` (if set) is called once a session is over in any way (finished, shed,
#   killed, aborted, abandoned), after the policy heard of it: a closed population starts its next one.
# - Per timeline bin: arrivals, completions, timeouts, retries and abandonments are counted, and the
#   state at the bin's end is recorded before the first event at or after it is handled.
# - Pins between calls (`policy.pins`, a `PinRule`: Continuum): the prefill cache keeps a session's
#   chain held from its KV transfer until the call's answer, and then for the TTL the rule gives that
#   answer (`ttl_after_answer_s`, asked at every answer, the last one included; 0: unpinned at once);
#   the next call takes the hold over; expired holds are unpinned whenever the instance forms a batch
#   and on every tick; an ended session's hold is dropped and its prefill instance may start a batch at
#   once. The rule is told when each call is scheduled (`on_scheduled`: its prefill starts).
# - Lending (deployment.lending == 'decode-memory', a deployment switch whatever the policy): after
#   each answer but the last, the decode instance keeps prompt + completion tokens of KV in idle
#   memory if they fit there, under the ledger's cap (50% of its memory, oldest dropped first); lent
#   memory is reclaimed (oldest first) before any queued reservation waits. When the next call's hit
#   is decided, a lent copy longer than prefill's cached prefix is written back (prefill.py) and
#   leaves decode. An ended session's copy is forgotten.
# - Lending 'storage-offload' (stock SGLang: decode --disaggregation-decode-enable-offload-kvcache, prefill
#   --enable-hierarchical-cache with a --hicache-storage-backend; basin_sim/storage.py): a computed
#   prompt's whole pages are backed up to the storage tier shared by all instances, and every answer's
#   pages (prompt tail + output, whole strides) are offloaded to it by decode; decode frees its KV as
#   stock SGLang does. A request whose prompt storage holds past its device + host hit prefetches that
#   part to the host before it is queued on prefill (prefetch policy `timeout`, SGLang's default:
#   storage_fetch_s, at most 1 s + 0.25 s per 1,024 tokens); when its hit is decided, what the prefetch
#   brought past the (then) device + host hit is loaded with the batch and not computed, and counts as
#   cached tokens (SGLang reports storage hits in cached_tokens).
# Invariants (`check`): every in-flight request is in `_requests` under its id, and is its session's
# request unless aborted (then it waits for its prefill batch to end); num_live, num_live_burst and
# num_held count the sessions in those states, num_parked the live ones parked (each suspended, with
# no request); working_set_tokens == sum of live sessions'
# context_tokens; each decode instance's reserved and queued tokens are those of its requests; an
# ended session holds no request, cache hold or lent KV.
"""`Engine`: sessions in, an event-driven PD deployment with prefix caches, outcomes out."""

from __future__ import annotations

import collections
import functools
import heapq
import math
import random
from collections.abc import Callable, Iterable

from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.policy.lending import LEND_CAP_FRACTION, LendingLedger
from basin_sim.clients import ClientPolicy, wait_before_attempt_s
from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.goodput import STEP_SLO_S
from basin_sim.lifecycle import Request, SessionRun, SessionSpec, Stage, Status
from basin_sim.policies.base import Decisions, SessionPolicy
from basin_sim.prefill import PrefillInstance, PrefillJob
from basin_sim.profile import Deployment
from basin_sim.radix_cache import RadixCache
from basin_sim.router import CacheAwareRouter
from basin_sim.storage import StorageTier, prefetch_wait_s
from basin_sim.timeline import BinState, Sample, Timeline

(_ARRIVE, _CALL, _PREFILL_DONE, _TRANSFER_DONE, _DECODE_NEXT, _TICK, _KILL, _PREFETCH_DONE,
 _TIMEOUT, _RETRY, _GIVE_UP) = range(11)
SessionOverHook = Callable[[SessionRun], None]


class EngineError(RuntimeError):
    """A policy decision or an event the engine cannot honour."""


class Engine:
    """A PD deployment under a session policy; feed it with `add`, drive it with `run_until`."""

    def __init__(self, deployment: Deployment, policy: SessionPolicy, *, timeline: Timeline | None = None,
                 tick_s: float | None = 10.0, step_slo_s: float = STEP_SLO_S,
                 hit_window: HitRateWindow | None = None, router_seed: int = 0,
                 clients: ClientPolicy | None = None, client_seed: int = 0,
                 on_session_over: SessionOverHook | None = None) -> None:
        self.deployment = deployment
        self.clients = clients
        self.on_session_over = on_session_over
        self._client_rng = random.Random(client_seed)  # the backoff jitter's draws
        self.profile = deployment.profile
        self.policy = policy
        self.timeline = timeline if timeline is not None else Timeline()
        self._next_bin_end_s = (len(self.timeline.bin_states) + 1) * self.timeline.bin_s
        self.hit_window = hit_window if hit_window is not None else HitRateWindow()
        self.latency_window = LatencyWindow()
        self.prefill = [PrefillInstance(i, self.profile, RadixCache(deployment.prefill_cache_tokens,
                                                                    deployment.host_cache_tokens))
                        for i in range(deployment.num_prefill)]
        self.decode = [DecodeInstance(i, self.profile, deployment.decode_kv_tokens, step_slo_s,
                                      reserved_decode_tokens=deployment.decode_reserved_tokens,
                                      clip_max_new_tokens=deployment.decode_clip_max_new_tokens,
                                      retraction_policy=deployment.retraction_policy)
                       for i in range(deployment.num_decode)]
        self.prefill_router = CacheAwareRouter(deployment.num_prefill, seed=router_seed)
        self.decode_router = CacheAwareRouter(deployment.num_decode, seed=router_seed + 1)
        self.pins = policy.pins
        self.ledger: LendingLedger | None = None
        if deployment.lending == "decode-memory":
            self.ledger = LendingLedger(LEND_CAP_FRACTION)
            for decode in self.decode:
                self.ledger.add_instance(str(decode.index), decode.capacity_tokens)
                decode.reclaim = functools.partial(self._reclaim_for_step, decode)
            for prefill in self.prefill:
                prefill.write_back = self._write_back
        self.storage: StorageTier | None = None
        if deployment.lending == "storage-offload":
            self.storage = StorageTier()
            for prefill in self.prefill:
                prefill.storage_hit = self._storage_hit
        self._prefetched_end: dict[int, int] = {}  # request id -> prompt position its storage prefetch reached
        self._prefetching: set[int] = set()  # request ids whose prefetch runs (not yet queued on prefill)
        self.now = 0.0
        self.runs: dict[str, SessionRun] = {}
        self.num_live = 0
        self.num_held = 0
        self.num_parked = 0
        self.suspensions = 0  # suspend decisions applied
        self._suspended: set[str] = set()  # live sessions whose next call is parked until resumed
        self.num_live_burst = 0
        self.working_set_tokens = 0
        self._tick_s = tick_s
        self._events: list[tuple[float, int, int, object]] = []
        # Client timers of one fixed delay each (call timeout, session time limit) are due in the order
        # they were set, so each waits in a FIFO queue instead of the heap (most are void by then, and
        # at scale they would be most of the heap): same (time, seq) order, O(1) per timer.
        self._timeouts: collections.deque[tuple[float, int, int, object]] = collections.deque()
        self._give_ups: collections.deque[tuple[float, int, int, object]] = collections.deque()
        self._seq = 0
        self._requests: dict[int, Request] = {}
        self._next_request_id = 0
        self._handlers: list[Callable[[object], None]] = [
            self._on_arrive, self._on_call, self._on_prefill_done, self._on_transfer_done,  # type: ignore[list-item]
            self._on_decode_next, self._on_tick, self._on_kill, self._on_prefetch_done,  # type: ignore[list-item]
            self._on_timeout, self._on_retry, self._on_give_up,  # type: ignore[list-item]
        ]
        if tick_s is not None:
            self._at(tick_s, _TICK, None)

    # --- driving -----------------------------------------------------------------------------------

    def add(self, spec: SessionSpec) -> None:
        """Schedule a session's arrival."""
        if spec.session_id in self.runs:
            raise EngineError(f"session {spec.session_id!r} added twice")
        if spec.arrival_s < self.now:
            raise EngineError(f"session {spec.session_id!r} arrives at {spec.arrival_s} < now {self.now}")
        run = self.runs[spec.session_id] = SessionRun(spec)
        self._at(spec.arrival_s, _ARRIVE, run)

    def kill_at(self, at_s: float, session_ids: Iterable[str]) -> None:
        """End these sessions at `at_s` (those still live or held then)."""
        self._at(at_s, _KILL, tuple(session_ids))

    def run_until(self, until_s: float) -> None:
        """Process every event up to `until_s` (math.inf: until nothing is left to do)."""
        events, timeouts, give_ups = self._events, self._timeouts, self._give_ups
        while True:  # the earliest (time, seq) of the heap and the two timer queues
            entry = events[0] if events else None
            queue = None
            if timeouts and (entry is None or timeouts[0] < entry):
                entry, queue = timeouts[0], timeouts
            if give_ups and (entry is None or give_ups[0] < entry):
                entry, queue = give_ups[0], give_ups
            if entry is None or entry[0] > until_s:
                break
            if queue is None:
                heapq.heappop(events)
            else:
                queue.popleft()
            time_s, _, kind, payload = entry
            if kind >= _TIMEOUT and self._is_void(kind, payload):  # a client's timer that no longer applies
                continue
            if time_s >= self._next_bin_end_s:
                self._record_bin_ends(time_s)
            self.now = time_s
            self._handlers[kind](payload)
        if math.isfinite(until_s):
            self._record_bin_ends(until_s)
            self.now = max(self.now, until_s)

    def _record_bin_ends(self, upto_s: float) -> None:
        """Record the state at every timeline bin end <= upto_s not recorded yet (no event in between)."""
        timeline = self.timeline
        while self._next_bin_end_s <= upto_s:
            requests = self._requests.values()
            timeline.record_bin_state(BinState(
                end_s=self._next_bin_end_s, live_sessions=self.num_live, live_burst_sessions=self.num_live_burst,
                held_sessions=self.num_held, working_set_tokens=self.working_set_tokens,
                prefill_queued=sum(r.stage == Stage.PREFILL_WAIT for r in requests),
                prealloc_queued=sum(r.stage == Stage.PREALLOC for r in requests)))
            self._next_bin_end_s = (len(timeline.bin_states) + 1) * timeline.bin_s

    def check(self) -> None:
        """Assert the invariants at the top of this module (tests call it between steps)."""
        live = [run for run in self.runs.values() if run.status == Status.LIVE]
        assert self.num_live == len(live) and self.num_live_burst == sum(run.spec.is_burst for run in live)
        assert self.num_held == sum(run.status == Status.HELD for run in self.runs.values())
        parked = [run for run in live if run.parked]
        assert self.num_parked == len(parked) and all(run.request is None for run in parked)
        assert all(run.spec.session_id in self._suspended for run in parked)
        assert all(self.runs[sid].status == Status.LIVE for sid in self._suspended)
        assert self.working_set_tokens == sum(run.context_tokens for run in live)
        allocated, queued = [0] * len(self.decode), [0] * len(self.decode)
        for rid, request in self._requests.items():
            assert rid == request.request_id
            if request.is_aborted:
                assert request.stage == Stage.PREFILLING and request.job.is_cancelled, f"aborted request {rid}"
            else:
                assert request.run.request is request and request.run.status == Status.LIVE, f"request {rid}"
            if request.stage == Stage.PREALLOC:
                queued[request.decode.index] += request.slot.prompt_tokens
            elif request.stage != Stage.DECODING:
                assert request.slot.is_allocated, f"request {rid} at {request.stage} holds no pre-allocation"
                allocated[request.decode.index] += request.slot.prompt_tokens
        for decode in self.decode:
            decode.check()
            assert (decode.allocated_waiting_tokens, decode.queued_tokens) == (allocated[decode.index],
                                                                               queued[decode.index])
        for prefill in self.prefill:
            prefill.cache.check()
        for run in self.runs.values():
            if run.is_over:
                session_id = run.spec.session_id
                assert run.request is None, f"ended session {session_id!r} holds a request"
                assert not any(p.cache.is_held(session_id) for p in self.prefill), f"{session_id!r} holds a pin"
                assert self.ledger is None or self.ledger.holder_of(session_id) is None, f"{session_id!r} lends KV"

    def sample(self) -> Sample:
        """The state now, as the timeline records it."""
        caches = [p.cache for p in self.prefill]
        return Sample(
            time_s=self.now, live_sessions=self.num_live, held_sessions=self.num_held,
            working_set_tokens=self.working_set_tokens,
            cache_device_tokens=sum(c.device_used_tokens for c in caches),
            cache_host_tokens=sum(c.host_used_tokens for c in caches),
            cache_pinned_tokens=sum(c.pinned_tokens for c in caches),
            cache_held_tokens=sum(c.held_tokens for c in caches) if self.pins is not None else 0,
            prefill_waiting=sum(p.num_waiting for p in self.prefill),
            decode_queued=sum(d.num_queued for d in self.decode),
            decode_running=sum(d.batch_size for d in self.decode),
            decode_reserved_tokens=round(sum(d.used_tokens(self.now) for d in self.decode)),
        )

    # --- sessions ----------------------------------------------------------------------------------

    def _at(self, time_s: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_s, self._seq, kind, payload))

    def _on_arrive(self, run: SessionRun) -> None:
        run.status = Status.HELD
        self.num_held += 1
        self.timeline.record_arrival(self.now)
        if self.clients is not None and self.clients.session_time_limit_s is not None:
            self._seq += 1
            self._give_ups.append((self.now + self.clients.session_time_limit_s, self._seq, _GIVE_UP, run))
        self._apply(self.policy.on_arrival(run.spec.session_id, self.now, run.spec.session))

    def _start(self, run: SessionRun) -> None:
        run.status, run.admitted_s = Status.LIVE, self.now
        self.num_held -= 1
        self.num_live += 1
        self.num_live_burst += run.spec.is_burst
        self._on_call(run)

    def _end(self, run: SessionRun, status: Status) -> None:
        if run.parked:
            run.parked = False
            self.num_parked -= 1
        self._suspended.discard(run.spec.session_id)
        if run.status == Status.LIVE:
            self.num_live -= 1
            self.num_live_burst -= run.spec.is_burst
            self.working_set_tokens -= run.context_tokens
        elif run.status == Status.HELD:
            self.num_held -= 1
        run.status, run.ended_s = status, self.now
        self._forget_kv(run.spec.session_id)
        self.prefill_router.forget(run.spec.session_id)
        self.decode_router.forget(run.spec.session_id)
        self._apply(self.policy.on_session_end(run.spec.session_id, self.now))
        self._over(run)

    def _over(self, run: SessionRun) -> None:
        """A session is over (its status final): count it and tell the hook."""
        if run.status == Status.FINISHED:
            self.timeline.record_completion(self.now)
        elif run.status == Status.ABANDONED:
            self.timeline.record_abandoned(self.now)
        if self.on_session_over is not None:
            self.on_session_over(run)

    def _apply(self, decisions: Decisions) -> None:
        for session_id in decisions.shed:
            run = self._held(session_id, "shed")
            self.num_held -= 1
            run.status, run.ended_s = Status.SHED, self.now
            self._over(run)
        for session_id in decisions.admit:
            self._start(self._held(session_id, "admit"))
        for session_id in decisions.suspend:
            live = self.runs.get(session_id)
            if live is None or live.status != Status.LIVE or session_id in self._suspended:
                state = "unknown" if live is None else "suspended" if session_id in self._suspended \
                    else live.status.value
                raise EngineError(f"policy {self.policy.name!r} asked to suspend session {session_id!r}, "
                                  f"which is {state}")
            self._suspended.add(session_id)
            self.suspensions += 1
        for session_id in decisions.resume:
            if session_id not in self._suspended:
                raise EngineError(f"policy {self.policy.name!r} asked to resume session {session_id!r}, "
                                  "which is not suspended")
            self._suspended.discard(session_id)
            run = self.runs[session_id]
            if run.parked:
                self._on_call(run)

    def _held(self, session_id: str, what: str) -> SessionRun:
        run = self.runs.get(session_id)
        if run is None or run.status != Status.HELD:
            state = "unknown" if run is None else run.status.value
            raise EngineError(f"policy {self.policy.name!r} asked to {what} session {session_id!r}, which is {state}")
        return run

    def _on_kill(self, session_ids: tuple[str, ...]) -> None:
        runs = [self.runs[sid] for sid in session_ids]
        runs = [run for run in runs if not run.is_over and run.status != Status.ARRIVING]
        for run in runs:  # withdraw every request first, so freed memory goes to survivors only
            if run.request is not None:
                self._cancel(run.request)
        for run in runs:
            self._end(run, Status.KILLED)
        for decode in self.decode:
            self._grant(decode)
            self._schedule_decode(decode)
        for prefill in self.prefill:
            self._kick(prefill)

    def ttft_s(self) -> float | None:
        """The windowed median time to first token, counting how long each request short of it has waited."""
        waiting = [self.now - (r.sent_s if r.run.call_sent_s is None else r.run.call_sent_s)
                   for r in self._requests.values() if r.stage is not Stage.DECODING]
        return self.latency_window.median_s(self.now, waiting)

    def _on_tick(self, _: object) -> None:
        if self.pins is not None:
            for prefill in self.prefill:
                if prefill.cache.expire_holds(self.now):
                    self._kick(prefill)
        self.timeline.record_sample(self.sample())
        self._apply(self.policy.on_tick(self.now, self.hit_window.rate(self.now), self.ttft_s()))
        assert self._tick_s is not None
        self._at(self.now + self._tick_s, _TICK, None)

    # --- clients -----------------------------------------------------------------------------------

    @staticmethod
    def _is_void(kind: int, payload: object) -> bool:
        """True for a client event overtaken by events: skipped without moving the clock."""
        if kind == _TIMEOUT:
            assert isinstance(payload, Request)
            return payload.run.request is not payload  # answered (or aborted) in time
        assert isinstance(payload, SessionRun)
        if kind == _RETRY:  # one retry waits at a time; void if its session ended meanwhile
            return payload.status != Status.LIVE or payload.request is not None
        return payload.is_over  # _GIVE_UP of a session over already

    def _on_timeout(self, request: Request) -> None:
        run = request.run
        assert self.clients is not None
        self.timeline.record_timeout(self.now)
        run.timeouts += 1
        self._cancel(request)
        wait_s = wait_before_attempt_s(self.clients, run.attempt + 1, self._client_rng.random())
        if wait_s is None:
            self._end(run, Status.ABANDONED)
        else:
            run.attempt += 1
            self._at(self.now + wait_s, _RETRY, run)
        self._resume(request)

    def _on_retry(self, run: SessionRun) -> None:
        self.timeline.record_retry(self.now)
        run.retries += 1
        self._on_call(run)

    def _on_give_up(self, run: SessionRun) -> None:
        request = run.request
        if request is not None:
            self._cancel(request)
        self._end(run, Status.ABANDONED)
        if request is not None:
            self._resume(request)

    def _resume(self, request: Request) -> None:
        """Hand out again what an aborted request gave back (decode memory, a decode epoch, prefill room)."""
        self._grant(request.decode)
        self._schedule_decode(request.decode)
        self._kick(request.prefill)

    # --- requests ----------------------------------------------------------------------------------

    def _on_call(self, run: SessionRun) -> None:
        if run.status != Status.LIVE:
            return
        spec = run.spec
        call = spec.session.calls[run.next_call]
        self.working_set_tokens += call.prompt_tokens - run.context_tokens
        run.context_tokens = call.prompt_tokens
        self._apply(self.policy.on_call(spec.session_id, self.now, call.prompt_tokens))
        if spec.session_id in self._suspended:
            if not run.parked:  # parked at the door until resumed; its wait is the call's
                run.parked = True
                self.num_parked += 1
                if run.attempt == 0:
                    run.call_sent_s = self.now
            return
        if run.parked:  # resumed: sent as of its parking
            run.parked = False
            self.num_parked -= 1
        elif run.attempt == 0:
            run.call_sent_s = self.now
        slot = DecodeSlot(0.0, call.prompt_tokens, call.completion_tokens)  # agents set no max_tokens
        if call.prompt_tokens > self.deployment.prefill_cache_tokens or not self.decode[0].can_ever_fit(slot):
            self._end(run, Status.ABORTED)  # SGLang rejects a request larger than an instance's memory
            return
        priority = self.policy.priority(spec.session_id, self.now)
        rid = self._next_request_id
        self._next_request_id += 1
        prefill, decode = self._route(spec, call.prompt_tokens)
        job = PrefillJob(priority, rid, spec.session_id, spec.group_key, spec.group_tokens, call.prompt_tokens)
        slot.priority, slot.request_id = priority, rid
        request = run.request = self._requests[rid] = Request(rid, run, self.now, prefill, decode, job, slot,
                                                              attempt=run.attempt)
        if self.clients is not None:
            self._seq += 1
            self._timeouts.append((self.now + self.clients.call_timeout_s, self._seq, _TIMEOUT, request))
        decode.enqueue(request.slot)
        self._grant(decode)

    def _grant(self, decode: DecodeInstance) -> None:
        """Hand out decode memory: resume retracted requests, pre-allocate queued ones (their prefill may start)."""
        version = decode.version
        while True:
            for slot in decode.pop_reserved(self.now):
                request = self._requests[slot.request_id]
                request.stage = Stage.PREFILL_WAIT
                wait_s = self._prefetch(request)
                if wait_s > 0:
                    self._at(self.now + wait_s, _PREFETCH_DONE, request)
                    continue
                request.prefill.enqueue(request.job)
                self._kick(request.prefill)
            shortfall = decode.head_shortfall_tokens(self.now)
            if shortfall == 0 or self.ledger is None or decode.lent_tokens == 0:
                break
            self.ledger.reclaim(str(decode.index), shortfall)  # decode wins: lent KV goes first
            self._sync_lent()
        if decode.version != version:  # resumed requests rejoined the batch, or memory moved
            self._schedule_decode(decode)

    def _prefetch(self, request: Request) -> float:
        """Start a request's storage prefetch (storage-offload); the wait before it may be queued on prefill."""
        if self.storage is None:
            return 0.0
        job = request.job
        cached = request.prefill.cache.lookup(job.session_key, job.group_key).tokens
        tokens = self.storage.hit(job.session_key, cached, job.prompt_tokens)
        if tokens <= 0:
            return 0.0
        fetch_s = self.profile.storage_fetch_s(tokens)
        wait_s = prefetch_wait_s(self.storage.prefetch_policy, fetch_s, tokens)
        arrived = tokens if wait_s >= fetch_s else int(tokens * wait_s / fetch_s)
        self._prefetched_end[request.request_id] = cached + arrived
        if wait_s > 0:
            self._prefetching.add(request.request_id)
        return wait_s

    def _on_prefetch_done(self, request: Request) -> None:
        if request.is_aborted:  # withdrawn while its prefetch ran: it held nothing on prefill
            return
        self._prefetching.discard(request.request_id)
        request.prefill.enqueue(request.job)
        self._kick(request.prefill)

    def _storage_hit(self, job: PrefillJob, now: float) -> int:
        """Tokens of a job its storage prefetch brought past its device + host hit (storage-offload)."""
        fetched_end = self._prefetched_end.pop(job.request_id, 0)
        return max(0, fetched_end - job.device_hit_tokens - job.host_hit_tokens)

    def _kick(self, prefill: PrefillInstance) -> None:
        if self.pins is not None:
            prefill.cache.expire_holds(self.now)
        batch = prefill.start_batch(self.now)
        if batch is None:
            return
        for job in batch.started:
            self._requests[job.request_id].stage = Stage.PREFILLING
            self.timeline.record_prefill(self.now, job.prompt_tokens, job.device_hit_tokens,
                                         job.host_hit_tokens + job.storage_hit_tokens)
            if self.pins is not None:
                self.pins.on_scheduled(job.session_key, self.now)
        self._at(batch.ends_s, _PREFILL_DONE, prefill)

    def _on_prefill_done(self, prefill: PrefillInstance) -> None:
        done = prefill.finish_batch()
        dropped = [self._requests[job.request_id] for job in done if job.is_cancelled]
        for request in dropped:  # every aborted job lets go before anything is admitted (a retry may be queued)
            self._drop(request)
        for job in done:
            if not job.is_cancelled:
                request = self._requests[job.request_id]
                request.stage = Stage.TRANSFER
                if self.storage is not None:  # write-through: the prompt's pages reach storage off the critical path
                    self.storage.backup_prompt(job.session_key, job.prompt_tokens)
                self._at(self.now + self.profile.transfer_s(job.prompt_tokens), _TRANSFER_DONE, request)
        for request in dropped:
            self._grant(request.decode)
        self._kick(prefill)

    def _on_transfer_done(self, request: Request) -> None:
        if request.is_aborted:  # aborted during the transfer: it gave everything back then
            return
        hold_until_s = None if self.pins is None else math.inf  # pinned: held until the TTL after the answer
        request.prefill.cache.release(request.run.spec.session_id, self.now, hold_until_s)
        self._kick(request.prefill)
        run = request.run
        sent_s = request.sent_s if run.call_sent_s is None else run.call_sent_s
        self.timeline.record_ttft(self.now, self.now - sent_s)  # from the call's first send (retries count)
        self.latency_window.record(self.now, self.now - sent_s)
        if run.next_call == 0 and run.first_token_s is None:
            run.first_token_s = self.now
        request.stage = Stage.DECODING
        request.decode.join(request.slot, self.now)
        self._grant(request.decode)  # a longer running batch changes SGLang's admission terms
        self._schedule_decode(request.decode)

    def _schedule_decode(self, decode: DecodeInstance) -> None:
        when = decode.next_event_s()
        if when is not None:
            self._at(when, _DECODE_NEXT, (decode, decode.version))

    def _on_decode_next(self, payload: tuple[DecodeInstance, int]) -> None:
        decode, version = payload
        if version != decode.version:
            return
        decode.pop_finished(self.now, self._answer)
        self._grant(decode)
        self._schedule_decode(decode)

    def _route(self, spec: SessionSpec, prompt_tokens: int) -> tuple[PrefillInstance, DecodeInstance]:
        """smg's choice of (prefill, decode) for a call; both count it in flight from now."""
        keys = (spec.session_id, spec.group_key, spec.group_tokens, prompt_tokens)
        prefill = self.prefill[self.prefill_router.route(*keys).worker]
        return prefill, self.decode[self.decode_router.route(*keys).worker]

    def _finish_route(self, request: Request) -> None:
        """The request's response ended (answered or cancelled): it leaves both routers' in-flight counts."""
        self.prefill_router.finish(request.prefill.index)
        self.decode_router.finish(request.decode.index)

    def _answer(self, slot: DecodeSlot) -> None:
        request = self._requests.pop(slot.request_id)
        self._finish_route(request)
        job = request.job
        self.hit_window.record(self.now, job.prompt_tokens,
                               job.device_hit_tokens + job.host_hit_tokens + job.storage_hit_tokens)
        if self.storage is not None:  # decode offloads the answer's pages as it frees them
            self.storage.offload_answer(job.session_key, job.prompt_tokens, slot.completion_tokens)
        run = request.run
        run.request, run.attempt = None, 0
        context_tokens, pins = job.prompt_tokens + slot.completion_tokens, self.pins
        ttl_s = 0.0 if pins is None else pins.ttl_after_answer_s(run.spec.session_id, self.now, context_tokens)
        if run.next_call + 1 < run.spec.session.n_calls:
            self._keep_kv(request, slot, ttl_s)
        run.steps += slot.steps
        run.good_steps += slot.good_steps
        run.next_call += 1
        if run.next_call < run.spec.session.n_calls:
            self._at(self.now + run.spec.gaps_s[run.next_call - 1], _CALL, run)
        else:
            self._end(run, Status.FINISHED)

    # --- pins and lending ---------------------------------------------------------------------------

    def _keep_kv(self, request: Request, slot: DecodeSlot, ttl_s: float) -> None:
        """After an answer that is not the session's last: start the TTL hold (or unpin), lend decode's copy."""
        session_id = request.run.spec.session_id
        if self.pins is not None:
            if ttl_s > 0:
                request.prefill.cache.hold(session_id, self.now + ttl_s)
            elif request.prefill.cache.drop_hold(session_id):
                self._kick(request.prefill)
        if self.ledger is not None:
            tokens = slot.prompt_tokens + slot.completion_tokens
            if tokens <= request.decode.idle_tokens(self.now):
                self.ledger.lend(session_id, str(request.decode.index), tokens)
                self._sync_lent()

    def _write_back(self, job: PrefillJob) -> int:
        """Tokens of a job a decode instance writes back instead of prefill computing them."""
        assert self.ledger is not None
        plan = self.ledger.write_back_plan(job.session_key, job.device_hit_tokens + job.host_hit_tokens)
        if plan is None:
            return 0
        self.ledger.forget(job.session_key)
        self._sync_lent()
        return plan.tokens_to_move

    def _forget_kv(self, session_id: str) -> None:
        if self.pins is not None:
            for prefill in self.prefill:
                if prefill.cache.drop_hold(session_id):
                    self._kick(prefill)  # what the hold pinned may now go to a request waiting for room
        if self.ledger is not None and self.ledger.forget(session_id) is not None:
            self._sync_lent()

    def _sync_lent(self) -> None:
        assert self.ledger is not None
        for decode in self.decode:
            lent = self.ledger.lent_tokens(str(decode.index))
            if lent != decode.lent_tokens:
                decode.lent_tokens = lent  # moves the point where decode memory runs out
                self._schedule_decode(decode)

    def _reclaim_for_step(self, decode: DecodeInstance, tokens: int) -> None:
        """A decode step does not fit: lent KV goes first (before SGLang would retract a request)."""
        assert self.ledger is not None
        self.ledger.reclaim(str(decode.index), tokens)
        self._sync_lent()

    def _cancel(self, request: Request) -> None:
        """Abort a request; a job in a running prefill batch gives its part back when the batch ends.

        The caller hands freed memory out again (`_grant`, `_schedule_decode`, `_kick`) once every
        abort is withdrawn.
        """
        stage = request.stage
        request.is_aborted = True
        if stage == Stage.PREALLOC:
            request.decode.cancel_queued(request.slot)
            del self._requests[request.request_id]
        elif stage == Stage.PREFILL_WAIT:
            self._prefetched_end.pop(request.request_id, None)
            if request.request_id in self._prefetching:  # not queued on prefill yet
                self._prefetching.discard(request.request_id)
                request.job.is_cancelled = True
            else:
                request.prefill.cancel(request.job)
            request.decode.free(request.slot)
            del self._requests[request.request_id]
        elif stage == Stage.PREFILLING:
            request.prefill.cancel(request.job)  # dropped when its batch ends
        elif stage == Stage.TRANSFER:  # both ends of the transfer let go now
            self._release_chain(request)
            request.decode.free(request.slot)
            del self._requests[request.request_id]
        elif stage == Stage.DECODING:
            request.decode.leave(request.slot, self.now)
            del self._requests[request.request_id]
            if self.pins is not None:
                request.prefill.cache.drop_hold(request.run.spec.session_id)  # the caller kicks prefill
        self._finish_route(request)  # the client went away: smg stops counting it now, not when it is dropped
        request.run.request = None

    def _drop(self, request: Request) -> None:
        """Release an aborted request whose prefill batch ended (the caller grants and kicks after)."""
        self._release_chain(request)
        request.decode.free(request.slot)
        del self._requests[request.request_id]

    def _release_chain(self, request: Request) -> None:
        """Unpin an aborted request's chain."""
        request.prefill.cache.release(request.run.spec.session_id, self.now)

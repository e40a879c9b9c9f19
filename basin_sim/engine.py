"""`Engine`: sessions in, an event-driven PD deployment with prefix caches, outcomes out.

The engine only puts its parts together, each with one job (their rules are in their modules):
- events.py: the clock, the event heap and the timer queues, dispatch in (time, seq) order;
- sessions.py: sessions at the door, the policy's decisions, suspension, the end of a session;
- agents.py: the clients' side: the next call after the tool time, timeouts, retries, give-ups;
- request_flow.py: a request's way through routers, decode memory, prefill, the KV transfer and decode;
- kv_tiers.py: what the deployment keeps of a finished call's KV (lending none, decode-memory,
  storage-offload), one strategy chosen once; pins.py: a policy's pins between calls.

Rules of the engine itself:
- A policy that is an `AnswerListener` hears every answered call (its decisions applied) before the
  clients do (the tool time, or the session's finish); no other policy is asked.
- A policy that is a `PolicyScheduler` has its `on_schedule` every `scheduler_interval_s` (its decisions
  applied), besides and whatever the ticks; no other policy is scheduled. Its turns stop once nothing else
  is scheduled and no session waits at the door or is parked (so `run_until(math.inf)` ends), and start
  again, on the same grid of multiples of the interval, when a session is added.
- A policy tick comes every `tick_s` when ticks are on: expired holds go, the state is sampled into
  the timeline, and the policy hears the hit rate (`basin_runtime.policy.hit_rate.HitRateWindow`, fed
  as the gateway feeds it) and the first-token latency (`basin_runtime.policy.latency.LatencyWindow`,
  requests not yet decoding counted with their wait so far); a `CacheController` then hears the same hit
  rate with the decode KV usage (`decode_kv_usage`).
- Per timeline bin, the state at the bin's end is recorded before the first event at or after it.
Invariants (`check`): those of sessions.py and request_flow.py; a request in flight is its session's
request unless withdrawn (then it waits for its prefill batch to end); each decode instance's
reserved and queued tokens are those of its requests; an ended session holds no cache hold, session
reference or kept KV.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.policy.lending import LendingLedger
from basin_sim.agents import Agents
from basin_sim.clients import ClientPolicy
from basin_sim.decode import DecodeInstance
from basin_sim.events import EventLoop
from basin_sim.goodput import STEP_SLO_S
from basin_sim.kv_tiers import KvTier
from basin_sim.lifecycle import Request, SessionRun, SessionSpec, Stage, Status
from basin_sim.policies.base import AnswerListener, CacheController, PinRule, PolicyScheduler, SessionPolicy
from basin_sim.prefill import PrefillInstance
from basin_sim.profile import Deployment
from basin_sim.request_flow import RequestFlow
from basin_sim.router import CacheAwareRouter
from basin_sim.sessions import EngineError, Sessions
from basin_sim.storage import StorageTier
from basin_sim.timeline import BinState, Sample, Timeline

__all__ = ["Engine", "EngineError", "SessionOverHook"]

SessionOverHook = Callable[[SessionRun], None]


class Engine:
    """A PD deployment under a session policy; feed it with `add`, drive it with `run_until`."""

    def __init__(self, deployment: Deployment, policy: SessionPolicy, *, timeline: Timeline | None = None,
                 tick_s: float | None = 10.0, step_slo_s: float = STEP_SLO_S,
                 hit_window: HitRateWindow | None = None, router_seed: int = 0,
                 clients: ClientPolicy | None = None, client_seed: int = 0,
                 on_session_over: SessionOverHook | None = None) -> None:
        self.deployment = deployment
        self.profile = deployment.profile
        self.policy = policy
        self.pins: PinRule | None = policy.pins
        self.clients = clients
        self.timeline = timeline if timeline is not None else Timeline()
        self.hit_window = hit_window if hit_window is not None else HitRateWindow()
        self._loop = loop = EventLoop()
        self.flow = flow = RequestFlow(deployment, policy, loop, self.timeline, self.hit_window,
                                       step_slo_s=step_slo_s, router_seed=router_seed)
        self.sessions = sessions = Sessions(policy, loop, flow, self.timeline, on_session_over)
        self.agents = agents = Agents(clients, client_seed, loop, sessions, flow, self.timeline)
        flow.on_sent, flow.on_answered, flow.on_refused = agents.sent, agents.answered, sessions.refuse
        if isinstance(policy, AnswerListener):
            flow.on_answered = self._answered
        sessions.on_arrived = agents.arrived
        loop.watch_s, loop.on_watch = self._next_bin_end_s(), self._record_bin_ends
        self._tick_s = tick_s
        self._tick = loop.kind(self._on_tick)
        if tick_s is not None:
            loop.at(tick_s, self._tick, None)
        self._schedule_armed = isinstance(policy, PolicyScheduler)
        if isinstance(policy, PolicyScheduler):
            self._schedule = loop.kind(self._on_schedule)
            loop.at(policy.scheduler_interval_s, self._schedule, None)

    # --- driving -----------------------------------------------------------------------------------

    def add(self, spec: SessionSpec) -> None:
        """Schedule a session's arrival (the scheduler's turns start again if they had stopped)."""
        self.sessions.add(spec)
        self._rearm_schedule()

    def kill_at(self, at_s: float, session_ids: Iterable[str]) -> None:
        """End these sessions at `at_s` (those still live or queued then)."""
        self.sessions.kill_at(at_s, session_ids)

    def run_until(self, until_s: float) -> None:
        """Process every event up to `until_s` (math.inf: until nothing is left to do)."""
        self._loop.run_until(until_s)

    # --- what the parts hold -----------------------------------------------------------------------

    @property
    def now(self) -> float:
        """The simulated time."""
        return self._loop.now

    @property
    def on_session_over(self) -> SessionOverHook | None:
        """Called once a session is over in any way, after the policy heard of it."""
        return self.sessions.on_over

    @on_session_over.setter
    def on_session_over(self, hook: SessionOverHook | None) -> None:
        self.sessions.on_over = hook

    @property
    def runs(self) -> dict[str, SessionRun]:
        """Every session added, by id."""
        return self.sessions.runs

    @property
    def num_live(self) -> int:
        """Sessions admitted and not over."""
        return self.sessions.num_live

    @property
    def num_live_burst(self) -> int:
        """Live burst sessions."""
        return self.sessions.num_live_burst

    @property
    def num_queued(self) -> int:
        """Sessions waiting at the door (the timeline's `held_sessions`)."""
        return self.sessions.num_queued

    @property
    def num_parked(self) -> int:
        """Live sessions whose call is parked (suspended)."""
        return self.sessions.num_parked

    @property
    def working_set_tokens(self) -> int:
        """The latest prompt of every live session, summed."""
        return self.sessions.working_set_tokens

    @property
    def suspensions(self) -> int:
        """Suspend decisions applied."""
        return self.sessions.suspensions

    @property
    def prefill(self) -> list[PrefillInstance]:
        """The prefill instances."""
        return self.flow.prefill

    @property
    def decode(self) -> list[DecodeInstance]:
        """The decode instances."""
        return self.flow.decode

    @property
    def prefill_router(self) -> CacheAwareRouter:
        """The prefill pool's router."""
        return self.flow.prefill_router

    @property
    def decode_router(self) -> CacheAwareRouter:
        """The decode pool's router."""
        return self.flow.decode_router

    @property
    def requests(self) -> dict[int, Request]:
        """Requests in flight, by id."""
        return self.flow.requests

    @property
    def kv_tier(self) -> KvTier:
        """The lending switch's strategy."""
        return self.flow.kv_tier

    @property
    def ledger(self) -> LendingLedger | None:
        """The lending ledger (lending decode-memory), else None."""
        return self.flow.kv_tier.ledger

    @property
    def storage(self) -> StorageTier | None:
        """The storage tier (lending storage-offload), else None."""
        return self.flow.kv_tier.storage

    @property
    def latency_window(self) -> LatencyWindow:
        """Each call's time to first token, as the gateway's window holds it."""
        return self.flow.latency_window

    def decode_kv_usage(self) -> float:
        """SGLang's token usage over the decode instances: KV held by their requests (pre-allocated prompts and
        running batches, now) over their memory."""
        now = self._loop.now
        return sum(d.used_tokens(now) for d in self.decode) / sum(d.capacity_tokens for d in self.decode)

    def ttft_s(self) -> float | None:
        """The windowed median time to first token, counting how long each request short of it has waited."""
        return self.flow.ttft_s()

    # --- ticks, samples, checks --------------------------------------------------------------------

    def _answered(self, run: SessionRun) -> None:
        """An answered call, told to the policy (an `AnswerListener`) before the clients."""
        assert isinstance(self.policy, AnswerListener)
        call = run.spec.session.calls[run.next_call - 1]
        self.sessions.apply(self.policy.on_answer(run.spec.session_id, self._loop.now, call.prompt_tokens,
                                                  call.completion_tokens))
        self.agents.answered(run)

    def _on_schedule(self, _: object) -> None:
        assert isinstance(self.policy, PolicyScheduler)
        now = self._loop.now
        self.sessions.apply(self.policy.on_schedule(now))
        sessions = self.sessions
        self._schedule_armed = self._loop.has_pending() or sessions.num_queued > 0 or sessions.num_parked > 0
        if self._schedule_armed:
            self._loop.at(now + self.policy.scheduler_interval_s, self._schedule, None)

    def _rearm_schedule(self) -> None:
        """The scheduler's next turn on its grid after now, if its turns had stopped."""
        if not isinstance(self.policy, PolicyScheduler) or self._schedule_armed:
            return
        interval = self.policy.scheduler_interval_s
        self._schedule_armed = True
        self._loop.at((math.floor(self._loop.now / interval) + 1) * interval, self._schedule, None)

    def _on_tick(self, _: object) -> None:
        self.flow.expire_holds()
        self.timeline.record_sample(self.sample())
        now = self._loop.now
        hit_rate = self.hit_window.rate(now)
        self.sessions.apply(self.policy.on_tick(now, hit_rate, self.ttft_s()))
        if isinstance(self.policy, CacheController):
            self.sessions.apply(self.policy.on_control(now, hit_rate, self.decode_kv_usage()))
        assert self._tick_s is not None
        self._loop.at(now + self._tick_s, self._tick, None)

    def _next_bin_end_s(self) -> float:
        return (len(self.timeline.bin_states) + 1) * self.timeline.bin_s

    def _record_bin_ends(self, upto_s: float) -> None:
        """Record the state at every timeline bin end <= upto_s not recorded yet (no event in between)."""
        timeline, loop, sessions = self.timeline, self._loop, self.sessions
        while loop.watch_s <= upto_s:
            requests = self.flow.requests.values()
            timeline.record_bin_state(BinState(
                end_s=loop.watch_s, live_sessions=sessions.num_live, live_burst_sessions=sessions.num_live_burst,
                held_sessions=sessions.num_queued, working_set_tokens=sessions.working_set_tokens,
                prefill_queued=sum(r.stage == Stage.PREFILL_WAIT for r in requests),
                prealloc_queued=sum(r.stage == Stage.PREALLOC for r in requests)))
            loop.watch_s = self._next_bin_end_s()

    def sample(self) -> Sample:
        """The state now, as the timeline records it."""
        caches = [p.cache for p in self.prefill]
        now = self._loop.now
        return Sample(
            time_s=now, live_sessions=self.num_live, held_sessions=self.num_queued,
            working_set_tokens=self.working_set_tokens,
            cache_device_tokens=sum(c.device_used_tokens for c in caches),
            cache_host_tokens=sum(c.host_used_tokens for c in caches),
            cache_pinned_tokens=sum(c.pinned_tokens for c in caches),
            cache_held_tokens=self.flow.holds.held_tokens(caches),
            prefill_waiting=sum(p.num_waiting for p in self.prefill),
            decode_queued=sum(d.num_queued for d in self.decode),
            decode_running=sum(d.batch_size for d in self.decode),
            decode_reserved_tokens=round(sum(d.used_tokens(now) for d in self.decode)),
        )

    def check(self) -> None:
        """Assert the invariants at the top of this module (tests call it between steps)."""
        self.sessions.check()
        allocated, queued = [0] * len(self.decode), [0] * len(self.decode)
        for rid, request in self.requests.items():
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
                assert not any(p.cache.is_held(session_id) for p in self.prefill), f"{session_id!r} holds a pin"
                assert not any(p.cache.is_referenced(session_id) for p in self.prefill), f"{session_id!r} is referenced"
                assert not self.kv_tier.holds(session_id), f"{session_id!r} lends KV"

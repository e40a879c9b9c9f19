"""Sessions at the door: arrival, queued or live, each call past the policy, suspension, the end.

Rules:
- The policy sees every arrival, call, end and tick (policies/base.py) and answers with `Decisions`,
  applied at once in the order shed, admit, suspend, resume. A queued session waits at the door and
  its waiting counts in its end-to-end time; an admitted one sends its first call at once. Every
  change of status goes through the policy core's lifecycle table (`Status.after`), checked before
  anything changes. A decision about a session in the wrong state (admit or shed one not queued,
  suspend one not live or already suspended, resume one not suspended) raises `EngineError` naming
  the policy and the session.
- Each call of a live session updates the working set, is told to the policy, then is sent
  (request_flow.py) unless the session is suspended.
- Suspension: the session stays live; the call it sends next (or the one being sent when the decision
  comes) is parked at the door, told to the policy, but not sent, until the policy resumes the
  session; the call then goes as sent at its parking (TTFT counts the wait). A resume before the next
  call only lifts the suspension. Client timers do not run for a parked call (it is the gateway's
  hold, like the door's); the session time limit does. A session suspended with `close` has its engine
  session closed when its call parks (`RequestFlow.close_engine_session`: at its tool boundary, its last
  call answered), once per suspension.
- A live session shed (Basin's recovery: a hold that ran out) ends at once like a queued one shed: its
  request withdrawn if it has one, its parked call never sent, its KV forgotten; the policy shed it, so
  it hears of no end.
- Working set = sum of the latest prompt of every live session (tool-running and parked included).
- A kill ends its sessions at once (those live or queued then), every request withdrawn before any
  session ends, so freed memory goes to survivors only. Ending one can move the policy on the others
  (an end frees room): one it sheds meanwhile is shed, not killed; one it resumes meanwhile has the
  call it sent withdrawn before it ends, so no request of a killed session lives on.
- An ended session's hold, kept KV and routing entries go (`RequestFlow.forget_session`); the policy
  hears of the end; then `on_over(run)` (a closed population starts its next session). A session shed
  while queued is over without an end call (the policy shed it). Finished and abandoned sessions are
  counted in the timeline's bins.
Invariants (`check`): num_live, num_live_burst and num_queued count the sessions in those states,
num_parked the live ones parked (each suspended, with no request); the sessions to close are suspended;
working_set_tokens == sum of live
sessions' context_tokens; an ended session holds no request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from basin_runtime.policy.lifecycle import LifecycleError, LifecycleEvent
from basin_sim.events import EventLoop
from basin_sim.lifecycle import SessionRun, SessionSpec, Status
from basin_sim.policies.base import Decisions, SessionPolicy
from basin_sim.request_flow import RequestFlow
from basin_sim.timeline import Timeline

RunHook = Callable[[SessionRun], None]


class EngineError(RuntimeError):
    """A policy decision or an event the engine cannot honour."""


class Sessions:
    """Every session's record and the counts of live, queued and parked ones; the policy's decisions applied."""

    def __init__(self, policy: SessionPolicy, loop: EventLoop, flow: RequestFlow, timeline: Timeline,
                 on_over: RunHook | None) -> None:
        self.policy = policy
        self.runs: dict[str, SessionRun] = {}
        self.num_live = 0
        self.num_live_burst = 0
        self.num_queued = 0
        self.num_parked = 0
        self.working_set_tokens = 0
        self.suspensions = 0  # suspend decisions applied
        self.suspended: set[str] = set()  # live sessions whose next call is parked until resumed
        self.closing: set[str] = set()  # suspended sessions whose engine session closes when their call parks
        self.on_arrived: RunHook = _nothing  # the clients start the session's time limit
        self.on_over = on_over
        self._loop = loop
        self._flow = flow
        self._timeline = timeline
        self._arrive = loop.kind(self._on_arrive)
        self._kill = loop.kind(self._on_kill)

    def add(self, spec: SessionSpec) -> None:
        """Schedule a session's arrival."""
        if spec.session_id in self.runs:
            raise EngineError(f"session {spec.session_id!r} added twice")
        if spec.arrival_s < self._loop.now:
            raise EngineError(f"session {spec.session_id!r} arrives at {spec.arrival_s} < now {self._loop.now}")
        run = self.runs[spec.session_id] = SessionRun(spec)
        self._loop.at(spec.arrival_s, self._arrive, run)

    def kill_at(self, at_s: float, session_ids: Iterable[str]) -> None:
        """End these sessions at `at_s` (those still live or queued then)."""
        self._loop.at(at_s, self._kill, tuple(session_ids))

    def _on_arrive(self, run: SessionRun) -> None:
        run.status = run.status.after("arrive")
        self.num_queued += 1
        self._timeline.record_arrival(self._loop.now)
        self.on_arrived(run)
        self.apply(self.policy.on_arrival(run.spec.session_id, self._loop.now, run.spec.session))

    def call(self, run: SessionRun) -> None:
        """The session's next call reaches the door: told to the policy, then parked or sent."""
        if run.status != Status.LIVE:
            return
        spec, now = run.spec, self._loop.now
        call = spec.session.calls[run.next_call]
        self.working_set_tokens += call.prompt_tokens - run.context_tokens
        run.context_tokens = call.prompt_tokens
        self.apply(self.policy.on_call(spec.session_id, now, call.prompt_tokens))
        if spec.session_id in self.suspended:
            if not run.parked:  # parked at the door until resumed; its wait is the call's
                run.parked = True
                self.num_parked += 1
                if run.attempt == 0:
                    run.call_sent_s = now
                if spec.session_id in self.closing:
                    self.closing.discard(spec.session_id)
                    self._flow.close_engine_session(spec.session_id)
            return
        if run.parked:  # resumed: sent as of its parking
            run.parked = False
            self.num_parked -= 1
        elif run.attempt == 0:
            run.call_sent_s = now
        self._flow.send(run, call)

    def end(self, run: SessionRun, event: LifecycleEvent) -> None:
        """End a live or queued session by `event` (finish, kill, abort, abandon); `LifecycleError` if it may not."""
        ended = run.status.after(event)
        if run.parked:
            run.parked = False
            self.num_parked -= 1
        self.suspended.discard(run.spec.session_id)
        self.closing.discard(run.spec.session_id)
        if run.status == Status.LIVE:
            self.num_live -= 1
            self.num_live_burst -= run.spec.is_burst
            self.working_set_tokens -= run.context_tokens
        elif run.status == Status.QUEUED:
            self.num_queued -= 1
        run.status, run.ended_s = ended, self._loop.now
        self._flow.forget_session(run.spec.session_id)
        self.apply(self.policy.on_session_end(run.spec.session_id, self._loop.now))
        self._over(run)

    def refuse(self, run: SessionRun) -> None:
        """Its call cannot ever be served: the session is aborted."""
        self.end(run, "abort")

    def apply(self, decisions: Decisions) -> None:
        """Carry out the policy's decisions (see the rules)."""
        for session_id in decisions.shed:
            run, shed = self._decided(session_id, "shed")
            was_live = run.status == Status.LIVE
            if was_live:
                self._leave_live(run)
            else:
                self.num_queued -= 1
            run.status, run.ended_s = shed, self._loop.now
            if was_live:
                self._flow.forget_session(session_id)
            self._over(run)
        for session_id in decisions.admit:
            self._start(*self._decided(session_id, "admit"))
        for session_id in decisions.suspend:
            self._suspend(session_id)
        self.closing.update(decisions.close)
        for session_id in decisions.resume:
            if session_id not in self.suspended:
                raise EngineError(f"policy {self.policy.name!r} asked to resume session {session_id!r}, "
                                  "which is not suspended")
            self.suspended.discard(session_id)
            self.closing.discard(session_id)
            run = self.runs[session_id]
            if run.parked:
                self.call(run)

    def _leave_live(self, run: SessionRun) -> None:
        """A live session is shed: its request withdrawn, its parking and suspension lifted, its counts gone."""
        if run.request is not None:
            self._flow.withdraw(run.request)
            self._flow.resume_all()
        if run.parked:
            run.parked = False
            self.num_parked -= 1
        self.suspended.discard(run.spec.session_id)
        self.closing.discard(run.spec.session_id)
        self.num_live -= 1
        self.num_live_burst -= run.spec.is_burst
        self.working_set_tokens -= run.context_tokens

    def _start(self, run: SessionRun, live: Status) -> None:
        run.status, run.admitted_s = live, self._loop.now
        self.num_queued -= 1
        self.num_live += 1
        self.num_live_burst += run.spec.is_burst
        self.call(run)

    def _suspend(self, session_id: str) -> None:
        live = self.runs.get(session_id)
        if live is None or live.status != Status.LIVE or session_id in self.suspended:
            state = "unknown" if live is None else "suspended" if session_id in self.suspended \
                else live.status.value
            raise EngineError(f"policy {self.policy.name!r} asked to suspend session {session_id!r}, which is {state}")
        self.suspended.add(session_id)
        self.suspensions += 1

    def _decided(self, session_id: str, event: LifecycleEvent) -> tuple[SessionRun, Status]:
        """The session a policy's decision is about and the status it takes it to; `EngineError` if it may not."""
        run = self.runs.get(session_id)
        if run is None:
            raise EngineError(f"policy {self.policy.name!r} asked to {event} session {session_id!r}, which is unknown")
        try:
            return run, run.status.after(event)
        except LifecycleError as exc:
            raise EngineError(f"policy {self.policy.name!r} asked to {event} session {session_id!r}, which is "
                              f"{run.status.value}") from exc

    def _over(self, run: SessionRun) -> None:
        """A session is over (its status final): count it and tell the hook."""
        if run.status == Status.FINISHED:
            self._timeline.record_completion(self._loop.now)
        elif run.status == Status.ABANDONED:
            self._timeline.record_abandoned(self._loop.now)
        if self.on_over is not None:
            self.on_over(run)

    def _on_kill(self, session_ids: tuple[str, ...]) -> None:
        runs = [self.runs[sid] for sid in session_ids]
        runs = [run for run in runs if not run.is_over and run.status != Status.ARRIVING]
        for run in runs:  # withdraw every request first, so freed memory goes to survivors only
            if run.request is not None:
                self._flow.withdraw(run.request)
        for run in runs:
            if run.is_over:  # ending one may have had the policy shed another of them: over already
                continue
            if run.request is not None:  # ending one may have had the policy resume another, whose call went out
                self._flow.withdraw(run.request)
            self.end(run, "kill")
        self._flow.resume_all()

    def check(self) -> None:
        """Assert the invariants at the top of this module."""
        live = [run for run in self.runs.values() if run.status == Status.LIVE]
        assert self.num_live == len(live) and self.num_live_burst == sum(run.spec.is_burst for run in live)
        assert self.num_queued == sum(run.status == Status.QUEUED for run in self.runs.values())
        parked = [run for run in live if run.parked]
        assert self.num_parked == len(parked) and all(run.request is None for run in parked)
        assert all(run.spec.session_id in self.suspended for run in parked)
        assert all(self.runs[sid].status == Status.LIVE for sid in self.suspended)
        assert self.closing <= self.suspended, "a session closes its engine session only while suspended"
        assert self.working_set_tokens == sum(run.context_tokens for run in live)
        for run in self.runs.values():
            assert not run.is_over or run.request is None, f"ended session {run.spec.session_id!r} holds a request"


def _nothing(_: SessionRun) -> None:
    """No hook."""

"""The agents' side of each session in the engine: the next call after the tool time, timeouts, retries, give-ups.

Rules (the numbers and waits are clients.py's `ClientPolicy`; None: nobody gives up):
- After each answer but the last, the agent runs its tool for the session's recorded gap and sends the
  next call; after the last, the session is finished.
- An attempt not answered `call_timeout_s` after it was sent is timed out and withdrawn; after the
  client's or the harness's wait (`wait_before_attempt_s`, its jitter drawn from the run's seeded RNG)
  the same call is sent again as a new request (new id, routed again, the policy told of the call
  again: a gateway sees every attempt); when the call's attempts are used up the session ends
  ABANDONED. The waits between attempts count in the end-to-end time.
- `session_time_limit_s` after its arrival a session not over is abandoned, its request withdrawn. A
  queued session's call timeouts start when it is admitted (the door's wait is the policy's; the session
  time limit covers it).
- A timer overtaken by events is void and skipped without moving the clock: a timeout whose attempt
  was answered or withdrawn, a retry of a session that ended or already sent, a give-up of a session
  already over.
- Per timeline bin, timeouts and retries are counted.
"""

from __future__ import annotations

import random

from basin_sim.clients import ClientPolicy, wait_before_attempt_s
from basin_sim.events import EventLoop
from basin_sim.lifecycle import Request, SessionRun, Status
from basin_sim.request_flow import RequestFlow
from basin_sim.sessions import Sessions
from basin_sim.timeline import Timeline


class Agents:
    """What the agents in front of the gateway do between and around their calls."""

    def __init__(self, clients: ClientPolicy | None, seed: int, loop: EventLoop, sessions: Sessions,
                 flow: RequestFlow, timeline: Timeline) -> None:
        self.clients = clients
        self._rng = random.Random(seed)  # the backoff jitter's draws
        self._loop = loop
        self._sessions = sessions
        self._flow = flow
        self._timeline = timeline
        self._call = loop.kind(sessions.call)
        self._retry = loop.kind(self._on_retry, _retry_is_void)
        self._timeouts = loop.timer_queue(self._on_timeout, _timeout_is_void)
        self._give_ups = loop.timer_queue(self._on_give_up, _give_up_is_void)

    def arrived(self, run: SessionRun) -> None:
        """A session arrived: its time limit starts."""
        if self.clients is not None and self.clients.session_time_limit_s is not None:
            self._give_ups.set(self._loop.now + self.clients.session_time_limit_s, run)

    def sent(self, request: Request) -> None:
        """An attempt was sent: its timeout starts."""
        if self.clients is not None:
            self._timeouts.set(self._loop.now + self.clients.call_timeout_s, request)

    def answered(self, run: SessionRun) -> None:
        """A call was answered: the next one goes after the tool time, or the session is finished."""
        if run.next_call < run.spec.session.n_calls:
            self._loop.at(self._loop.now + run.spec.gaps_s[run.next_call - 1], self._call, run)
        else:
            self._sessions.end(run, "finish")

    def _on_timeout(self, request: Request) -> None:
        run, clients = request.run, self.clients
        assert clients is not None
        self._timeline.record_timeout(self._loop.now)
        run.timeouts += 1
        self._flow.withdraw(request)
        wait_s = wait_before_attempt_s(clients, run.attempt + 1, self._rng.random())
        if wait_s is None:
            self._sessions.end(run, "abandon")
        else:
            run.attempt += 1
            self._loop.at(self._loop.now + wait_s, self._retry, run)
        self._flow.resume(request)

    def _on_retry(self, run: SessionRun) -> None:
        self._timeline.record_retry(self._loop.now)
        run.retries += 1
        self._sessions.call(run)

    def _on_give_up(self, run: SessionRun) -> None:
        request = run.request
        if request is not None:
            self._flow.withdraw(request)
        self._sessions.end(run, "abandon")
        if request is not None:
            self._flow.resume(request)


def _timeout_is_void(request: Request) -> bool:
    return request.run.request is not request  # answered (or withdrawn) in time


def _retry_is_void(run: SessionRun) -> bool:
    return run.status != Status.LIVE or run.request is not None  # one retry waits at a time


def _give_up_is_void(run: SessionRun) -> bool:
    return run.is_over

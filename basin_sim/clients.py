"""What the agents in front of the gateway do when the deployment is slow, as numbers and pure rules.

They time out a call, retry it, give a session up (agents.py runs these rules in the engine); and a
closed population of agents starts a new session when its last one is over.

Rules:
- An attempt of a call times out `call_timeout_s` after it was sent if its answer is not back (a
  non-streaming call: the answer is the whole completion). The attempt is aborted and the same call
  is sent again as a new attempt after a wait, until the attempts run out; then the session is
  abandoned. A session also gives up `session_time_limit_s` after its arrival (None: never).
- Attempts of one call, numbered from 0: the API client makes 1 + `max_retries` attempts per harness
  attempt; the harness makes `harness_attempts` of those. `attempts_per_call` = their product.
  Before attempt k (k >= 1): within a harness attempt, the client's backoff after n = (k mod
  (1 + max_retries)) - 1 retries; at the start of a harness attempt h = k div (1 + max_retries),
  the harness's wait after h failures.
- Client backoff after n retries: min(initial * 2**n, max) * (1 - jitter * u), u ~ U[0, 1) drawn by
  the caller (the function is pure). Harness wait after h failures: clamp(multiplier * 2**(h-1),
  min, max), no jitter.
- A closed population of N agents: each agent has one session at a time; when it is over (finished,
  abandoned, shed, killed, aborted) the agent thinks for an exponential time of mean `think_time_s`
  (0: none) and starts the next, drawn uniformly from the pool with the population's RNG, until
  `stop_s`.

Sources of the defaults:
- openai-python 1.x (`openai/_constants.py`, `_base_client.py`): DEFAULT_TIMEOUT read 600 s,
  DEFAULT_MAX_RETRIES 2, INITIAL_RETRY_DELAY 0.5 s, MAX_RETRY_DELAY 8 s, jitter 1 - 0.25 * random()
  (`_calculate_retry_timeout`); timeouts are among the retried errors.
- mini-swe-agent v2.4.6 (`models/utils/retry.py`): tenacity `stop_after_attempt(10)`,
  `wait_exponential(multiplier=1, min=4, max=60)`: waits 4, 4, 4, 8, 16, 32, 60, 60, 60 s.
- Session time limit: off, as mini-swe-agent's `AgentConfig.wall_time_limit_seconds = 0`, the
  harness that recorded the SWE-bench and Terminal-Bench sessions of the pool.
- Think time: exponential, as the closed-system model of Schroeder, Wierman and Harchol-Balter,
  "Open versus closed: a cautionary tale" (NSDI 2006); its mean has no default source (0: none).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from basin_runtime.session_table import Session
from basin_sim.lifecycle import SessionRun, SessionSpec

OPENAI_TIMEOUT_S = 600.0
OPENAI_MAX_RETRIES = 2
OPENAI_INITIAL_RETRY_DELAY_S = 0.5
OPENAI_MAX_RETRY_DELAY_S = 8.0
OPENAI_JITTER = 0.25
MINI_SWE_AGENT_ATTEMPTS = 10
MINI_SWE_AGENT_WAIT_MIN_S = 4.0
MINI_SWE_AGENT_WAIT_MAX_S = 60.0
MINI_SWE_AGENT_WAIT_MULTIPLIER_S = 1.0


class ClientError(ValueError):
    """A client policy or population whose numbers do not make sense."""


@dataclass(frozen=True)
class ClientPolicy:
    """How an agent's client times out, retries and gives up (defaults: openai client + mini-swe-agent)."""

    call_timeout_s: float = OPENAI_TIMEOUT_S
    max_retries: int = OPENAI_MAX_RETRIES
    backoff_initial_s: float = OPENAI_INITIAL_RETRY_DELAY_S
    backoff_max_s: float = OPENAI_MAX_RETRY_DELAY_S
    backoff_jitter: float = OPENAI_JITTER
    harness_attempts: int = MINI_SWE_AGENT_ATTEMPTS
    harness_wait_min_s: float = MINI_SWE_AGENT_WAIT_MIN_S
    harness_wait_max_s: float = MINI_SWE_AGENT_WAIT_MAX_S
    harness_wait_multiplier_s: float = MINI_SWE_AGENT_WAIT_MULTIPLIER_S
    session_time_limit_s: float | None = None

    def __post_init__(self) -> None:
        problems = [
            f"call_timeout_s must be > 0, got {self.call_timeout_s}" if not self.call_timeout_s > 0 else "",
            f"max_retries must be >= 0, got {self.max_retries}" if self.max_retries < 0 else "",
            f"harness_attempts must be >= 1, got {self.harness_attempts}" if self.harness_attempts < 1 else "",
            "need 0 <= backoff_initial_s <= backoff_max_s, got "
            f"{self.backoff_initial_s}, {self.backoff_max_s}" if not 0 <= self.backoff_initial_s <= self.backoff_max_s
            else "",
            f"backoff_jitter must be in [0, 1], got {self.backoff_jitter}" if not 0 <= self.backoff_jitter <= 1 else "",
            "need 0 <= harness_wait_min_s <= harness_wait_max_s, got "
            f"{self.harness_wait_min_s}, {self.harness_wait_max_s}"
            if not 0 <= self.harness_wait_min_s <= self.harness_wait_max_s else "",
            f"harness_wait_multiplier_s must be >= 0, got {self.harness_wait_multiplier_s}"
            if self.harness_wait_multiplier_s < 0 else "",
            f"session_time_limit_s must be None or > 0, got {self.session_time_limit_s}"
            if self.session_time_limit_s is not None and not self.session_time_limit_s > 0 else "",
        ]
        errors = [p for p in problems if p]
        if errors:
            raise ClientError("ClientPolicy: " + "; ".join(errors))

    @property
    def attempts_per_call(self) -> int:
        """Attempts of one call before the session is abandoned."""
        return self.harness_attempts * (1 + self.max_retries)


def client_backoff_s(policy: ClientPolicy, retries_taken: int, u: float) -> float:
    """The API client's wait before its retry after `retries_taken` retries, for a uniform draw `u`."""
    if retries_taken < 0 or not 0 <= u < 1:
        raise ClientError(f"client_backoff_s: need retries_taken >= 0 and 0 <= u < 1, got {retries_taken}, {u}")
    delay = min(policy.backoff_initial_s * 2.0 ** min(retries_taken, 1000), policy.backoff_max_s)
    return delay * (1.0 - policy.backoff_jitter * u)


def harness_wait_s(policy: ClientPolicy, failures: int) -> float:
    """The harness's wait after `failures` failed harness attempts (tenacity's wait_exponential)."""
    if failures < 1:
        raise ClientError(f"harness_wait_s: need failures >= 1, got {failures}")
    wait = policy.harness_wait_multiplier_s * 2.0 ** min(failures - 1, 1000)
    return max(policy.harness_wait_min_s, min(wait, policy.harness_wait_max_s))


def wait_before_attempt_s(policy: ClientPolicy, attempt: int, u: float) -> float | None:
    """Seconds between attempt `attempt - 1` timing out and attempt `attempt` being sent; None: no attempt left."""
    if attempt < 0:
        raise ClientError(f"wait_before_attempt_s: attempt must be >= 0, got {attempt}")
    if attempt == 0:
        return 0.0
    if attempt >= policy.attempts_per_call:
        return None
    harness_attempt, within = divmod(attempt, 1 + policy.max_retries)
    if within > 0:
        return client_backoff_s(policy, within - 1, u)
    return harness_wait_s(policy, harness_attempt)


class SessionSink(Protocol):
    """Where a population's sessions go (the engine)."""

    @property
    def now(self) -> float:
        """The simulated time."""
        ...

    def add(self, spec: SessionSpec) -> None:
        """Schedule a session's arrival."""
        ...


SpecMaker = Callable[[str, Session, float], SessionSpec]  # (session id, pool session, arrival) -> spec


class ClosedPopulation:
    """N agents, each starting its next session from the pool when its current one is over."""

    def __init__(self, num_agents: int, pool: Sequence[Session], rng: random.Random, make_spec: SpecMaker, *,
                 think_time_s: float = 0.0, stop_s: float = math.inf) -> None:
        if num_agents < 1 or not pool or think_time_s < 0:
            raise ClientError(f"ClosedPopulation: need num_agents >= 1, a non-empty pool and think_time_s >= 0, "
                              f"got {num_agents}, {len(pool)} sessions, {think_time_s}")
        self.num_agents = num_agents
        self.think_time_s = think_time_s
        self.stop_s = stop_s
        self.num_started = 0
        self._pool = pool
        self._rng = rng
        self._make_spec = make_spec
        self._agent_of: dict[str, int] = {}  # session id -> agent, while its session is not over
        self._sink: SessionSink | None = None

    @property
    def num_in_flight(self) -> int:
        """Agents whose session has been added and is not over."""
        return len(self._agent_of)

    def start(self, sink: SessionSink, at_s: float) -> None:
        """Add every agent's first session (after one think time each) to `sink`."""
        if self._sink is not None:
            raise ClientError("ClosedPopulation.start called twice")
        self._sink = sink
        for agent in range(self.num_agents):
            self._launch(agent, at_s)

    def session_over(self, run: SessionRun) -> None:
        """The engine's `on_session_over` hook: the agent of an ended session starts its next one."""
        agent = self._agent_of.pop(run.spec.session_id, None)
        if agent is None:
            return  # not one of ours (an open arrival or a burst session)
        assert run.ended_s is not None, f"session {run.spec.session_id!r} reported over without an end time"
        self._launch(agent, run.ended_s)

    def _launch(self, agent: int, after_s: float) -> None:
        assert self._sink is not None
        think_s = self._rng.expovariate(1.0 / self.think_time_s) if self.think_time_s > 0 else 0.0
        arrival_s = after_s + think_s
        if arrival_s >= self.stop_s:
            return
        base = self._pool[self._rng.randrange(len(self._pool))]
        session_id = f"c{self.num_started:06d}:{base.session_id}"
        self.num_started += 1
        self._agent_of[session_id] = agent
        self._sink.add(self._make_spec(session_id, base, max(arrival_s, self._sink.now)))

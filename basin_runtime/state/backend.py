"""`StateBackend`: the seam under the waiting room; `InProcessBackend`, the embedded default.

Rules:
- The waiting room hands a backend `Step`s and hears of every step applied (its own and, with a shared
  backend, every other replica's) through one listener, called synchronously in the order the steps
  apply; `step` then returns the step's events (or raises its `PolicyError`).
- `submit` is for steps whose caller needs no answer (a call's observe, a revision): in process they
  apply at once (exactly as `step`); a shared backend sends them without waiting.
- The `StateBackend` Protocol declares everything the gateway asks of a backend, `replicated` (the shared
  session owners and orphans, None in process) included: nobody reaches around it.
- `InProcessBackend` is the embedded default: the local `Policy`, the caller's clock, nothing shared;
  a step applies to it at once, in the caller's own task.
- A shared backend that cannot reach its store raises `StateUnavailableError` from `step`: the gateway
  answers 503 `state_unavailable` for what needs a decision (a new session), and keeps serving what
  was decided (admitted sessions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from basin_runtime.policy import Event, Policy
from basin_runtime.state.replica import Applied, ReplicatedState, held_changes
from basin_runtime.state.steps import Step, apply_step

Listener = Callable[[Applied], None]
LOCAL_REPLICA = "local"


class StateUnavailableError(Exception):
    """The shared state cannot be reached (or is being rebuilt); carries the reason a client reads."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass
class StateHooks:
    """What the backend tells the gateway's metrics: up/down, errors by kind, step latency, dropped steps."""

    on_up: Callable[[bool], None] = lambda is_up: None
    on_error: Callable[[str], None] = lambda kind: None
    on_step_latency: Callable[[float], None] = lambda seconds: None
    on_dropped: Callable[[int], None] = lambda count: None
    on_apply_lag: Callable[[float], None] = lambda seconds: None  # another replica's step: its stamp to applied here


class StateBackend(Protocol):
    """Where the waiting room's policy steps are applied."""

    replica_id: str
    is_shared: bool  # several replicas share the state (steps from elsewhere apply too)
    is_up: bool  # the state can be reached (always, in process)

    @property
    def policy(self) -> Policy:
        """The policy core (the local one, or this replica's copy of the shared one)."""
        ...

    @property
    def is_leader(self) -> bool:
        """True if this replica does the deployment's periodic work (ticks) now."""
        ...

    @property
    def num_pending(self) -> int:
        """Steps made and not yet applied (0 in process)."""
        ...

    @property
    def replicated(self) -> ReplicatedState | None:
        """Shared only: this replica's copy of the replicated state (session owners, orphans); None in process."""
        ...

    def bind(self, listener: Listener, on_reset: Callable[[bool], None] | None = None) -> None:
        """Hear of every step applied, in order (and, shared, of every reload of the state: True if the store
        had lost it)."""
        ...

    async def step(self, step: Step) -> list[Event]:
        """Apply `step`; its events. `PolicyError` if illegal, `StateUnavailableError` if the state is out of reach."""
        ...

    def submit(self, step: Step) -> None:
        """Apply `step` without waiting for it (its outcome reaches the listener)."""
        ...


class InProcessBackend:
    """The local policy, stepped at once with the caller's `now`."""

    is_shared = False
    is_leader = True
    is_up = True
    num_pending = 0
    replica_id = LOCAL_REPLICA
    replicated = None  # nothing is shared

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._listener: Listener | None = None
        self._counter = 0

    @property
    def policy(self) -> Policy:
        """The local policy."""
        return self._policy

    def bind(self, listener: Listener, on_reset: Callable[[bool], None] | None = None) -> None:
        """Hear of every step applied (the state is never reloaded in process: `on_reset` is not called)."""
        self._listener = listener

    async def step(self, step: Step) -> list[Event]:
        """Apply `step` now (no await inside: the caller's critical section stays whole)."""
        return self.apply(step)

    def submit(self, step: Step) -> None:
        """Apply `step` now."""
        self.apply(step)

    def apply(self, step: Step) -> list[Event]:
        """Run the step on the policy, tell the listener, return its events (`PolicyError` changes nothing)."""
        events = apply_step(self._policy, step, step.now)
        self._counter += 1
        if self._listener is not None:
            entered, left = held_changes(step, events)
            self._listener(Applied(step, LOCAL_REPLICA, self._counter, step.now, tuple(events), entered=entered,
                                   left=left))
        return events

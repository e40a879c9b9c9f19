"""The session lifecycle: one vocabulary and one transition table, checked in one place.

The policy core, the simulator and the gateway move a session's state only through `transition`.

Rules:
- States: `arriving` (known, not at the door yet: a simulated session before its arrival time);
  `queued` (at the door, waiting for admission; the simulator's "held at the door"); `live`
  (admitted, not ended); and the final states, named for how the session ended: `finished` (its last
  call answered), `killed` (by the scenario), `shed` (by the policy: while queued, never admitted; or
  live, held by recovery past its bounded hold while capacity is truly short, `recovery.py`),
  `aborted` (a call larger than an instance's memory), `abandoned` (its client gave up), `ended` (over
  for a reason its driver knows and the step does not say: the policy core's `finish`).
- A session the policy holds is queued or live (`HeldState`); a final state never changes again.
- An arrival is queued, then admitted at once when admission is not engaged; an adopted session
  (running elsewhere) is live at once; a live session whose call outgrew its reservation may be
  requeued.
- `transition(state, event)` is the state `event` takes a session in `state` to; an event the table
  does not allow raises `LifecycleError` naming both, and the caller changes nothing. A driver that
  keeps only held sessions (the gateway) moves them with `held_transition`, the same check.
- Pure: no I/O, stdlib only.
"""

from __future__ import annotations

from typing import Literal

from basin_runtime.policy.config import PolicyError

SessionState = Literal["arriving", "queued", "live", "finished", "killed", "shed", "aborted", "abandoned", "ended"]
HeldState = Literal["queued", "live"]
LifecycleEvent = Literal["arrive", "adopt", "admit", "requeue", "shed", "finish", "kill", "abort", "abandon", "end"]

TRANSITIONS: dict[tuple[SessionState, LifecycleEvent], SessionState] = {
    ("arriving", "arrive"): "queued",
    ("arriving", "adopt"): "live",
    ("queued", "admit"): "live",
    ("live", "requeue"): "queued",
    ("queued", "shed"): "shed",
    ("live", "shed"): "shed",
    ("live", "finish"): "finished",
    ("live", "abort"): "aborted",
    ("queued", "kill"): "killed",
    ("live", "kill"): "killed",
    ("queued", "abandon"): "abandoned",
    ("live", "abandon"): "abandoned",
    ("queued", "end"): "ended",
    ("live", "end"): "ended",
}
FINAL_STATES: frozenset[SessionState] = frozenset({"finished", "killed", "shed", "aborted", "abandoned", "ended"})


class LifecycleError(PolicyError):
    """A step the session lifecycle does not allow from the session's state."""


def transition(state: SessionState, event: LifecycleEvent) -> SessionState:
    """The state `event` takes a session in `state` to; `LifecycleError` if the table does not allow it."""
    after = TRANSITIONS.get((state, event))
    if after is None:
        allowed = sorted(e for s, e in TRANSITIONS if s == state)
        raise LifecycleError(f"a session in state {state!r} cannot {event!r} "
                             f"(from {state!r}: {', '.join(allowed) or 'nothing, it is over'})")
    return after


def held_transition(state: HeldState, event: Literal["admit", "requeue"]) -> HeldState:
    """`transition` between the held states (queued to live, live to queued), typed for a driver that keeps only
    held sessions."""
    return "live" if transition(state, event) == "live" else "queued"

"""`ReplicatedState`: the policy core and the shared session ownership, moved by sequenced entries.

The replicated state: the policy core plus what replicas share about sessions, moved only by
sequenced steps. Every replica holds one and applies the same entries in the same order, so every
replica holds the same state (the core is deterministic given its steps and their `now`). No I/O.

Rules:
- An entry is (stream id, sequence number n, the sequencer's clock in microseconds, the replica that
  made it, its encoded step). Entries apply in stream order, each exactly once: n must follow the last
  one applied (a gap raises `StreamGapError`: reload a snapshot), and a replica's steps carry a
  counter, so a step sent twice (a reply lost, the batch resent) is skipped the second time.
- Time: a step without its own `now` runs at the sequencer's clock, never earlier than the last
  `now` the core saw (the clock is clamped, so a clock stepping back cannot make a step illegal).
- Core steps go through `steps.apply_step`. An illegal step (the core raises `PolicyError`) is kept in
  the stream and changes nothing on any replica; its maker gets the error back.
- Ownership: the replica that made a session's `arrive` or `adopt` holds it; `claim` moves a held
  (live or queued) session to the claiming replica (its client reconnected there). `finish` and a
  `Shed` forget it.
- `reap [dead replicas, orphan window]` (the leader's, or a replica's own at shutdown): every live
  session held by a dead replica, or by nobody, is finished (its reservation returns) and kept as an
  orphan (peak, multiplier, context, since when); a queued one keeps its place, held by nobody, until
  it is claimed or admitted (then reaped). Orphans older than the window are forgotten. An orphan's
  next call through any replica is adopted (never queued); an `arrive` or `adopt` of its id ends it.
- Priority order is the core's: `Applied.entered` / `left` tell a driver which sessions joined or
  left the held set, so it can rank every held session, not only its own (engine priority levels).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from basin_runtime.policy import ClockError, Event, Policy, PolicyError, Shed, UnknownSessionError
from basin_runtime.state.steps import Step, apply_step, decode_step

STATE_FORMAT = "basin-replicated-state"
STATE_VERSION = 1


class StreamGapError(PolicyError):
    """An entry does not follow the last one applied (entries were trimmed away): reload a snapshot."""


@dataclass(frozen=True)
class Entry:
    """One sequenced step as the stream holds it."""

    entry_id: str
    n: int
    clock_us: int
    replica: str
    payload: str


@dataclass(frozen=True)
class Orphan:
    """A live session let go when its replica died: adopted by the next replica it calls through."""

    predicted_peak_tokens: float
    reservation_multiplier: float
    context_tokens: int
    since_s: float


@dataclass(frozen=True)
class Applied:
    """What applying one step did: its events or its error, and who joined or left the held set."""

    step: Step
    replica: str
    counter: int
    now: Any
    events: tuple[Event, ...] = ()
    error: PolicyError | None = None
    entered: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    claimed_from: str | None = None  # a `claim`: the replica that held the session before
    reaped: tuple[str, ...] = ()  # a `reap`: the live sessions let go (now orphans)
    is_duplicate: bool = False


def held_changes(step: Step, events: list[Event]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(entered, left): sessions a successful core step added to or removed from the held set."""
    entered = (step.session_id,) if step.kind in ("arrive", "adopt") and step.session_id is not None else ()
    left = [e.session_id for e in events if isinstance(e, Shed)]
    if step.kind == "finish" and step.session_id is not None:
        left.insert(0, step.session_id)
    return entered, tuple(left)


class ReplicatedState:
    """The policy core and session ownership; `apply` one entry at a time, in stream order."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.owners: dict[str, str] = {}  # held session -> replica; absent: held by nobody (its replica died)
        self.orphans: dict[str, Orphan] = {}
        self.counters: dict[str, int] = {}  # replica -> counter of its last step applied
        self.n = 0
        self.entry_id = "0-0"

    def apply(self, entry: Entry) -> Applied:
        """Apply the next entry; `StreamGapError` (nothing changed) if it does not follow the last one."""
        if entry.n != self.n + 1:
            raise StreamGapError(f"entry {entry.entry_id} is number {entry.n}; the next to apply is {self.n + 1}")
        self.n, self.entry_id = entry.n, entry.entry_id
        try:
            step, counter = decode_step(entry.payload)
        except PolicyError as exc:
            return Applied(Step("tick", None), entry.replica, 0, None, error=exc)
        if counter <= self.counters.get(entry.replica, 0):
            return Applied(step, entry.replica, counter, None, is_duplicate=True)
        self.counters[entry.replica] = counter
        now = step.now if not step.is_stamped else self._clamped(entry.clock_us / 1e6)
        try:
            return self._apply(step, entry.replica, counter, now)
        except PolicyError as exc:
            return Applied(step, entry.replica, counter, now, error=exc)

    def _clamped(self, now: float) -> float:
        last = self.policy.now_s
        return now if last is None else max(now, last)

    def _apply(self, step: Step, replica: str, counter: int, now: Any) -> Applied:
        sid = step.session_id
        if step.kind == "claim":
            assert sid is not None
            self.policy.state_of(sid)  # UnknownSessionError unless held
            before = self.owners.get(sid)
            self.owners[sid] = replica
            return Applied(step, replica, counter, now, claimed_from=before)
        if step.kind == "reap":
            return self._reap(step, replica, counter, now)
        events = apply_step(self.policy, step, now)
        entered, left = held_changes(step, events)
        if sid is not None and step.kind in ("arrive", "adopt"):
            self.owners[sid] = replica
            self.orphans.pop(sid, None)
        for gone in left:
            self.owners.pop(gone, None)
        return Applied(step, replica, counter, now, tuple(events), entered=entered, left=left)

    def _reap(self, step: Step, replica: str, counter: int, now: Any) -> Applied:
        dead, window_s = step.args
        if not isinstance(dead, list) or not all(isinstance(r, str) for r in dead):
            raise PolicyError(f"reap: dead replicas must be a list of ids, got {dead!r}")
        if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not window_s >= 0:
            raise PolicyError(f"reap: the orphan window must be seconds >= 0, got {window_s!r}")
        if not isinstance(now, int | float) or not math.isfinite(now):
            raise PolicyError(f"reap: now must be a finite time, got {now!r}")
        last = self.policy.now_s
        if last is not None and now < last:
            raise ClockError(f"reap: now={now!r} runs backwards: the last now seen was {last!r}")
        gone = set(dead)
        victims = [sid for sid in self.policy.snapshot().live if self.owners.get(sid, "") in gone | {""}]
        events: list[Event] = []
        for sid in victims:
            record = self.policy.record_of(sid)
            events.extend(self.policy.finish(sid, now))
            self.owners.pop(sid, None)
            self.orphans[sid] = Orphan(record.predicted_peak_tokens, record.reservation_multiplier,
                                       record.context_tokens, float(now))
        for sid, owner in list(self.owners.items()):
            if owner in gone:
                del self.owners[sid]  # a queued session keeps its place, held by nobody
        for sid, orphan in list(self.orphans.items()):
            if now - orphan.since_s > window_s:
                del self.orphans[sid]
        for replica_id in gone:
            self.counters.pop(replica_id, None)
        return Applied(step, replica, counter, now, tuple(events), left=tuple(victims), reaped=tuple(victims))

    # --- questions ---------------------------------------------------------------------------

    def owner_of(self, session_id: str) -> str | None:
        """The replica holding a live or queued session (None: held by nobody, or not held)."""
        return self.owners.get(session_id)

    def is_held(self, session_id: str) -> bool:
        """True if the core holds the session (live or queued)."""
        return self.policy.is_live(session_id) or self.policy.is_queued(session_id)

    def replicas(self) -> set[str]:
        """Every replica holding a session now."""
        return set(self.owners.values())

    # --- snapshots ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The whole replicated state as JSON-ready data (the policy's own `to_state` inside)."""
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION, "n": self.n, "entry_id": self.entry_id,
            "policy": self.policy.to_state(), "owners": dict(self.owners), "counters": dict(self.counters),
            "orphans": {sid: [o.predicted_peak_tokens, o.reservation_multiplier, o.context_tokens, o.since_s]
                        for sid, o in self.orphans.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ReplicatedState:
        """The state `to_state` wrote; `PolicyError` naming what is wrong."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise PolicyError(f"not a {STATE_FORMAT} record")
        if state.get("version") != STATE_VERSION:
            raise PolicyError(f"{STATE_FORMAT} version {state.get('version')!r} is not {STATE_VERSION}")
        made = cls(Policy.from_state(state["policy"]))
        n, entry_id = state.get("n"), state.get("entry_id")
        if type(n) is not int or n < 0 or not isinstance(entry_id, str):
            raise PolicyError(f"state n / entry_id must be a count and a stream id, got {n!r} / {entry_id!r}")
        made.n, made.entry_id = n, entry_id
        owners, counters, orphans = state.get("owners"), state.get("counters"), state.get("orphans")
        if not (isinstance(owners, dict) and isinstance(counters, dict) and isinstance(orphans, dict)):
            raise PolicyError("state owners, counters and orphans must be mappings")
        for sid, owner in owners.items():
            if not isinstance(owner, str) or not made.is_held(sid):
                raise UnknownSessionError(f"state owners: {sid!r} -> {owner!r} is not a held session and a replica")
        made.owners = dict(owners)
        if not all(type(c) is int and c >= 0 for c in counters.values()):
            raise PolicyError(f"state counters must be counts, got {counters!r}")
        made.counters = dict(counters)
        try:
            made.orphans = {sid: Orphan(float(o[0]), float(o[1]), int(o[2]), float(o[3])) for sid, o in orphans.items()}
        except (TypeError, ValueError, IndexError) as exc:
            raise PolicyError(f"state orphans: {exc}") from None
        return made

"""The records the engine keeps of each session and each request in flight.

A session: arrives at the door -> queued (the policy said wait) or live -> each call in turn -> ends
as finished, killed (by the scenario), shed (by the policy while queued), aborted (a request larger
than an instance's memory) or abandoned (its client gave up: a call's attempts all timed out, or its
session time limit passed; agents.py). The states and the steps between them are the policy core's
(basin_runtime/policy/lifecycle.py): a status moves only by `Status.after`, through its table.
A request (one attempt of one call): PREALLOC (waits for decode memory) -> PREFILL_WAIT ->
PREFILLING -> TRANSFER (KV to decode) -> DECODING -> done; then the tool gap, then the next call.
A timed-out attempt is aborted (`is_aborted`) and the call is sent again later as a new request
(`attempt` + 1).

Rules: a session has at most one request in flight (an aborted one still finishing its prefill
batch is not its request any more); once ended it never changes again (the table has no step out).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from basin_runtime.policy.lifecycle import LifecycleEvent, SessionState, transition
from basin_runtime.session_table import Session
from basin_sim.decode import DecodeInstance, DecodeSlot
from basin_sim.prefill import PrefillInstance, PrefillJob


class Status(enum.Enum):
    """Where a session is in its life: the policy core's states (its `ended` aside: the engine knows why)."""

    _value_: SessionState
    ARRIVING = "arriving"
    QUEUED = "queued"
    LIVE = "live"
    FINISHED = "finished"
    KILLED = "killed"
    SHED = "shed"
    ABORTED = "aborted"
    ABANDONED = "abandoned"

    def after(self, event: LifecycleEvent) -> Status:
        """The status `event` takes a session in this one to; `LifecycleError` naming both if it may not."""
        return Status(transition(self.value, event))


class Stage(enum.Enum):
    """Where a request is on its way through the deployment."""

    PREALLOC = "prealloc"
    PREFILL_WAIT = "prefill_wait"
    PREFILLING = "prefilling"
    TRANSFER = "transfer"
    DECODING = "decoding"


@dataclass(frozen=True)
class SessionSpec:
    """A session as the workload hands it to the engine."""

    session_id: str
    session: Session
    arrival_s: float
    group_key: str  # the shared system prompt it starts with (one per benchmark)
    group_tokens: int
    gaps_s: tuple[float, ...]  # tool time after each call but the last
    is_burst: bool = False

    def __post_init__(self) -> None:
        if len(self.gaps_s) != self.session.n_calls - 1:
            raise ValueError(f"session {self.session_id!r}: {len(self.gaps_s)} gaps for {self.session.n_calls} calls")
        if self.group_tokens > self.session.first_prompt_tokens:
            raise ValueError(f"session {self.session_id!r}: shared prefix {self.group_tokens} is longer than its "
                             f"first prompt {self.session.first_prompt_tokens}")


@dataclass(slots=True, eq=False)
class Request:
    """One call in flight."""

    request_id: int
    run: SessionRun
    sent_s: float
    prefill: PrefillInstance
    decode: DecodeInstance
    job: PrefillJob
    slot: DecodeSlot
    stage: Stage = Stage.PREALLOC
    attempt: int = 0  # 0: the call's first attempt
    is_aborted: bool = False  # withdrawn (killed, timed out, given up); never answered


@dataclass(slots=True, eq=False)
class SessionRun:
    """The engine's mutable record of one session."""

    spec: SessionSpec
    status: Status = Status.ARRIVING
    admitted_s: float | None = None
    ended_s: float | None = None
    next_call: int = 0
    context_tokens: int = 0
    steps: float = 0.0
    good_steps: float = 0.0
    request: Request | None = None
    attempt: int = 0  # attempt of the current call (0: the first)
    timeouts: int = 0  # attempts of this session that timed out
    retries: int = 0  # attempts of this session sent after a timeout
    call_sent_s: float | None = None  # when the current call's first attempt was sent
    first_token_s: float | None = None  # when the first token of the session's first call reached decode
    parked: bool = False  # suspended by the policy: its current call waits at the door until resumed

    @property
    def is_over(self) -> bool:
        """True once the session ended in any way."""
        return self.status in _OVER


_OVER = frozenset({Status.FINISHED, Status.KILLED, Status.SHED, Status.ABORTED, Status.ABANDONED})

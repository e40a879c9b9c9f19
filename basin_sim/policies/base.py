"""The seam between the engine and a session policy (what a gateway in front of SGLang decides).

Rules:
- The engine calls the policy on every session arrival (admit now, or hold the session at the door),
  on every call's prompt size (every attempt), on every session end (finished, killed, aborted or
  abandoned, live or held; not a shed: that is the policy's own decision), and on a periodic tick with
  the recent prefix-cache hit rate and first-token latency. It asks the priority of every request it
  queues for decode memory and for prefill: smaller is served first.
- Every call is answered with `Decisions`: held sessions to admit now (they start their first call
  at once; the arriving session itself is held until its own arrival admits it), and held sessions
  to shed (they fail); live sessions to suspend (their next call, or the call being sent now, waits
  at the door: it is not sent until they are resumed; their context stays in the working set), and
  suspended sessions to resume (a waiting call is sent then; its wait counts in its TTFT); of the sessions
  suspended, those whose engine session is closed while they wait (`close`: once their call is parked at
  their tool boundary, their session radix cache references are dropped, so their KV is evictable like any
  unreferenced prefix; Basin's recovery). A live session may be shed too (Basin's recovery, a hold that ran
  out): it ends at once, its parked call never sent. Admitting
  or shedding a session that is not held, suspending one that is not live, or resuming one that is
  not suspended is an error the engine reports.
- `on_arrival` is handed the whole recorded session (the simulator has it); a policy that stands for
  a real gateway reads only what the gateway sees at the first call: `task_text` and the first
  prompt's size. Anything else (the real peak, later calls) is an oracle and must say so in its name.
- A policy that pins a session's KV between calls (Continuum) offers a `PinRule` as `pins` (None for
  every other policy): the engine asks it, at every answer, how long to hold that call's KV on prefill,
  and tells it when each call is scheduled (its prefill starts). A `WaitingPinRule` is also asked, when
  a hold's TTL has passed, whether it must stay (the session's next call waits).
- A policy that follows each call to its answer (ThunderAgent's `after_request`) is also an
  `AnswerListener`: the engine tells it every answered call's prompt and completion size, before the
  client's tool time starts (or the session finishes), and applies its `Decisions` then. Every other
  policy hears of no answer.
- A policy with its own periodic scheduler (ThunderAgent's tick) is also a `PolicyScheduler`: the
  engine calls `on_schedule` every `scheduler_interval_s` from the start, whether its own ticks are on
  or not, and applies its `Decisions`. Every other policy is not scheduled.
- A policy that steers by the engines' KV usage (Concur's control loop) is also a `CacheController`: at
  every tick, after `on_tick`, the engine calls `on_control` with the same hit rate and the decode
  instances' KV usage (SGLang's "token usage": KV held by requests, evictable cache excluded, over the
  memory), and applies its `Decisions`. Every other policy hears no usage.
- Every policy reports what it did over the run (`report()`, for run_summary.py): Basin its reservations,
  Continuum its pins, ThunderAgent its pauses, Concur its admission window, the others nothing (`NO_REPORT`).
- A policy does no I/O and reads time only from `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from basin_runtime.policy.calibrated import Calibration
from basin_runtime.session_table import Session
from basin_runtime.task_memory import Shrinkage
from basin_sim.profile import Deployment


class UnknownPolicyError(ValueError):
    """No policy is registered under the name asked for."""


@dataclass(frozen=True)
class Decisions:
    """Held sessions to admit now and to shed; live sessions to suspend at their next call, and to resume."""

    admit: tuple[str, ...] = ()
    shed: tuple[str, ...] = ()
    suspend: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()
    close: tuple[str, ...] = ()  # of `suspend`: their engine session is closed once their call is parked


NO_DECISIONS = Decisions()


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may know about the deployment it guards, and what the operator measured of it.

    `predicted_peak_tokens` maps a pool session's id (`Session.session_id`) to its predicted peak,
    made from what the gateway sees at the first call only (`task_text`, first prompt size).
    `reservation_multipliers` maps a pool session's id to m(q), the multiplier of the predictor file
    for its benchmark at the run's reservation quantile (empty: the bare prediction); a session
    reserves `reservation_scale` x m(q) x its predicted peak (`reservation_scale`: an extra factor
    for ablations, 1 by default). `revisions` holds the online re-estimates (`predictions.online_revisions`)
    a Basin policy applies at the calls they name. `calibration` is what
    the operator measured (the gateway's calibration file; None: nothing measured, the knee taken as
    the cache capacity), `policy_overrides` any `PolicyConfig` fields set by hand (the gateway
    config's `policy:` section). `pin_ttl_s` is a fixed TTL for every Continuum pin (None: Continuum's own
    rule, measured online).
    """

    deployment: Deployment
    predicted_peak_tokens: Mapping[str, float] = field(default_factory=dict)
    reservation_scale: float = 1.0
    calibration: Calibration | None = None
    reservation_multipliers: Mapping[str, float] = field(default_factory=dict)
    # pool session id -> call k -> (re-estimated peak, m_k(q)): Basin revises the reservation at call k
    revisions: Mapping[str, Mapping[int, tuple[float, float]]] = field(default_factory=dict)
    policy_overrides: Mapping[str, Any] = field(default_factory=dict)
    latency_gate: bool = False  # basin: the calibration's latency gate (beyond the paper; `policy_config`)
    pin_ttl_s: float | None = None
    # basin: the memory of finished tasks with the pipeline's k (policies/task_memory.py); None: off
    task_memory: Shrinkage | None = None


@dataclass(frozen=True)
class ReservationReport:
    """Basin's reservations: sessions admitted, those that outgrew their first reservation, revisions applied."""

    sessions_admitted: int
    sessions_overflowed: int
    revisions: int


@dataclass(frozen=True)
class RecoveryReport:
    """Basin's recovery at tool boundaries: holds, sessions ever held, resumes (the hit rate back, or the hold
    ran out), sheds after a hold, and the time held: in all and the mean per hold ended (None: none ended)."""

    recovery_holds: int
    recovery_sessions_held: int
    recovery_resumes: int
    recovery_resumes_bounded: int
    recovery_sheds: int
    recovery_hold_time_total_s: float
    recovery_hold_time_mean_s: float | None


@dataclass(frozen=True)
class TaskMemoryReport:
    """Basin's memory of finished tasks: sessions told a peak, and those whose task it remembered (hits)."""

    task_memory_sessions: int
    task_memory_hits: int


@dataclass(frozen=True)
class PinReport:
    """Continuum's pins: answers, the share pinned, the mean TTL, the share of tool time pinned, the mean T the
    choices read, eta at the end, evicted re-entries measured (None: nothing to average)."""

    pin_answers: int
    pin_answer_share: float | None
    pin_ttl_mean_s: float | None
    pin_tool_time_share: float | None
    pin_queue_delay_s: float | None
    pin_eta: float | None
    pin_evicted_reentries: int


@dataclass(frozen=True)
class FixedTtlReport:
    """Continuum's public code beyond `PinReport`: the share of answers not pinned because their tool's mean gap
    exceeded the fixed TTL, and the mean time a pin was held (past its TTL while the next call waited, included)."""

    pin_slow_tool_share: float | None
    pin_held_mean_s: float | None


@dataclass(frozen=True)
class PauseReport:
    """ThunderAgent's pauses: running programs paused (idle ones at a tick, marked ones at their answer), REASONING
    programs marked, new programs held at the door, resumes by the greedy pass and forced by the timeout,
    soft-demote windows set (one per program per tick), programs ever paused or held, and their time paused
    or held: in all, and the mean per such program (None: none)."""

    pauses: int
    pause_marks: int
    pause_new_held: int
    pause_resumes: int
    pause_forced_resumes: int
    pause_soft_demote_windows: int
    pause_programs: int
    pause_time_total_s: float
    pause_time_mean_s: float | None


@dataclass(frozen=True)
class AdmissionReport:
    """Concur's admission window: W's min, mean and max over its per-minute series (W at each engine minute's
    end), the additive increases and multiplicative decreases, the sessions deferred at the door and their
    wait there, in all and the mean (None: none deferred)."""

    admission_window_min: int
    admission_window_mean: float
    admission_window_max: int
    admission_window_per_minute: tuple[int, ...]
    admission_increases: int
    admission_decreases: int
    admission_deferred: int
    admission_wait_total_s: float
    admission_wait_mean_s: float | None


@dataclass(frozen=True)
class PolicyReport:
    """What a policy did over a run: its reservations (Basin), its pins (Continuum) and what the fixed-TTL pins
    did beyond them (Continuum's public code), its pauses (ThunderAgent), its admission window (Concur); None
    where it has none."""

    reservations: ReservationReport | None = None
    pins: PinReport | None = None
    fixed_ttl: FixedTtlReport | None = None
    pauses: PauseReport | None = None
    admission: AdmissionReport | None = None
    recovery: RecoveryReport | None = None  # Basin's, with its recovery on
    task_memory: TaskMemoryReport | None = None  # Basin's, with the memory on


NO_REPORT = PolicyReport()


class PinRule(Protocol):
    """How long prefill holds a session's KV after each answer, and what it learns from the engine."""

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        """A call of the session was answered (its context: prompt + answer); seconds to hold it (0: not at all)."""
        ...

    def on_scheduled(self, session_id: str, now: float) -> None:
        """A call of the session was scheduled: its prefill starts now."""
        ...


@runtime_checkable
class WaitingPinRule(PinRule, Protocol):
    """A pin rule whose expired pin stays while the session's next call waits (Continuum's public code)."""

    def keeps_pin(self, session_id: str) -> bool:
        """True while the session's hold must outlive its TTL."""
        ...


@runtime_checkable
class AnswerListener(Protocol):
    """A policy that hears every answered call (see the rules at the top of this module)."""

    def on_answer(self, session_id: str, now: float, prompt_tokens: int, completion_tokens: int) -> Decisions:
        """A call of the session was answered: its prompt and completion sizes."""
        ...


@runtime_checkable
class PolicyScheduler(Protocol):
    """A policy with its own periodic scheduler (see the rules at the top of this module)."""

    scheduler_interval_s: float

    def on_schedule(self, now: float) -> Decisions:
        """The scheduler's turn, every `scheduler_interval_s`."""
        ...


@runtime_checkable
class CacheController(Protocol):
    """A policy steered by the hit rate and the KV usage at every tick (see the rules at the top of this module)."""

    def on_control(self, now: float, hit_rate: float | None, kv_usage: float) -> Decisions:
        """The control step: the windowed hit rate (None: too few calls) and the decode KV usage in [0, 1]."""
        ...


class SessionPolicy(Protocol):
    """A gateway's decisions about sessions; see the rules at the top of this module."""

    name: str
    pins: PinRule | None  # prefill holds a session's chain between calls by this rule (Continuum); None: never

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """A session arrives; admitting it now is a decision like any other (else it is held at the door)."""
        ...

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """A call of an admitted session is sent with this prompt size."""
        ...

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """An admitted session ended, or a held one was withdrawn."""
        ...

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Time passes; `hit_rate` is the prefix-cache hit rate of the last window (None: no prefill), `ttft_s`
        the engines' windowed median time to first token, calls still waiting counted (None: too few calls)."""
        ...

    def priority(self, session_id: str, now: float) -> float:
        """The priority of the session's request sent at `now`; smaller is served first."""
        ...

    def report(self) -> PolicyReport:
        """What the policy did so far (`NO_REPORT` for a policy with nothing to say)."""
        ...


@dataclass(frozen=True)
class PolicySpec:
    """A registered policy: its name, what it is, whether it needs a host tier, and how to build it."""

    name: str
    description: str
    uses_host_tier: bool
    factory: Callable[[PolicyContext], SessionPolicy]

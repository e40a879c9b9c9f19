"""`thunderagent`: ThunderAgent's program scheduler as Dynamo's `dynamo.thunderagent_router` implements it.

Rules (docs/evaluation/field-sources.md section 1; every default is `ThunderAgentConfig`'s):
- A program is a session. A call's send (`on_call`, every attempt) makes it REASONING, its working set
  `token_total` the call's prompt, and counts a step; the call's answer (`on_answer`) makes it ACTING,
  idle from then, with token_total = that call's prompt + completion. A new program's first call is
  counted at its arrival.
- used = the sum over ACTIVE (not paused) programs of token_total (ACTING ones weighted by
  ACTING_TOKEN_WEIGHT) + BUFFER_PER_PROGRAM each; util = used / capacity.
- Tick, every SCHEDULER_INTERVAL_S (the engine runs it as a `PolicyScheduler`; the engine's own
  policy ticks move nothing), in order: forced resumes; ACTING programs idle longer than
  PROGRAM_IDLE_TTL_S expire (they are forgotten; a next call makes them a new program); soft demotes;
  greedy resume; pause. A program paused at a tick cannot resume before the next.
- Soft demote: with SOFT_DEMOTE_THRESHOLD <= util < PAUSE_THRESHOLD, every active program not marked
  gets a window until now + 1.5 x the scheduler interval; a request sent inside it is ordered later
  by SOFT_DEMOTE_JUMP_S. Queue order only: nothing is held or evicted.
- Pause, when used > PAUSE_THRESHOLD x capacity: while used > PAUSE_TARGET x capacity, the smallest
  (token_total) ACTING program not marked is paused (its tokens leave used); once none is left,
  the smallest REASONING program not marked is marked, until none is left. A marked program pauses at
  its answer. Only ACTING programs are paused at once; a REASONING one is never preempted.
- Paused: the program's next call is held at the door (the engine parks it: `Decisions.suspend`)
  until it is resumed. Pausing is logical: the engine keeps its KV, evictable as any unreferenced
  prefix; nothing is evicted by the policy.
- A new program is held at the door (paused, step 1) when any program is paused, or when
  capacity - used < max(buffer, its first prompt + buffer); else it is admitted.
- Greedy resume: the paused programs in groups (0: a call waiting and step > 1; 1: new, step <= 1;
  2: idle ACTING), ascending token_total within a group, ties the oldest paused first; headroom =
  int(capacity x (PAUSE_THRESHOLD - RESUME_HYSTERESIS)) - used, nothing if <= buffer; each program is
  taken while the taken ones' token_total + buffer still fit it. The taken ones are placed largest first.
- A resumed program whose call waited sends it ordered earlier by RESUME_PRIORITY_BOOST_S. A program
  held RESUME_TIMEOUT_S with a call waiting (a new one: since its arrival) is resumed at the next tick
  whatever the capacity (forced).
- Priority of a request = its send time - the jumps above (smaller is served first).
- Report (`PauseReport`): pauses, marks, new programs held, resumes, forced resumes, soft-demote
  windows, programs ever paused or held and their time so (total and mean per such program).
Assumptions (PD and the simulator; field-sources.md section 5):
- Assumption: one token "replica" = every prefill instance's KV plus its HiCache host tier
  (`Deployment.cache_capacity_tokens + host_capacity_tokens`; option (c)): the prefill tree is where
  cross-turn reuse lives in SGLang PD. Dynamo's plugin serves aggregated deployments only; this PD
  reading is ours. With one replica, placement (Dynamo's per-worker headroom) has nothing to choose,
  and neither has the decayed ACTING view (tau 1 s), which Dynamo uses only to rank replicas.
- Assumption: the count dimension (REASONING programs / decode `max_running_requests`) is off: the
  model's decode has no `max_running_requests` (its requests are bounded by decode memory).
- Assumption: the simulator has no router-side queue; the priority jumps order the engine's queues
  (decode memory and prefill), which smaller priorities are served first in.
- Assumption: a forced resume comes at the first tick at or after its timeout (Dynamo's comes at the
  timeout itself, between ticks).
- Assumption: output tokens streamed during a turn are not seen (a REASONING program counts its prompt
  until the answer), and admission is not cache-aware (Dynamo's `worker_cached_tokens` unset).
- A policy does no I/O and reads time only from `now`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    Decisions,
    PauseReport,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)

PAUSE_THRESHOLD = 0.95
SOFT_DEMOTE_THRESHOLD = 0.80
SOFT_DEMOTE_JUMP_S = 2.0  # Dynamo's priority_jump -2.0 s: later in the queue
RESUME_PRIORITY_BOOST_S = 1.0  # Dynamo's +1.0 s: earlier in the queue
RESUME_TIMEOUT_S = 1800.0
SCHEDULER_INTERVAL_S = 5.0
RESUME_HYSTERESIS = 0.10
PAUSE_TARGET = 0.80
ACTING_TOKEN_WEIGHT = 1.0
BUFFER_PER_PROGRAM = 100
PROGRAM_IDLE_TTL_S = 600.0
SOFT_DEMOTE_WINDOW_S = 1.5 * SCHEDULER_INTERVAL_S


class Status(enum.Enum):
    """A program's turn: a call out (REASONING) or its tool running (ACTING)."""

    REASONING = "reasoning"
    ACTING = "acting"


@dataclass
class Program:
    """One session as ThunderAgent keeps it."""

    token_total: int
    status: Status = Status.REASONING
    step_count: int = 1
    admitted: bool = False  # False: held at the door (a new program), never sent a call
    first_call_pending: bool = False  # its first call was counted at its arrival and is still to come
    paused_since_s: float | None = None  # None: ACTIVE
    waiting_since_s: float | None = None  # a call (or a new program) held since then
    marked: bool = False
    acting_since_s: float = 0.0
    soft_demoted_until_s: float = float("-inf")
    boost_next: bool = False  # its next request is a resumed one

    @property
    def paused(self) -> bool:
        """Held (PAUSED), not ACTIVE."""
        return self.paused_since_s is not None

    def tokens(self) -> float:
        """What it counts in used (buffer aside)."""
        weight = ACTING_TOKEN_WEIGHT if self.status == Status.ACTING else 1.0
        return self.token_total * weight


class ThunderAgentPolicy:
    """Pause the smallest idle programs over 95 % of the KV budget, down to 80 %; resume smallest first under 85 %."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"thunderagent capacity_tokens must be > 0, got {capacity_tokens!r}")
        self.name = "thunderagent"
        self.scheduler_interval_s = SCHEDULER_INTERVAL_S
        self.pins: PinRule | None = None
        self.capacity_tokens = capacity_tokens
        self.programs: dict[str, Program] = {}
        self.paused: dict[str, None] = {}  # paused programs, in the order they were paused
        self._pauses = self._marks = self._new_held = self._resumes = self._forced = self._windows = 0
        self._paused_ever: set[str] = set()
        self._paused_time_s = 0.0

    # --- what the engine tells ------------------------------------------------------------------

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """A new program: admitted if nobody is paused and it fits, else held at the door."""
        program = Program(session.first_prompt_tokens, first_call_pending=True)
        fits = self._fits_new(program)  # on no replica yet: not in used
        self.programs[session_id] = program
        if fits:
            program.admitted = True
            return Decisions(admit=(session_id,))
        self._hold_new(session_id, program, now)
        return NO_DECISIONS

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """`before_request`: REASONING with the prompt; a paused program's call waits; an expired one is new."""
        program = self.programs.get(session_id)
        if program is None:  # expired while idle: a new program, whose call is held if it must wait
            program = Program(prompt_tokens, admitted=True)
            fits = self._fits_new(program)
            self.programs[session_id] = program
            if fits:
                return NO_DECISIONS
            self._hold_new(session_id, program, now)
            return Decisions(suspend=(session_id,))
        if program.first_call_pending:  # counted at its arrival
            program.first_call_pending = False
            return NO_DECISIONS
        program.token_total, program.status = prompt_tokens, Status.REASONING
        program.step_count += 1
        if program.paused and program.waiting_since_s is None:
            program.waiting_since_s = now
        return NO_DECISIONS

    def on_answer(self, session_id: str, now: float, prompt_tokens: int, completion_tokens: int) -> Decisions:
        """`after_request`: ACTING with the last turn's tokens; a marked program pauses now."""
        program = self.programs.get(session_id)
        if program is None:
            return NO_DECISIONS
        program.token_total, program.status = prompt_tokens + completion_tokens, Status.ACTING
        program.acting_since_s = now
        if not program.marked:
            return NO_DECISIONS
        program.marked = False
        self._pause(session_id, program, now)
        return Decisions(suspend=(session_id,))

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """`end_program`: forget it (its paused time ends)."""
        program = self.programs.pop(session_id, None)
        if program is not None and program.paused:
            self._unpause(session_id, program, now)
        return NO_DECISIONS

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing: the scheduler keeps its own interval (`on_schedule`)."""
        return NO_DECISIONS

    def on_schedule(self, now: float) -> Decisions:
        """The scheduler tick: forced resumes, expiry, soft demotes, greedy resume, pause."""
        resumed = self._forced_resumes(now)
        self._expire(now)
        self._soft_demote(now)
        resumed += self._greedy_resume(now)
        suspend = self._pause_until_safe(now)
        admit = tuple(sid for sid in resumed if not self.programs[sid].admitted)
        for sid in admit:
            self.programs[sid].admitted = True
        resume = tuple(sid for sid in resumed if sid not in admit)
        if not (admit or resume or suspend):
            return NO_DECISIONS
        return Decisions(admit=admit, suspend=suspend, resume=resume)

    def priority(self, session_id: str, now: float) -> float:
        """The send time, later inside a soft-demote window, earlier for a resumed program's waiting call."""
        program = self.programs.get(session_id)
        if program is None:
            return now
        jump = 0.0
        if program.boost_next:
            program.boost_next = False
            jump += RESUME_PRIORITY_BOOST_S
        if program.soft_demoted_until_s > now:
            jump -= SOFT_DEMOTE_JUMP_S
        return now - jump

    def report(self) -> PolicyReport:
        """Pauses, marks, held new programs, resumes, forced resumes, soft-demote windows, time paused."""
        programs = len(self._paused_ever)
        return PolicyReport(pauses=PauseReport(
            pauses=self._pauses, pause_marks=self._marks, pause_new_held=self._new_held,
            pause_resumes=self._resumes, pause_forced_resumes=self._forced,
            pause_soft_demote_windows=self._windows, pause_programs=programs,
            pause_time_total_s=self._paused_time_s,
            pause_time_mean_s=self._paused_time_s / programs if programs else None))

    # --- accounting -----------------------------------------------------------------------------

    def used_tokens(self) -> float:
        """Sum over ACTIVE programs of their tokens + the buffer each."""
        active = [p for p in self.programs.values() if not p.paused]
        return sum(p.tokens() for p in active) + BUFFER_PER_PROGRAM * len(active)

    def _fits_new(self, program: Program) -> bool:
        if self.paused:  # new programs queue behind any paused one
            return False
        required = max(BUFFER_PER_PROGRAM, program.token_total + BUFFER_PER_PROGRAM)
        return self.capacity_tokens - self.used_tokens() >= required

    def _hold_new(self, session_id: str, program: Program, now: float) -> None:
        self._new_held += 1
        program.waiting_since_s = now
        self._set_paused(session_id, program, now)

    def _pause(self, session_id: str, program: Program, now: float) -> None:
        self._pauses += 1
        self._set_paused(session_id, program, now)

    def _set_paused(self, session_id: str, program: Program, now: float) -> None:
        program.paused_since_s = now
        self.paused[session_id] = None
        self._paused_ever.add(session_id)

    def _unpause(self, session_id: str, program: Program, now: float) -> None:
        assert program.paused_since_s is not None
        self._paused_time_s += now - program.paused_since_s
        program.paused_since_s = None
        if program.waiting_since_s is not None:
            program.boost_next = True
            program.waiting_since_s = None
        del self.paused[session_id]

    # --- the tick -------------------------------------------------------------------------------

    def _forced_resumes(self, now: float) -> list[str]:
        forced = [sid for sid in self.paused
                  if (since := self.programs[sid].waiting_since_s) is not None and now - since >= RESUME_TIMEOUT_S]
        for sid in forced:
            self._forced += 1
            self._unpause(sid, self.programs[sid], now)
        return forced

    def _expire(self, now: float) -> None:
        expired = [sid for sid, p in self.programs.items()
                   if not p.paused and p.status == Status.ACTING and now - p.acting_since_s > PROGRAM_IDLE_TTL_S]
        for sid in expired:
            del self.programs[sid]

    def _soft_demote(self, now: float) -> None:
        util = self.used_tokens() / self.capacity_tokens
        if not SOFT_DEMOTE_THRESHOLD <= util < PAUSE_THRESHOLD:
            return
        until = now + SOFT_DEMOTE_WINDOW_S
        for program in self.programs.values():
            if not program.paused and not program.marked and program.soft_demoted_until_s < until:
                program.soft_demoted_until_s = until
                self._windows += 1

    def _greedy_resume(self, now: float) -> list[str]:
        if not self.paused:
            return []
        order = {sid: k for k, sid in enumerate(self.paused)}
        candidates = sorted(self.paused, key=lambda sid: (self._group(self.programs[sid]),
                                                          self.programs[sid].token_total, order[sid]))
        headroom = int(self.capacity_tokens * (PAUSE_THRESHOLD - RESUME_HYSTERESIS)) - self.used_tokens()
        if headroom <= BUFFER_PER_PROGRAM:
            return []
        taken: list[str] = []
        cumulative = 0
        for sid in candidates:
            required = self.programs[sid].token_total + BUFFER_PER_PROGRAM
            if cumulative + required <= headroom:
                taken.append(sid)
                cumulative += required
        taken.sort(key=lambda sid: -self.programs[sid].token_total)  # placed largest first
        for sid in taken:
            self._resumes += 1
            self._unpause(sid, self.programs[sid], now)
        return taken

    @staticmethod
    def _group(program: Program) -> int:
        if program.step_count <= 1:
            return 1
        return 0 if program.status == Status.REASONING else 2

    def _pause_until_safe(self, now: float) -> tuple[str, ...]:
        if self.used_tokens() <= self.capacity_tokens * PAUSE_THRESHOLD:
            return ()
        target = self.capacity_tokens * min(PAUSE_TARGET, PAUSE_THRESHOLD)
        paused: list[str] = []
        while self.used_tokens() > target:
            acting = self._smallest(Status.ACTING)
            if acting is not None:
                self._pause(acting, self.programs[acting], now)
                paused.append(acting)
                continue
            reasoning = self._smallest(Status.REASONING)
            if reasoning is None:
                break
            self.programs[reasoning].marked = True
            self._marks += 1
        return tuple(paused)

    def _smallest(self, status: Status) -> str | None:
        """The active, unmarked program of this status with the fewest tokens (the first such on ties)."""
        candidates = [(p.token_total, sid) for sid, p in self.programs.items()
                      if not p.paused and not p.marked and p.status == status]
        return min(candidates, key=lambda item: item[0])[1] if candidates else None


def _thunderagent(context: PolicyContext) -> ThunderAgentPolicy:
    deployment = context.deployment
    return ThunderAgentPolicy(deployment.cache_capacity_tokens + deployment.host_capacity_tokens)


THUNDERAGENT = PolicySpec("thunderagent", "ThunderAgent (Dynamo's thunderagent_router): over 95 % of the prefill "
                          "KV budget, idle programs paused smallest first down to 80 % (running ones marked, paused at "
                          "their answer), their next call held until resumed smallest first under 85 %",
                          False, _thunderagent)

"""`continuum-fixed-ttl`: Continuum's public code (`--scheduling-policy continuum`), a fixed 2 s pin, job FCFS.

As in Hanchenli/vllm-continuum at 3761e573 (docs/evaluation/field-sources.md section 4): every request of
a job (session) carries the job's first arrival; after each answer that is not the job's last, the KV is
pinned for a TTL unless the tool it calls is slow. The engine keeps the pins (pins.py: `WaitingPins`,
radix_cache.py: holds) and asks this policy, as its `WaitingPinRule`, for each answer's TTL and whether an
expired pin must stay because the job's next call waits.

Rules:
- On an answer of a call that is not the job's last (`set_up_pin`): TTL = 0 if the tool's running mean
  gap exceeds FIXED_THRESHOLD_S (2.0 s), else FIXED_THRESHOLD_S. A tool seen for the first time has
  mean 0 (its first gap gets the 2 s pin). The last call is not pinned. An earlier pin of the job goes
  when its next call is admitted (the hold becomes that request's pin) or the job ends.
- A tool's gap is its job's next call's first attempt minus the answer (`update_func_call_exec_time`:
  next arrival - last departure), averaged per tool over the run.
- Unpin (`unpin_requests_regular`): a pin goes when now >= its end AND the job has no call waiting. A
  call that arrived while the pin was live keeps it past its end until the call is scheduled (its
  prefill starts); a call that arrived after the end finds it gone.
- Program-level FCFS (`ContinuumRequestQueue.peek_request`): a call sent while its job is pinned is
  served before every unpinned one (priority = job arrival - PINNED_AHEAD_S), then all by the job's
  first arrival. A pinned call stays pinned until it is scheduled, so the priority fixed at send is the
  queue's order at every schedule.
- Report (`report`): answers (non-last calls answered), the share pinned, the mean TTL over answers,
  the share of tool time pinned (sum of min(TTL, gap) / sum of gaps); beyond `PinReport`
  (`FixedTtlReport`): the share of answers not pinned because their tool's mean gap > 2 s, and the
  mean time a pin was held, over the pins that ended (past its TTL while the next call waited,
  included; up to the next call's scheduling, its TTL's end, or the session's end).
- Assumption (tool name): the pool's sessions carry no tool names (session_table.Call has token counts
  and a gap only) and the simulator parses no output, so one tool class per benchmark
  (`Session.benchmark`) stands in for the parsed tool name, and every call but the last counts as a
  parsed tool call (an agent's next call follows its tool's result). The "no tool call parsed" case
  (TTL 0) therefore never arises.
- Assumption (PD, field-sources.md section 5 "Continuum fixed TTL"): the pin holds the job's chain in
  the prefill radix tree (where cross-call reuse lives under PD; decode's radix cache is off), from the
  answer for the TTL, not decode-side blocks.
- Substitutions (the engine has no equivalent): vLLM's preemption on a failed allocation
  (`pop_running_request_based_on_last_step`: with <= 1 running, unpin the latest-ending pin;
  otherwise preempt the latest-arriving job's non-last running request; with nothing running, a
  waiting request that does not fit steals a pin) is not modelled: prefill holds no running request,
  decode's retractions are SGLang's and do not touch the prefill cache, and a prefill job that does
  not fit waits for pins to end. A waiting call withdrawn by a client timeout is not told to the
  policy: its job's pin stays until the retry is scheduled or the session ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    Decisions,
    FixedTtlReport,
    PinReport,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)

FIXED_THRESHOLD_S = 2.0  # FIXED_THRESHOLD_CONTINUUM: the pin, and the slowest tool mean still pinned
PINNED_AHEAD_S = 1e9  # a pinned job's priority offset: longer than any run, so pinned calls come first


@dataclass
class _Job:
    arrival_s: float
    num_calls: int
    tool: str
    answered: int = 0
    answer_s: float | None = None  # the last answer not yet followed by a call
    pin_start_s: float | None = None  # the current pin's answer
    pin_end_s: float | None = None  # that answer's pin end (None: not pinned)
    kept: bool = False  # a call arrived while the pin was live and is not yet scheduled


@dataclass
class _ToolMean:
    total_s: float = 0.0
    count: int = 0

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0


class ContinuumFixedTtlPolicy:
    """Admit everyone; priority = job arrival, pinned jobs first; pin each answer 2 s unless its tool is slow."""

    def __init__(self) -> None:
        self.name = "continuum-fixed-ttl"
        self.pins: PinRule | None = self  # a WaitingPinRule
        self._jobs: dict[str, _Job] = {}
        self._tools: dict[str, _ToolMean] = {}
        self.answers = 0
        self.pinned_answers = 0
        self.slow_tool_answers = 0
        self.ttl_sum_s = 0.0
        self.tool_s = 0.0
        self.pinned_tool_s = 0.0
        self.held_sum_s = 0.0  # pin time of every pin that has ended
        self.ended_pins = 0

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Always admit; remember the job's first arrival, its length and its tool class."""
        self._jobs[session_id] = _Job(now, session.n_calls, session.benchmark)
        return Decisions(admit=(session_id,))

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """The first attempt after an answer: one gap of the job's tool; a live pin is kept while the call waits."""
        job = self._jobs[session_id]
        if job.answer_s is not None:
            gap = now - job.answer_s
            tool = self._tools.setdefault(job.tool, _ToolMean())
            tool.total_s += gap
            tool.count += 1
            self.tool_s += gap
            if job.pin_end_s is not None:
                self.pinned_tool_s += min(job.pin_end_s - job.answer_s, gap)
                job.kept = now < job.pin_end_s
                if not job.kept:  # the pin had ended before the call came
                    self._end_pin(job, job.pin_end_s)
            job.answer_s = None
        return NO_DECISIONS

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        """2 s unless the job's tool is slow on average, or this was the job's last call (0)."""
        job = self._jobs[session_id]
        job.answered += 1
        if job.answered >= job.num_calls:
            return 0.0
        slow = self._tools.get(job.tool, _ToolMean()).mean_s > FIXED_THRESHOLD_S
        ttl = 0.0 if slow else FIXED_THRESHOLD_S
        job.answer_s = now
        if ttl > 0:
            job.pin_start_s, job.pin_end_s = now, now + ttl
        self.answers += 1
        self.pinned_answers += ttl > 0
        self.slow_tool_answers += slow
        self.ttl_sum_s += ttl
        return ttl

    def keeps_pin(self, session_id: str) -> bool:
        """True while the job's call that arrived during its pin waits: the pin outlives its end."""
        job = self._jobs.get(session_id)
        return job is not None and job.kept

    def on_scheduled(self, session_id: str, now: float) -> None:
        """A job's call is scheduled: a kept pin becomes the request's (its hold time ends here)."""
        job = self._jobs.get(session_id)
        if job is not None and job.kept:
            self._end_pin(job, now)

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """Forget the job; a pin still held ends now or at its end, whichever came first."""
        job = self._jobs.pop(session_id, None)
        if job is not None and job.pin_end_s is not None:
            self._end_pin(job, now if job.kept else min(now, job.pin_end_s))
        return NO_DECISIONS

    def _end_pin(self, job: _Job, end_s: float) -> None:
        """The job's pin (from its last answer) was held until `end_s`."""
        assert job.pin_start_s is not None
        self.held_sum_s += end_s - job.pin_start_s
        self.ended_pins += 1
        job.pin_start_s = job.pin_end_s = None
        job.kept = False

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def priority(self, session_id: str, now: float) -> float:
        """Program-level FCFS: the job's first arrival; a job whose pin is kept goes ahead of every other."""
        job = self._jobs[session_id]
        return job.arrival_s - PINNED_AHEAD_S if job.kept else job.arrival_s

    def report(self) -> PolicyReport:
        """What the pins did over the run (see the rules above)."""
        answers = self.answers or None
        return PolicyReport(
            pins=PinReport(
                pin_answers=self.answers,
                pin_answer_share=None if answers is None else self.pinned_answers / answers,
                pin_ttl_mean_s=None if answers is None else self.ttl_sum_s / answers,
                pin_tool_time_share=self.pinned_tool_s / self.tool_s if self.tool_s > 0 else None,
                pin_queue_delay_s=None, pin_eta=None, pin_evicted_reentries=0),
            fixed_ttl=FixedTtlReport(
                pin_slow_tool_share=None if answers is None else self.slow_tool_answers / answers,
                pin_held_mean_s=self.held_sum_s / self.ended_pins if self.ended_pins else None))


def _continuum_fixed(context: PolicyContext) -> ContinuumFixedTtlPolicy:
    return ContinuumFixedTtlPolicy()


CONTINUUM_FIXED_TTL = PolicySpec(
    "continuum-fixed-ttl", "Continuum's public code: KV pinned 2 s after each call unless its tool's mean gap "
    "exceeds 2 s, kept while the job's next call waits; program-level FCFS, pinned jobs first", False,
    _continuum_fixed)

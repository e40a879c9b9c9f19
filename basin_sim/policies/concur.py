"""`concur`: Concur's agent-level admission control, an AIMD window over the sessions admitted at once.

Rules (docs/evaluation/field-sources.md section 3; the paper's method section was not read by us, its constants
come from a third-party full-text read quoted there):
- A window W bounds the admitted sessions (agents) that are live at once. A session arriving while fewer
  than W are live and none is waiting is admitted; else it waits at the door before its first call.
  Waiting sessions are admitted first come first served (by arrival) as the window opens: at a session's
  end and at a control step that grows W. Whole agents are admitted; their calls are never held.
- An admitted session keeps its slot until it ends (finished, killed, aborted or abandoned); a shrinking
  window only stops admissions. A waiting session withdrawn at the door leaves the queue.
- Control step, at every policy tick (the engine's `tick_s`; the policy is a `CacheController`), from two
  runtime cache signals: the hit rate H of the prefix cache over the engine's window (the gateway's
  `HitRateWindow`; only admitted sessions send calls) and the KV usage U, SGLang's "token usage" (KV held
  by requests, evictable cache excluded, over the memory) of the decode instances. U < U_LOW: W += ALPHA
  (additive increase), but only while the window is used (W sessions admitted); U > U_HIGH and
  H < H_THRESH: W = max(W_MIN, floor(BETA x W)) (multiplicative decrease); otherwise W holds (near
  saturation). H unknown (too few prompt tokens) is no thrashing signal.
- Report (`AdmissionReport`): W's min, mean and max over its per-minute series (W at each engine minute's
  end, warm-up included, up to the last tick), increases, decreases, sessions deferred at the door, and
  their wait there (total and mean). The deferred wait also counts in every first-call wait metric: the
  engine times a first call from the session's arrival.
Constants, fact (third-party read of the paper's full text, field-sources.md section 3.1): ALPHA = 2,
BETA = 0.5, U_LOW = 0.2, U_HIGH = 0.5, H_THRESH = 0.2, "held across all models and workloads".
Assumptions (where that read and the abstract leave it open; none tuned against a result):
- Assumption: the three-band rule (increase below U_LOW, decrease above U_HIGH with H under H_THRESH,
  hold between) is our reading of "linearly explores concurrency when underutilized, multiplicatively
  reduces on thrashing signals, and stabilizes near saturation" (third-party summary).
- Assumption: U is SGLang's token usage, `(max_total - available - evictable) / max_total` in its
  scheduler's stats: the runtime metric a control layer over SGLang reads (field-sources.md 3.1). Under
  PD it is the decode instances' (together): they hold the running requests' KV, as one aggregated
  server's running requests do; on prefill the in-use KV is only the batch being computed, and its
  tree's occupancy (evictable included) stays full once warm.
- Assumption: the control interval is the engine's policy tick (10 s by default), the interval the
  gateway's other signals are read at; the paper's interval is not available.
- Assumption: W starts at INITIAL_WINDOW = 10, TCP's initial window (RFC 6928, 10 segments), and never
  falls below W_MIN = 1, TCP's loss window (RFC 5681).
- Assumption: W grows only while it is used (RFC 7661: a window not used is not validated), so a quiet
  period does not inflate it.
- Assumption: an admitted session is never paused. Third-party summaries mention pause/resume primitives
  at step boundaries; the abstract's "preserving execution continuity" and field-sources.md's proposal
  keep admitted agents running, and we follow those until the paper's section is read.
- A policy does no I/O and reads time only from `now`.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    AdmissionReport,
    Decisions,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)

ALPHA = 2
BETA = 0.5
U_LOW = 0.2
U_HIGH = 0.5
H_THRESH = 0.2
INITIAL_WINDOW = 10
W_MIN = 1
MINUTE_S = 60.0


class ConcurPolicy:
    """Admit whole sessions up to an AIMD window moved by the prefix hit rate and the decode KV usage."""

    def __init__(self) -> None:
        self.name = "concur"
        self.pins: PinRule | None = None
        self.window = INITIAL_WINDOW
        self.admitted: set[str] = set()  # live admitted sessions
        self.waiting: OrderedDict[str, float] = OrderedDict()  # at the door, first come first -> arrival time
        self._steps: list[tuple[float, int]] = [(0.0, INITIAL_WINDOW)]  # (time, W from then on)
        self._last_tick_s = 0.0
        self._increases = self._decreases = self._deferred = 0
        self._wait_total_s = 0.0

    # --- what the engine tells ------------------------------------------------------------------

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Admitted while the window has room and nobody waits; else it waits at the door."""
        if len(self.admitted) < self.window:  # none waits then: the queue is served whenever the window opens
            self.admitted.add(session_id)
            return Decisions(admit=(session_id,))
        self._deferred += 1
        self.waiting[session_id] = now
        return NO_DECISIONS

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """Nothing: an admitted session's calls are never held."""
        return NO_DECISIONS

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """Its slot frees (the head of the queue may enter), or it leaves the queue."""
        if self.waiting.pop(session_id, None) is not None:
            return NO_DECISIONS
        self.admitted.discard(session_id)
        return self._admit_waiting(now)

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing: the control step hears the KV usage too (`on_control`)."""
        return NO_DECISIONS

    def on_control(self, now: float, hit_rate: float | None, kv_usage: float) -> Decisions:
        """The control step: AIMD on the KV usage and the hit rate, then admissions if the window grew."""
        self._last_tick_s = now
        if kv_usage < U_LOW:
            if len(self.admitted) >= self.window:  # used (a session waits only then)
                self._set_window(now, self.window + ALPHA)
                self._increases += 1
        elif kv_usage > U_HIGH and hit_rate is not None and hit_rate < H_THRESH:
            shrunk = max(W_MIN, math.floor(BETA * self.window))
            if shrunk < self.window:
                self._set_window(now, shrunk)
                self._decreases += 1
        return self._admit_waiting(now)

    def priority(self, session_id: str, now: float) -> float:
        """First come first served: the send time."""
        return now

    def report(self) -> PolicyReport:
        """The window over time, its moves, and the sessions deferred at the door with their wait."""
        series = self.window_series()
        return PolicyReport(admission=AdmissionReport(
            admission_window_min=min(series), admission_window_mean=sum(series) / len(series),
            admission_window_max=max(series), admission_window_per_minute=tuple(series),
            admission_increases=self._increases, admission_decreases=self._decreases,
            admission_deferred=self._deferred, admission_wait_total_s=self._wait_total_s,
            admission_wait_mean_s=self._wait_total_s / self._deferred if self._deferred else None))

    # --- the window -----------------------------------------------------------------------------

    def window_series(self) -> list[int]:
        """W at the end of each engine minute up to the last tick (at least one entry: W now)."""
        minutes = max(1, math.ceil(self._last_tick_s / MINUTE_S))
        series, k = [], 0
        for minute in range(1, minutes + 1):
            while k + 1 < len(self._steps) and self._steps[k + 1][0] <= minute * MINUTE_S:
                k += 1
            series.append(self._steps[k][1])
        return series

    def _set_window(self, now: float, window: int) -> None:
        self.window = window
        self._steps.append((now, window))

    def _admit_waiting(self, now: float) -> Decisions:
        admit: list[str] = []
        while self.waiting and len(self.admitted) < self.window:
            session_id, arrived_s = self.waiting.popitem(last=False)
            self._wait_total_s += now - arrived_s
            self.admitted.add(session_id)
            admit.append(session_id)
        return Decisions(admit=tuple(admit)) if admit else NO_DECISIONS


def _concur(context: PolicyContext) -> ConcurPolicy:
    return ConcurPolicy()


CONCUR = PolicySpec("concur", "Concur: whole sessions admitted up to an AIMD window (+2 while decode KV usage is "
                    "under 20 %, x0.5 when it is over 50 % and the prefix hit rate under 20 %); the rest wait at the "
                    "door, first come first served", False, _concur)

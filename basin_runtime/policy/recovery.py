"""`Recovery`: hold admitted sessions at their tool boundary while a collapse is under way, resume them after.

The Bursts paper recovered 7 of 7 collapsed runs by suspending admitted sessions (and 1 of 7 by throttling
new ones); ThunderAgent pauses programs at tool boundaries. This module decides which live sessions the
core holds and when they come back; the core (`core.py`) applies it on `tick` (`PolicyConfig.recovery`).

Rules:
- The plateau is the knee's (basin_sim/experiments/calibrate/knee.py): the median hit rate while the cache
  fits. Its samples are the hit rates the core is given on ticks while the cache fits: the working set of
  the live sessions not held, x r, is at most the budget (the knee ramp's leading points, in the unit the
  core compares), and no session is held (a recovery's ticks are not the plateau). Samples older than
  `arrival_window_s` before the newest are dropped (Assumption: the same long-run window the shedding rule
  reads the arrival rate over; the plateau then follows a drifting mix, and holds its value through a
  collapse however long, since it is pruned from its newest sample, not from now). Before any sample the
  plateau is `hit_rate_plateau`, the one the calibration measured on the knee ramp.
- Off the plateau: hit rate < plateau - `hit_rate_tolerance` (the knee's floor, and the budget's
  `is_on_plateau`: the same 0.05) on `CONFIRM_TICKS` ticks in a row with a hit rate (the knee's `confirm`
  = 2: one noisy dip is not a knee). Back on it: >= that floor on `CONFIRM_TICKS` ticks in a row.
- A collapse is under way when the hit rate is off the plateau AND the working set of the live sessions
  not held, x r, is over the budget: both signals, never one alone.
- Hold (a collapse, on a tick): live sessions not held, lowest priority first (largest (p, seq)), are held
  until the working set not held, x r, is within the budget, never the last live session not held (the
  lone-head rule: one session alone always runs). A held session's next call waits at the gateway (its
  call in flight, if any, finishes); its KV becomes evictable (the driver closes its engine session).
- Resume (the hit rate back on the plateau, on a tick): held sessions, highest priority first (smallest
  (p, seq)), while the working set not held plus the session's context, x r, stays within the budget;
  the first one always when no live session runs unheld (lone head). Off the plateau or not yet
  confirmed back: nobody is resumed, nobody more is held unless the working set is over the budget.
- Bounded hold: a session held `recovery_max_hold_s` is released on the next tick whatever the hit rate:
  shed when the shedding rule holds (`shedding.should_shed`, the arrival rate over the peak completion
  rate, with the hold in the place of the head's wait and the bound in the place of `shed_wait_s`),
  resumed otherwise; a session whose hold ran out is not held again (the bound is on its whole hold, not
  one spell of it). Never dropped silently: every hold ends in a resume, a shed, its end, or its requeue.
- A held session stays live in the lifecycle and keeps its reservation: it has been admitted and comes
  back to its room, and the room it keeps is not handed to a new session in the middle of a collapse
  (throttling new work alone recovered 1 of 7 runs; admitting more into the room of the held would add to
  the working set the hold is taking down). Its context leaves the working set the collapse test reads.
- Pure, no I/O; time comes in as `now`. Every decision is returned; the core changes its state by them.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from basin_runtime.policy.admission import SessionRecord
from basin_runtime.policy.config import PolicyConfig, PolicyError, require_finite
from basin_runtime.policy.priority import service_key
from basin_runtime.policy.shedding import should_shed

CONFIRM_TICKS = 2  # the knee's `confirm` (knee.py): a change of level is believed on 2 points in a row


@dataclass(frozen=True)
class RecoveryPlan:
    """What a tick decided: sessions to hold, to resume, and to shed (their hold ran out), each in order."""

    hold: tuple[str, ...] = ()
    resume: tuple[str, ...] = ()
    shed: tuple[str, ...] = ()
    held_s: Mapping[str, float] = field(default_factory=dict)  # resumed and shed sessions: how long held
    hit_rate: float | None = None
    plateau_hit_rate: float = 0.0
    reason: str = ""


NO_PLAN = RecoveryPlan()


class Recovery:
    """The held sessions, the plateau's samples and the confirmation counters (see the rules)."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._held: dict[str, float] = {}  # held session -> held since, in hold order
        self._samples: deque[tuple[float, float]] = deque()  # (now, hit rate) while the cache fit
        self._off_ticks = 0  # ticks in a row with a hit rate under the floor
        self._on_ticks = 0  # ticks in a row with a hit rate at or over the floor
        self._spent: set[str] = set()  # live sessions whose hold ran out: never held again

    # --- questions -----------------------------------------------------------------------------

    def is_held(self, session_id: str) -> bool:
        """True while the session is held at its tool boundary."""
        return session_id in self._held

    def held_since(self, session_id: str) -> float:
        """When a held session was held (`KeyError` if it is not)."""
        return self._held[session_id]

    def held_ids(self) -> tuple[str, ...]:
        """The held sessions, in the order they were held."""
        return tuple(self._held)

    def plateau_hit_rate(self) -> float:
        """The plateau: the median of the samples, the configured (measured) one before any."""
        if not self._samples:
            return self._config.hit_rate_plateau
        return statistics.median(rate for _, rate in self._samples)

    # --- steps ---------------------------------------------------------------------------------

    def forget(self, session_id: str) -> float | None:
        """The session ended or left the live set: its hold ends; returns when it was held (None: it was not)."""
        self._spent.discard(session_id)
        return self._held.pop(session_id, None)

    def step(self, now: float, hit_rate: float | None, live: Sequence[SessionRecord], budget_tokens: int,
             arrival_rate_per_s: float | None) -> RecoveryPlan:
        """One tick: expired holds, then a hold or a resume by the rules; returns the plan (state updated)."""
        plateau = self.plateau_hit_rate()
        floor = plateau - self._config.hit_rate_tolerance
        if hit_rate is not None:
            is_off = hit_rate < floor
            self._off_ticks = self._off_ticks + 1 if is_off else 0
            self._on_ticks = 0 if is_off else self._on_ticks + 1
        ratio = self._config.reservation_ratio
        running = [r for r in live if r.session_id not in self._held]
        unheld_tokens = sum(r.context_tokens for r in running)
        expired = [sid for sid, since in self._held.items() if now - since >= self._config.recovery_max_hold_s]
        shed: list[str] = []
        resume: list[str] = []
        held_s: dict[str, float] = {}
        for sid in expired:
            since = self._held.pop(sid)
            self._spent.add(sid)
            held_s[sid] = now - since
            if should_shed(arrival_rate_per_s, self._config.peak_completion_rate_per_s, now - since,
                           self._config.recovery_max_hold_s):
                shed.append(sid)
            else:
                resume.append(sid)
        by_id = {r.session_id: r for r in live}
        unheld_tokens += sum(by_id[sid].context_tokens for sid in resume)
        running_count = len(running) + len(resume)
        hold: list[str] = []
        reason = f"{len(expired)} hold(s) ran out" if expired else ""
        if self._off_ticks >= CONFIRM_TICKS and unheld_tokens * ratio > budget_tokens:
            resumed = set(resume)
            candidates = sorted((r for r in running if r.session_id not in resumed and r.session_id not in self._spent),
                                key=lambda r: service_key(r.priority, r.seq), reverse=True)
            for record in candidates:
                if unheld_tokens * ratio <= budget_tokens or running_count <= 1:
                    break
                self._held[record.session_id] = now
                hold.append(record.session_id)
                unheld_tokens -= record.context_tokens
                running_count -= 1
            reason = (f"collapse: hit rate {hit_rate} under the plateau {plateau:.3f} - "
                      f"{self._config.hit_rate_tolerance} on {self._off_ticks} ticks and the working set x r over "
                      f"the budget {budget_tokens}")
        elif self._on_ticks >= CONFIRM_TICKS and self._held:
            for sid in sorted(self._held, key=lambda s: service_key(by_id[s].priority, by_id[s].seq)):
                context = by_id[sid].context_tokens
                if running_count > 0 and (unheld_tokens + context) * ratio > budget_tokens:
                    break
                held_s[sid] = now - self._held.pop(sid)
                resume.append(sid)
                unheld_tokens += context
                running_count += 1
            reason = f"recovered: hit rate {hit_rate} back on the plateau {plateau:.3f} on {self._on_ticks} ticks"
        if hit_rate is not None and not self._held and unheld_tokens * ratio <= budget_tokens:
            self._sample(now, hit_rate)
        if not (hold or resume or shed):
            return NO_PLAN
        return RecoveryPlan(tuple(hold), tuple(resume), tuple(shed), held_s, hit_rate, plateau, reason)

    def _sample(self, now: float, hit_rate: float) -> None:
        self._samples.append((now, hit_rate))
        horizon = now - self._config.arrival_window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()

    # --- state ---------------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The recovery's state as JSON-ready plain types (`Policy.to_state`)."""
        return {"held": [[sid, since] for sid, since in self._held.items()],
                "samples": [[t, rate] for t, rate in self._samples],
                "spent": sorted(self._spent), "off_ticks": self._off_ticks, "on_ticks": self._on_ticks}

    def load_state(self, state: Mapping[str, Any], live_ids: Sequence[str]) -> None:
        """Take the state `to_state` wrote; `PolicyError` naming a bad field (nothing changed then)."""
        held, samples = state.get("held"), state.get("samples")
        if not isinstance(held, list) or not isinstance(samples, list):
            raise PolicyError(f"state recovery: held and samples must be lists, got {held!r} and {samples!r}")
        loaded_held: dict[str, float] = {}
        for row in held:
            if not isinstance(row, list) or len(row) != 2 or row[0] not in live_ids or row[0] in loaded_held:
                raise PolicyError(f"state recovery: a held session must be [live id, since], once, got {row!r}")
            loaded_held[row[0]] = require_finite("state recovery held since", row[1])
        loaded_samples: deque[tuple[float, float]] = deque()
        for row in samples:
            if not isinstance(row, list) or len(row) != 2:
                raise PolicyError(f"state recovery: a sample must be [now, hit rate], got {row!r}")
            loaded_samples.append((require_finite("state recovery sample time", row[0]),
                                   require_finite("state recovery sample hit rate", row[1], minimum=0)))
        spent = state.get("spent")
        if not isinstance(spent, list) or any(sid not in live_ids or sid in loaded_held for sid in spent):
            raise PolicyError(f"state recovery: spent must list live sessions not held, got {spent!r}")
        counters = [state.get("off_ticks"), state.get("on_ticks")]
        if any(type(c) is not int or c < 0 for c in counters):
            raise PolicyError(f"state recovery: off_ticks and on_ticks must be whole numbers >= 0, got {counters!r}")
        self._held, self._samples, self._spent = loaded_held, loaded_samples, set(spent)
        self._off_ticks, self._on_ticks = int(counters[0]), int(counters[1])  # type: ignore[arg-type]

"""The baselines: plain SGLang (`sglang`) and SGLang with its host-memory tier (`hicache`).

SGLang without a gateway: every session is admitted at once and requests are served first come,
first served (priority = the time the request was sent). Nothing is ever held, shed or suspended.
"""

from __future__ import annotations

from basin_runtime.session_table import Session
from basin_sim.policies.base import (
    NO_DECISIONS,
    NO_REPORT,
    Decisions,
    PinRule,
    PolicyContext,
    PolicyReport,
    PolicySpec,
)


class FcfsPolicy:
    """Admit everyone; FCFS requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pins: PinRule | None = None

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Always admit."""
        return Decisions(admit=(session_id,))

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def report(self) -> PolicyReport:
        """Nothing to report."""
        return NO_REPORT

    def priority(self, session_id: str, now: float) -> float:
        """First come, first served."""
        return now


def _sglang(context: PolicyContext) -> FcfsPolicy:
    return FcfsPolicy("sglang")


def _hicache(context: PolicyContext) -> FcfsPolicy:
    return FcfsPolicy("hicache")


SGLANG = PolicySpec("sglang", "SGLang PD, FCFS, no admission control, GPU prefix cache only", False, _sglang)
HICACHE = PolicySpec("hicache", "SGLang PD, FCFS, no admission control, with the HiCache host tier", True, _hicache)

# Continuum (as published): no admission control; every request of a session carries the session's
# arrival time as its priority (program-level FCFS); after each answer the prefill cache keeps the
# session's chain pinned for a TTL (the tool time it expects), so the next call finds it; a pin that
# outlives its TTL becomes evictable. The engine keeps the pins (radix_cache.py: holds).
"""`continuum`: per-session KV pinned with a TTL across tool calls, program-level FCFS."""

from __future__ import annotations

from basin_runtime.session_table import Session
from basin_sim.policies.base import NO_DECISIONS, Decisions, PolicyContext, PolicySpec

DEFAULT_PIN_TTL_S = 30.0  # used only when no tool-time distribution is known


class ContinuumPolicy:
    """Admit everyone; priority = session arrival; pin KV for `pin_ttl_s` after each answer."""

    lends_decode_memory = False

    def __init__(self, pin_ttl_s: float) -> None:
        if not pin_ttl_s > 0:
            raise ValueError(f"continuum pin_ttl_s must be > 0, got {pin_ttl_s!r}")
        self.name = "continuum"
        self.pin_ttl_s: float | None = pin_ttl_s
        self._arrival_s: dict[str, float] = {}

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        """Always admit; remember the arrival time."""
        self._arrival_s[session_id] = now
        return Decisions(admit=(session_id,))

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        """Forget the session."""
        self._arrival_s.pop(session_id, None)
        return NO_DECISIONS

    def on_tick(self, now: float, hit_rate: float | None) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def priority(self, session_id: str, now: float) -> float:
        """Program-level FCFS: the session's arrival time."""
        return self._arrival_s[session_id]


def _continuum(context: PolicyContext) -> ContinuumPolicy:
    return ContinuumPolicy(context.pin_ttl_s if context.pin_ttl_s is not None else DEFAULT_PIN_TTL_S)


CONTINUUM = PolicySpec("continuum", "Continuum: KV pinned with a TTL across tool calls, program-level FCFS, "
                       "no admission control", False, _continuum)

# Continuum (as published): no admission control; every request of a session carries the session's
# arrival time as its priority (program-level FCFS); after each answer the prefill cache keeps the
# session's chain pinned for a TTL, so the next call finds it; a pin that outlives its TTL becomes
# evictable. The engine keeps the pins (radix_cache.py: holds).
# The TTL is the paper's tau* (continuum_ttl.py: the argmax of its Eq. 2 utility, with the sources read)
# on the run's tool gaps and call prompts (`PolicyContext.tool_calls`) and the deployment's profile;
# tau* = 0 means no pin at all (`pin_ttl_s` None). An explicit `PolicyContext.pin_ttl_s` wins.
# Substitution: the paper's T (the queueing delay an evicted request pays to re-enter, measured online)
# is 0 here. Nothing in this model makes an evicted call wait longer than a pinned one besides its
# recompute (already PrefillReload): both keep their session's arrival as priority in the prefill
# queue, and decode pre-allocation does not depend on the prefill cache. (The paper's v6 also puts a
# pinned request ahead of unpinned ones; the policy cannot see whether a call's chain is held.)
# T = 0 is also the paper's T before any eviction has been measured; the policy cannot measure it
# (it sees calls when they are sent, not when they start), and the engine reads the TTL once.
"""`continuum`: per-session KV pinned with a TTL across tool calls, program-level FCFS."""

from __future__ import annotations

from basin_runtime.session_table import Session
from basin_sim.policies.base import NO_DECISIONS, Decisions, PolicyContext, PolicySpec
from basin_sim.policies.continuum_ttl import TtlChoice, continuum_ttl

QUEUE_DELAY_S = 0.0  # the paper's T in this model (see the top of this module)


class ContinuumPolicy:
    """Admit everyone; priority = session arrival; pin KV for `pin_ttl_s` after each answer (None: never)."""

    def __init__(self, pin_ttl_s: float | None, ttl_choice: TtlChoice | None = None) -> None:
        if pin_ttl_s is not None and not pin_ttl_s > 0:
            raise ValueError(f"continuum pin_ttl_s must be > 0 (or None: no pin), got {pin_ttl_s!r}")
        self.name = "continuum"
        self.pin_ttl_s: float | None = pin_ttl_s
        self.ttl_choice = ttl_choice  # how tau* was chosen (None: pin_ttl_s was given)
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

    def on_tick(self, now: float, hit_rate: float | None, ttft_s: float | None = None) -> Decisions:
        """Nothing to decide."""
        return NO_DECISIONS

    def priority(self, session_id: str, now: float) -> float:
        """Program-level FCFS: the session's arrival time."""
        return self._arrival_s[session_id]


def _continuum(context: PolicyContext) -> ContinuumPolicy:
    if context.pin_ttl_s is not None:
        return ContinuumPolicy(context.pin_ttl_s)
    choice = continuum_ttl(context.tool_calls, context.deployment, QUEUE_DELAY_S)
    return ContinuumPolicy(choice.ttl_s if choice.ttl_s > 0 else None, choice)


CONTINUUM = PolicySpec("continuum", "Continuum: KV pinned with a TTL across tool calls, program-level FCFS, "
                       "no admission control", False, _continuum, needs_tool_calls=True)

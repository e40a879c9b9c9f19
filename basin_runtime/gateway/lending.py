"""Per-session reports of which decode instance served and where cached tokens came from.

Lending, the gateway's side: what the engines report about where each session's KV is, kept per
session, so an operator (and the metrics) see whether lending works instead of the gateway assuming it.

Rules:
- On stock SGLang, lending is decode offloading a finished request's KV to the HiCache storage tier,
  which prefill reads back (deploy/sglang-pd-lending.md); the gateway only pins each session to one
  decode instance (the routing key, `priority.py`) and records what comes back. It never sends a plan
  or a hint: no engine would read one.
- Per session: the decode instance that served its last call (smg's `x-smg-routed-worker-id`, the
  decode worker's URL in PD), how many of its calls moved to another instance (a sticky miss: a
  worker died, or smg's in-flight cap respilled it), and its last call's cached tokens with their
  tier split when the engine reported one (`signals.Usage.cached_tiers`).
- Totals: cached tokens per tier over every reported call, and the calls moved; a session's end
  forgets it. Nothing here changes the budget: storage only raises the budget through a calibration
  measured with storage on (the knee ramp), never by its nominal size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SessionKv:
    """What the engines said of one session's KV."""

    served_by: str | None = None
    calls_moved: int = 0  # calls served by another decode instance than the call before
    cached_tokens: int | None = None
    cached_tiers: Mapping[str, int] | None = None


@dataclass
class LendingTracker:
    """Which decode instance serves each session, and where its cached tokens came from."""

    sessions: dict[str, SessionKv] = field(default_factory=dict)
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    calls_moved: int = 0

    def call_finished(self, session_id: str, served_by: str | None, cached_tokens: int | None,
                      cached_tiers: Mapping[str, int] | None) -> bool:
        """Record a completed call's report; True if another decode instance served it than its last call."""
        kv = self.sessions.setdefault(session_id, SessionKv())
        moved = served_by is not None and kv.served_by is not None and served_by != kv.served_by
        if moved:
            kv.calls_moved += 1
            self.calls_moved += 1
        if served_by is not None:
            kv.served_by = served_by
        kv.cached_tokens, kv.cached_tiers = cached_tokens, cached_tiers
        for tier, tokens in (cached_tiers or {}).items():
            self.cached_by_tier[tier] = self.cached_by_tier.get(tier, 0) + tokens
        return moved

    def session_ended(self, session_id: str) -> None:
        """Forget the session."""
        self.sessions.pop(session_id, None)

    def of(self, session_id: str) -> SessionKv | None:
        """What was reported of a session, if anything."""
        return self.sessions.get(session_id)

    def to_dict(self) -> dict[str, Any]:
        """Totals and the sessions per decode instance, as plain JSON."""
        by_instance: dict[str, int] = {}
        for kv in self.sessions.values():
            if kv.served_by is not None:
                by_instance[kv.served_by] = by_instance.get(kv.served_by, 0) + 1
        return {"sessions_by_decode_instance": by_instance, "cached_tokens_by_tier": dict(self.cached_by_tier),
                "calls_moved": self.calls_moved}

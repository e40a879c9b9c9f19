"""Session priority: computed once at arrival, fixed until completion.

Fixed session priority.

Rules:
- basin mode:     p = arrival_s + predicted_peak_tokens / tokens_per_s
  (a session is "due" once it could have produced its predicted peak at r tokens/s);
- prototype mode: p = arrival_s (arrival order).
- Smaller p is served first; equal p is broken by arrival order (a sequence number), so the key
  (p, seq) is a total order.
- p is computed once at arrival and never changes until the session ends; the same value orders
  the admission queue and is handed to SGLang as the request priority.
"""

from __future__ import annotations

from basin_runtime.policy.config import PolicyMode


def priority_s(mode: PolicyMode, arrival_s: float, predicted_peak_tokens: float, tokens_per_s: float) -> float:
    """The fixed priority of a session, in seconds; smaller is served first."""
    if mode == "prototype":
        return arrival_s
    return arrival_s + predicted_peak_tokens / tokens_per_s


def service_key(priority: float, seq: int) -> tuple[float, int]:
    """The total order the queue serves in: priority, then arrival sequence."""
    return (priority, seq)

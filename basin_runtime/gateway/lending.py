# Lending, the gateway's side: keeping the policy's `LendingLedger` in step with what the decode
# instances served, and turning its write-back plan into a hint on the session's next call.
#
# Rules:
# - Instances are the router's worker ids (smg's `x-smg-routed-worker-id`, the decode worker's URL in
#   PD). Those named in the configuration are registered with their capacity at start; one first
#   seen in an answer is registered with `default_capacity_tokens`.
# - A completed call lends its whole context (prompt + completion tokens) on the instance that
#   served it: that is what the decode instance holds once the call finishes. A session's end
#   forgets its lent copy.
# - The hint: if the ledger holds more of the session than prefill had cached on its last call
#   (the upstream's `cached_tokens`, which in PD is the prefill side's), the next call carries
#   `X-Basin-Writeback: instance=<id>;held=<tokens>;cached=<tokens>;tokens=<to move>` (a header,
#   not a body field: SGLang's request models may reject unknown fields). A client's own
#   `X-Basin-Writeback` is never passed on. Acting on the hint needs SGLang-side support (README).
"""The lending ledger kept from served calls, and the write-back hint header."""

from __future__ import annotations

from collections.abc import Mapping

from basin_runtime.policy import LendingLedger, WriteBackPlan
from basin_runtime.policy.lending import LEND_CAP_FRACTION

WRITEBACK_HEADER = "X-Basin-Writeback"


class LendingTracker:
    """The ledger of what each decode instance keeps of finished calls, per session."""

    def __init__(self, decode_instances: Mapping[str, int] | None = None, *, default_capacity_tokens: int = 1_000_000,
                 lend_cap_fraction: float = LEND_CAP_FRACTION) -> None:
        self.ledger = LendingLedger(lend_cap_fraction=lend_cap_fraction)
        self.default_capacity_tokens = default_capacity_tokens
        for instance_id, capacity_tokens in (decode_instances or {}).items():
            self.ledger.add_instance(instance_id, capacity_tokens)

    def call_finished(self, session_id: str, served_by: str | None, context_tokens: int) -> None:
        """Record that `served_by` now holds the session's `context_tokens`."""
        if not served_by or context_tokens <= 0:
            return
        if served_by not in self.ledger.instance_ids():
            self.ledger.add_instance(served_by, self.default_capacity_tokens)
        self.ledger.lend(session_id, served_by, context_tokens)

    def session_ended(self, session_id: str) -> None:
        """Drop the session's lent copy."""
        self.ledger.forget(session_id)

    def plan(self, session_id: str, prefill_cached_tokens: int | None) -> WriteBackPlan | None:
        """The write-back plan for the session's next call (None: nothing worth moving)."""
        return self.ledger.write_back_plan(session_id, prefill_cached_tokens or 0)


def writeback_header(plan: WriteBackPlan) -> str:
    """The hint header's value for a plan."""
    return (f"instance={plan.instance_id};held={plan.held_tokens};cached={plan.prefill_cached_tokens};"
            f"tokens={plan.tokens_to_move}")

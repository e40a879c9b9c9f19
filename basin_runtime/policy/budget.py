"""The cache budget: a reference B moved a little by the observed prefix-cache hit rate.

The cache budget and its small hit-rate-driven moves.

Rules:
- The reference budget B = r * min(knee_factor * measured cache knee, cache capacity) is computed
  by the caller (`reference_budget_tokens`) and can be changed by an operator at runtime. The knee
  and the capacity are working-set tokens (contexts now); admission sums reservations (predicted
  peaks), which exceed the live sessions' contexts by the reservation ratio r = sum of reservations /
  sum of contexts of the live sessions, measured on the knee ramp for the served predictor. r = 1
  (the default) when reservations are contexts (prototype mode) or r was not measured.
- The budget stays within [round(B * min_fraction), round(B * max_fraction)], the upper bound raised
  to the completion ceiling C when one is configured (`completion_budget.py`); one step is
  max(1, round(B * step_fraction)) tokens.
- On a tick with a hit rate: if the hit rate is still on the high plateau
  (hit_rate >= plateau - tolerance) and sessions are queued, loosen by one step; if the hit rate
  has fallen below that, tighten by one step (from above round(B * max_fraction), straight down to
  it: `completion_budget.py`). With no hit rate the budget does not move.
- At most one move per `move_interval_s` (the first move may come at any time). A move that a
  bound clips to nothing is not a move: it neither emits an event nor restarts the interval.
- An operator change of B re-clamps the current budget into the new bounds and does not restart
  the interval. Changing the budget never evicts a live session (admission only looks forward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from basin_runtime.policy.completion_budget import tightened_tokens, upper_tokens
from basin_runtime.policy.config import PolicyConfig, PolicyError, require_finite, require_tokens
from basin_runtime.policy.events import BudgetMoved


def reference_budget_tokens(knee_tokens: float, cache_capacity_tokens: float, knee_factor: float = 0.9,
                            reservation_ratio: float = 1.0) -> int:
    """The reference budget B = reservation_ratio x min(knee_factor x knee, cache capacity), in whole tokens."""
    knee = require_finite("knee_tokens", knee_tokens)
    capacity = require_finite("cache_capacity_tokens", cache_capacity_tokens)
    factor = require_finite("knee_factor", knee_factor)
    ratio = require_finite("reservation_ratio", reservation_ratio)
    if ratio < 1:
        raise PolicyError(f"reservation_ratio must be >= 1 (reservations are at least the contexts), got {ratio!r}")
    if knee <= 0 or capacity <= 0:
        raise PolicyError(
            f"knee_tokens and cache_capacity_tokens must be > 0, got {knee_tokens!r} and {cache_capacity_tokens!r}"
        )
    if factor <= 0:
        raise PolicyError(f"knee_factor must be > 0, got {knee_factor!r}")
    budget = math.floor(ratio * min(factor * knee, capacity))
    if budget < 1:
        raise PolicyError(f"reference budget rounds down to {budget} tokens; it must be >= 1")
    return budget


class BudgetController:
    """The current budget around the reference B, moved by `tick` and `set_reference`."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._reference_tokens = config.budget_tokens
        self._budget_tokens = config.budget_tokens
        self._last_move_s: float | None = None

    @property
    def budget_tokens(self) -> int:
        """The budget admission uses now."""
        return self._budget_tokens

    @property
    def reference_tokens(self) -> int:
        """The reference budget B."""
        return self._reference_tokens

    def bounds(self) -> tuple[int, int]:
        """The lowest and highest budget allowed around the current B."""
        low = max(1, round(self._reference_tokens * self._config.budget_min_fraction))
        high = max(low, upper_tokens(self._reference_tokens, self._config))
        return low, high

    def step_tokens(self) -> int:
        """The size of one budget move."""
        return max(1, round(self._reference_tokens * self._config.budget_step_fraction))

    def is_on_plateau(self, hit_rate: float) -> bool:
        """True while the hit rate is still on the high plateau of the hit-rate curve."""
        return hit_rate >= self._config.hit_rate_plateau - self._config.hit_rate_tolerance

    def tick(self, now: float, hit_rate: float | None, has_queued: bool) -> BudgetMoved | None:
        """Move the budget by at most one step; return the move, if any."""
        if hit_rate is None or not self._may_move(now):
            return None
        low, high = self.bounds()
        old = self._budget_tokens
        if self.is_on_plateau(hit_rate):
            if not has_queued:
                return None
            new = min(high, old + self.step_tokens())
            reason = "loosen: sessions queued and hit rate on the plateau"
        else:
            new = tightened_tokens(old, self.step_tokens(), low, self._reference_tokens, self._config)
            reason = "tighten: hit rate fell below the plateau"
        if new == old:
            return None
        self._budget_tokens = new
        self._last_move_s = now
        return BudgetMoved(now, old, new, self._reference_tokens, hit_rate, reason)

    def set_reference(self, now: float, reference_tokens: int) -> BudgetMoved:
        """Change B; the current budget is re-clamped into the new bounds."""
        old = self._budget_tokens
        self._reference_tokens = reference_tokens
        low, high = self.bounds()
        self._budget_tokens = min(high, max(low, old))
        reason = f"operator set the reference budget to {reference_tokens} tokens"
        return BudgetMoved(now, old, self._budget_tokens, reference_tokens, None, reason)

    def to_state(self) -> dict[str, Any]:
        """The controller's state as JSON-ready plain types (`Policy.to_state`)."""
        return {"reference_tokens": self._reference_tokens, "budget_tokens": self._budget_tokens,
                "last_move_s": self._last_move_s}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take the state `to_state` wrote; `PolicyError` naming a bad field (nothing changed then)."""
        reference = require_tokens("state budget.reference_tokens", state.get("reference_tokens"))
        budget = require_tokens("state budget.budget_tokens", state.get("budget_tokens"))
        last = state.get("last_move_s")
        last_move_s = None if last is None else require_finite("state budget.last_move_s", last)
        if reference == 0 or budget == 0:
            raise PolicyError(f"state budget: reference and budget must be > 0, got {reference} and {budget}")
        self._reference_tokens, self._budget_tokens, self._last_move_s = reference, budget, last_move_s

    def _may_move(self, now: float) -> bool:
        if self._last_move_s is None:
            return True
        return now - self._last_move_s >= self._config.budget_move_interval_s

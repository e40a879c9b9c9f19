# The one way to build the policy's configuration from what was measured of a deployment.
#
# Rules:
# - A `Calibration` holds the measured numbers: the cache knee and capacity (working-set tokens),
#   optionally the plateau hit rate, the peak completion rate and the reservation ratio r (sum of
#   predicted-peak reservations / sum of contexts of the live sessions on the knee ramp, >= 1).
# - The budget B = r x min(0.9 x knee, capacity), in the unit admission sums. Reservations are
#   contexts in prototype mode, so r does not apply there (r = 1). This is the only place that
#   turns a calibration into a budget; the gateway and the simulator both call it.
# - `policy_config(calibration, overrides)`: the measured plateau and peak completion rate, then the
#   overrides (any `PolicyConfig` field, e.g. a config file's `policy:` section), then an explicit
#   budget if one is given. Neither calibration nor budget is an error. A bad value raises
#   `PolicyError` naming the field.
# - Pure: no I/O (reading the file is `basin_runtime.calibration`).
"""`Calibration`, the budget it implies, and `policy_config`: one construction for every driver."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from basin_runtime.policy.budget import reference_budget_tokens
from basin_runtime.policy.config import PolicyConfig, PolicyError

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))


@dataclass(frozen=True)
class Calibration:
    """What was measured of the deployment (tokens are working-set tokens)."""

    knee_tokens: float
    cache_capacity_tokens: float
    hit_rate_plateau: float | None = None
    peak_completion_rate_per_s: float | None = None
    reservation_ratio: float = 1.0

    def budget_tokens(self, mode: str = "basin") -> int:
        """B = r x min(0.9 x knee, capacity) in reservation tokens; r = 1 in prototype mode."""
        ratio = 1.0 if mode == "prototype" else self.reservation_ratio
        return reference_budget_tokens(self.knee_tokens, self.cache_capacity_tokens, reservation_ratio=ratio)


def policy_config(calibration: Calibration | None, overrides: Mapping[str, Any] | None = None, *,
                  budget_tokens: int | None = None) -> PolicyConfig:
    """The policy's configuration: measured values, then `overrides`, then an explicit budget."""
    extra = dict(overrides or {})
    unknown = sorted(set(extra) - _CONFIG_FIELDS)
    if unknown:
        raise PolicyError(f"unknown policy setting(s) {unknown}; known: {sorted(_CONFIG_FIELDS)}")
    mode = str(extra.get("mode", "basin"))
    budget = budget_tokens if budget_tokens is not None else extra.pop("budget_tokens", None)
    extra.pop("budget_tokens", None)
    if budget is None:
        if calibration is None:
            raise PolicyError("no budget: give a budget or a calibration")
        budget = calibration.budget_tokens(mode)
    measured: dict[str, Any] = {}
    if calibration is not None:
        measured = {key: getattr(calibration, key) for key in ("hit_rate_plateau", "peak_completion_rate_per_s")
                    if getattr(calibration, key) is not None}
    return PolicyConfig(budget_tokens=budget, **{**measured, **extra})

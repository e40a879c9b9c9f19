# The deployment's measured numbers (calibration file) and the policy configuration built from them.
#
# Rules:
# - A calibration file is a JSON object: `knee_tokens` and `cache_capacity_tokens` (> 0, required),
#   `hit_rate_plateau` (in [0, 1]), `peak_completion_rate_per_s` (> 0) and `reservation_ratio`
#   (>= 1: sum of predicted-peak reservations / sum of contexts of the live sessions on the knee ramp,
#   for the served predictor) optional, `notes` free. Any other key is refused, so a misspelt
#   measurement cannot pass silently.
# - Reference budget B = `reference_budget_tokens(knee, capacity, reservation_ratio=r)` =
#   r x min(0.9 x knee, capacity), in the unit admission sums (reservations); r = 1 in prototype
#   mode (reservations are contexts) or when not measured. An explicit `budget_tokens` option wins
#   over it. With neither, the gateway does not start.
# - `PolicyConfig` = the calibration's measured values, overridden by the config's `policy:`
#   section, with `budget_tokens` and `always_engaged` from the options.
"""Read the calibration file and build the `PolicyConfig`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basin_runtime.gateway.config import ConfigError, GatewayConfig
from basin_runtime.policy import PolicyConfig, PolicyError, reference_budget_tokens

_REQUIRED = ("knee_tokens", "cache_capacity_tokens")
_OPTIONAL = ("hit_rate_plateau", "peak_completion_rate_per_s", "reservation_ratio", "notes")


@dataclass(frozen=True)
class Calibration:
    """What was measured of the deployment."""

    knee_tokens: float
    cache_capacity_tokens: float
    hit_rate_plateau: float | None = None
    peak_completion_rate_per_s: float | None = None
    reservation_ratio: float = 1.0

    @property
    def budget_tokens(self) -> int:
        """The reference budget B = r x min(0.9 x knee, capacity), in reservation tokens (basin mode)."""
        return reference_budget_tokens(self.knee_tokens, self.cache_capacity_tokens,
                                       reservation_ratio=self.reservation_ratio)

    def budget_tokens_for(self, mode: str) -> int:
        """B for a policy mode: reservations are contexts in prototype mode, so r does not apply there."""
        if mode == "prototype":
            return reference_budget_tokens(self.knee_tokens, self.cache_capacity_tokens)
        return self.budget_tokens


def load_calibration(path: Path) -> Calibration:
    """Read and check a calibration file; `ConfigError` naming the file, key and value."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the calibration file: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a calibration file must hold a JSON object")
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; known: {list(_REQUIRED + _OPTIONAL)}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise ConfigError(f"{path}: missing {missing}")
    values = {key: _positive(path, key, raw[key]) for key in _REQUIRED}
    for key in ("hit_rate_plateau", "peak_completion_rate_per_s", "reservation_ratio"):
        if raw.get(key) is not None:
            values[key] = _positive(path, key, raw[key], allow_zero=key == "hit_rate_plateau")
    if values.get("hit_rate_plateau", 0.0) > 1:
        raise ConfigError(f"{path}: hit_rate_plateau must be in [0, 1], got {raw['hit_rate_plateau']!r}")
    if values.get("reservation_ratio", 1.0) < 1:
        raise ConfigError(f"{path}: reservation_ratio must be >= 1, got {raw['reservation_ratio']!r}")
    calibration = Calibration(**values)
    try:
        calibration.budget_tokens  # noqa: B018 -- checks the budget is at least one token
    except PolicyError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return calibration


def _positive(path: Path, key: str, value: Any, allow_zero: bool = False) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path}: {key} must be a finite number {bound}, got {value!r}")
    return float(value)


def policy_config(config: GatewayConfig, calibration: Calibration | None) -> PolicyConfig:
    """The policy's configuration from the options and the calibration."""
    if config.budget_tokens is not None:
        budget = config.budget_tokens
    elif calibration is not None:
        budget = calibration.budget_tokens_for(str(config.policy.get("mode", "basin")))
    else:
        raise ConfigError("no budget: give --budget-tokens N or --calibration FILE")
    measured: dict[str, Any] = {}
    if calibration is not None:
        measured = {key: getattr(calibration, key) for key in ("hit_rate_plateau", "peak_completion_rate_per_s")
                    if getattr(calibration, key) is not None}
    try:
        return PolicyConfig(budget_tokens=budget, always_engaged=config.always_engaged,
                            **{**measured, **config.policy})
    except (PolicyError, TypeError) as exc:
        raise ConfigError(f"policy configuration: {exc}") from exc

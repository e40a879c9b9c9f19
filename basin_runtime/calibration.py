# The calibration file: what an operator measured of a deployment, as JSON.
#
# Rules:
# - A JSON object: `knee_tokens` and `cache_capacity_tokens` (> 0, required), `hit_rate_plateau`
#   (in [0, 1]), `peak_completion_rate_per_s` (> 0), `reservation_ratio` (>= 1), `ttft_plateau_s` and
#   `call_cycle_plateau_s` (> 0: the plateau's median time to first token, and median session duration
#   over its calls; together they set the latency gate) optional, `notes`
#   free; what r was measured for, optional: `predictor_sha256` (64 hex digits, or "none" for no
#   predictor), `reservation_quantile` (in (0, 1), or null: the bare prediction), `lending` (none |
#   decode-memory). Any other key is refused, so a misspelt measurement cannot pass silently.
# - Every error is a `CalibrationError` naming the file (or source), the key and the value.
# - What the numbers mean, and the budget and policy configuration built from them, is
#   `basin_runtime.policy.calibrated` (pure, shared by the gateway and the simulator).
"""Read and check calibration files (`Calibration` from a JSON file or a mapping)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from basin_runtime.policy import PolicyError
from basin_runtime.policy.calibrated import Calibration
from basin_runtime.policy.lending import LENDING_KINDS

__all__ = ["Calibration", "CalibrationError", "calibration_from_mapping", "load_calibration"]

_REQUIRED = ("knee_tokens", "cache_capacity_tokens")
_OPTIONAL = ("hit_rate_plateau", "peak_completion_rate_per_s", "reservation_ratio", "notes", "predictor_sha256",
             "reservation_quantile", "lending", "ttft_plateau_s", "call_cycle_plateau_s")


class CalibrationError(ValueError):
    """A calibration file or record that cannot be used; the message names the source, key and value."""


def load_calibration(path: Path) -> Calibration:
    """Read and check a calibration file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: cannot read the calibration file: {exc}") from exc
    return calibration_from_mapping(raw, str(path))


def calibration_from_mapping(raw: object, source: str) -> Calibration:
    """Check a calibration record (the file's JSON object); `source` names it in errors."""
    if not isinstance(raw, Mapping):
        raise CalibrationError(f"{source}: a calibration file must hold a JSON object")
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise CalibrationError(f"{source}: unknown key(s) {unknown}; known: {list(_REQUIRED + _OPTIONAL)}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise CalibrationError(f"{source}: missing {missing}")
    values: dict[str, Any] = {key: _positive(source, key, raw[key]) for key in _REQUIRED}
    for key in ("hit_rate_plateau", "peak_completion_rate_per_s", "reservation_ratio", "ttft_plateau_s",
                "call_cycle_plateau_s"):
        if raw.get(key) is not None:
            values[key] = _positive(source, key, raw[key], allow_zero=key == "hit_rate_plateau")
    if values.get("hit_rate_plateau", 0.0) > 1:
        raise CalibrationError(f"{source}: hit_rate_plateau must be in [0, 1], got {raw['hit_rate_plateau']!r}")
    if values.get("reservation_ratio", 1.0) < 1:
        raise CalibrationError(f"{source}: reservation_ratio must be >= 1, got {raw['reservation_ratio']!r}")
    calibration = Calibration(**values, **_measured_for(source, raw))
    try:
        calibration.budget_tokens()  # checks the budget is at least one token
    except PolicyError as exc:
        raise CalibrationError(f"{source}: {exc}") from exc
    return calibration


def _measured_for(source: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The checked `predictor_sha256`, `reservation_quantile` and `lending` keys that are present."""
    found: dict[str, Any] = {}
    sha = raw.get("predictor_sha256")
    if sha is not None:
        is_hex = isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)
        if not (is_hex or sha == "none"):
            raise CalibrationError(f"{source}: predictor_sha256 must be 64 lowercase hex digits or 'none', "
                                   f"got {sha!r}")
        found["predictor_sha256"] = sha
    q = raw.get("reservation_quantile")
    if q is not None:
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
            raise CalibrationError(f"{source}: reservation_quantile must be a number in (0, 1) or null, got {q!r}")
        found["reservation_quantile"] = float(q)
    lending = raw.get("lending")
    if lending is not None:
        if lending not in LENDING_KINDS:
            raise CalibrationError(f"{source}: lending must be one of {list(LENDING_KINDS)}, got {lending!r}")
        found["lending"] = lending
    return found


def _positive(source: str, key: str, value: Any, allow_zero: bool = False) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise CalibrationError(f"{source}: {key} must be a finite number {bound}, got {value!r}")
    return float(value)

"""Read and check calibration files: what an operator measured of a deployment, as a JSON object.

Rules:
- The keys are declared once, in `KEYS` (checked by `basin_runtime.schema`): `knee_tokens` and
  `cache_capacity_tokens` required; the plateau's hit rate, peak completion rate, first-token latency and
  call cycle (together the last two set the latency gate), the completion peak (the working set at
  which completions stop rising: the adaptive budget's upper bound), the reservation ratio, free `notes`, and what
  r was measured for (`predictor_sha256`, `reservation_quantile`, `lending`) optional. A null optional
  key is absent. Any other key is refused, so a misspelt measurement cannot pass silently.
- Every error is a `CalibrationError` naming the file (or source), the key and the value.
- What the numbers mean, and the budget and policy configuration built from them, is
  `basin_runtime.policy.calibrated` (pure, shared by the gateway and the simulator).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from basin_runtime.policy import PolicyError
from basin_runtime.policy.calibrated import Calibration
from basin_runtime.policy.lending import LENDING_KINDS
from basin_runtime.schema import Anything, BadKeys, BadValue, Key, Number, OneOf, Text, read_keys

__all__ = ["KEYS", "Calibration", "CalibrationError", "calibration_from_mapping", "load_calibration"]

_MEASURED = Number(gt=0, noun="a finite number")
KEYS: dict[str, Key] = {
    "knee_tokens": Key(_MEASURED, "working set at the knee of the throughput ramp", "tokens"),
    "cache_capacity_tokens": Key(_MEASURED, "the engines' prefix cache, all instances", "tokens"),
    "hit_rate_plateau": Key(Number(ge=0, le=1, says="in [0, 1] (a finite number)"), "prefix hit rate on the plateau"),
    "peak_completion_rate_per_s": Key(_MEASURED, "sessions completed per second at the knee", "1/s"),
    "reservation_ratio": Key(Number(ge=1, says=">= 1 (a finite number)"), "r: budget in reservation tokens per "
                             "working-set token"),
    "ttft_plateau_s": Key(_MEASURED, "median time to first token on the plateau", "s"),
    "call_cycle_plateau_s": Key(_MEASURED, "median session duration over its calls on the plateau", "s"),
    "completion_peak_tokens": Key(_MEASURED, "working set at which the ramp's completed calls per second stop "
                                  "rising (the adaptive budget's upper bound)", "tokens"),
    "notes": Key(Anything(), "free text"),
    "predictor_sha256": Key(Text(r"[0-9a-f]{64}|none", says="64 lowercase hex digits or 'none'"),
                            "the predictor file r was measured with ('none': contexts, no predictor)"),
    "reservation_quantile": Key(Number(gt=0, lt=1, says="a number in (0, 1) or null"),
                                "the reservation quantile r was measured with (null: the bare prediction)"),
    "lending": Key(OneOf(LENDING_KINDS), "the deployment's lending switch on the ramp"),
}
REQUIRED = ("knee_tokens", "cache_capacity_tokens")


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
    try:
        values = read_keys(raw, KEYS, REQUIRED, null_is_absent=True)
    except BadKeys as exc:
        problem = f"unknown key(s) {exc.unknown}; known: {list(KEYS)}" if exc.unknown else f"missing {exc.missing}"
        raise CalibrationError(f"{source}: {problem}") from None
    except BadValue as exc:
        raise CalibrationError(f"{source}: {exc}") from None
    values.pop("notes", None)
    calibration = Calibration(**values)
    try:
        calibration.budget_tokens()  # checks the budget is at least one token
    except PolicyError as exc:
        raise CalibrationError(f"{source}: {exc}") from exc
    return calibration

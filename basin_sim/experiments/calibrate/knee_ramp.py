"""The knee ramp and the calibration record it yields, for the gateway and for calibrated Basin runs.

Rules:
- The knee ramp runs `RAMP_FRACTIONS` of the overload rate, `RAMP_STEP_S` each (ramp.py), on the
  deployment as given (its lending switch included: lending moves the knee).
- The record is ramp.py's `calibration_record` plus what it was measured for: the predictor file's
  SHA-256 ("none": reservations are contexts), the reservation quantile and the lending switch, which
  the gateway checks before it serves with it.
- This module takes reservations as numbers; it never loads a predictor (no onnxruntime): the caller
  that made the predictions passes them, with the file's digest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from basin_runtime.session_table import Session
from basin_sim.experiments.calibrate.ramp import RampStep, run_ramp
from basin_sim.experiments.calibrate.ramp import calibration_record as ramp_calibration_record
from basin_sim.profile import Deployment

RAMP_FRACTIONS = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)  # of the overload rate: the knee (and risk) ramp
RAMP_STEP_S = 1200.0


def knee_calibration_record(deployment: Deployment, steps: Sequence[RampStep], command: str,
                            step_s: float = RAMP_STEP_S, predictor_sha256: str = "none",
                            reservation_quantile: float | None = None) -> dict[str, Any]:
    """The gateway's calibration file from a simulated ramp on `deployment`, saying what its reservation
    ratio was measured for: the predictor file ("none": contexts), the quantile and the lending switch."""
    capacity = deployment.cache_capacity_tokens
    record = ramp_calibration_record(steps, capacity,
                                     f"{command}: simulated stepped ramp ({len(steps)} steps of {step_s:.0f} s)")
    return {**record, "predictor_sha256": predictor_sha256, "reservation_quantile": reservation_quantile,
            "lending": deployment.lending}


def knee_record(deployment: Deployment, pool: Sequence[Session], rate_per_s: float, seed: int,
                reservations: Mapping[str, float] | None, command: str, step_s: float = RAMP_STEP_S,
                predictor_sha256: str = "none", reservation_quantile: float | None = None,
                revised: Mapping[str, Mapping[int, float]] | None = None) -> dict[str, Any]:
    """The calibration record of the knee ramp (RAMP_FRACTIONS of the overload rate) on `deployment`, with these
    reservations (pool session id -> reserved at arrival; None: contexts) of this predictor file and quantile,
    and their revisions (pool session id -> call k -> reserved from call k on; None: none)."""
    steps = run_ramp(deployment, pool, [f * rate_per_s for f in RAMP_FRACTIONS], step_s, seed, reservations,
                     revised=revised)
    return knee_calibration_record(deployment, steps, command, step_s, predictor_sha256, reservation_quantile)

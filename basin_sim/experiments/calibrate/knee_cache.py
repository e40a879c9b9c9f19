"""The knee-calibration cache: a Basin run's calibration, measured once per key on first use, kept under data/.

Rules:
- `basin` and `basin-proto` are run calibrated: their budget is the knee (and reservation ratio)
  measured on the knee ramp (knee_ramp.py, as `basin-sim knee` runs it), for the deployment's shape
  with a GPU cache and its lending switch (the ramp runs with it: lending moves the knee) and its
  session radix cache when on (in the key only then, so keys without it are as before), the
  scenario's workload, the predictor file in use (its SHA-256; "none" for `basin-proto`, whose
  reservations are contexts), where the peaks come from when not the file itself (`peaks`: e.g. the
  out-of-fold table's digest, predictions.py), the reservation quantile, and the revised reservations'
  digest when the ramp's reservations follow Basin's revisions (`revised`; in the key only then). That is the cache key
  (canonical JSON, with the overload-rate key, the ramp's fractions, step and seed, and the record's
  format). The record itself names only the predictor file, as the gateway checks it.
- The cache is one JSON file (default data/sim/calibrations.json), one entry per key: the
  calibration record, in the gateway's calibration-file format, and the command that measured it.
  It hands out `KneeCalibration`s: the `Calibration` a policy is built from (checked as the gateway
  checks its file) beside the record as written (notes, numbers as measured), which outputs copy.
  A missing entry is measured now (the knee ramp, a minute or so) and written before it is used, and
  the caller is told; an unreadable file is an error naming it.
- Reservations come in as numbers: no predictor is loaded here (no onnxruntime).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basin_runtime.calibration import Calibration, calibration_from_mapping
from basin_runtime.session_table import Session
from basin_sim.experiments.calibrate.knee_ramp import RAMP_FRACTIONS, RAMP_STEP_S, knee_record
from basin_sim.experiments.calibrate.rates import JsonCache, RatesError, rate_key
from basin_sim.profile import Deployment
from basin_sim.workload.scenarios import Scenario

log = logging.getLogger(__name__)

DEFAULT_CALIBRATIONS_FILE = Path("data/sim/calibrations.json")
RAMP_SEED = 1
RECORD_FORMAT = 4  # 4: the record carries the completion peak (3: the latency gate); older: measured anew


@dataclass(frozen=True)
class KneeCalibration:
    """A knee ramp's calibration: the typed `Calibration`, and the record it was read from (the gateway's file)."""

    calibration: Calibration
    record: Mapping[str, Any]

    @classmethod
    def of(cls, record: Mapping[str, Any], source: str) -> KneeCalibration:
        """The record checked as the gateway checks its calibration file (`source` names it in errors)."""
        return cls(calibration_from_mapping(record, source), dict(record))


class KneeCache(JsonCache):
    """The JSON file of measured Basin calibrations."""

    what = "calibration cache"

    def __init__(self, path: Path = DEFAULT_CALIBRATIONS_FILE) -> None:
        super().__init__(path)

    def get(self, key: str) -> KneeCalibration | None:
        """The calibration cached under `key`, or None."""
        entry = self.entry(key)
        if entry is None:
            return None
        record = entry.get("calibration") if isinstance(entry, dict) else None
        if not isinstance(record, dict):
            raise RatesError(f"{self.path}: entry has no calibration record: {entry!r}")
        return KneeCalibration.of(record, f"the knee calibration in {self.path}")

    def put(self, key: str, knee: KneeCalibration, deployment: Deployment, scenario: Scenario) -> None:
        """Cache a measured calibration under `key`."""
        record = knee.record
        self.put_entry(key, {"calibration": dict(record), "deployment": deployment.name, "scenario": scenario.name,
                             "lending": deployment.lending, "predictor_sha256": record.get("predictor_sha256"),
                             "reservation_quantile": record.get("reservation_quantile")})


def knee_key(deployment: Deployment, pool: Sequence[Session], scenario: Scenario, predictor_sha256: str,
             quantile: float | None, step_s: float = RAMP_STEP_S, peaks: str = "", revised: str = "") -> str:
    """The canonical key of one calibration (see the rules above)."""
    shape = dataclasses.replace(deployment, host_cache_tokens=0)
    key: dict[str, Any] = {"rate": rate_key(shape, scenario.workload, scenario.clients, pool),
                           "lending": deployment.lending,
                           "predictor_sha256": predictor_sha256, "reservation_quantile": quantile,
                           "ramp": {"fractions": list(RAMP_FRACTIONS), "step_s": step_s, "seed": RAMP_SEED},
                           "record": RECORD_FORMAT}
    if peaks:
        key["peaks"] = peaks
    if revised:  # the ramp's reservations follow their revisions; keys without them stay as they were
        key["revised"] = revised
    if deployment.session_radix_cache is not False:  # the ramp runs with it; keys without it stay as they were
        key["session_radix_cache"] = deployment.session_radix_cache
    return json.dumps(key, sort_keys=True)


def cached_knee_calibration(deployment: Deployment, pool: Sequence[Session], scenario: Scenario, rate_per_s: float,
                            predictor_sha256: str, quantile: float | None, reservations: Mapping[str, float] | None,
                            cache: KneeCache, peaks: str = "", revised: Mapping[str, Mapping[int, float]] | None = None,
                            revised_tag: str = "") -> tuple[KneeCalibration, str]:
    """(calibration, source): cached for this key, else measured now on the knee ramp and cached.

    `reservations` (pool session id -> what it reserves at arrival) are those of the predictor and
    quantile in the key; None for `basin-proto`. `source` is 'cache' or 'measured now'.
    """
    key = knee_key(deployment, pool, scenario, predictor_sha256, quantile, peaks=peaks, revised=revised_tag)
    cached = cache.get(key)
    if cached is not None:
        return cached, "cache"
    log.warning("no Basin calibration recorded for %s (GPU cache, lending %s) on this workload, predictor %s, "
                "quantile %s in %s: running the knee ramp now (cached after)", deployment.name, deployment.lending,
                predictor_sha256[:12], quantile, cache.path)
    knee = measure_knee(deployment, pool, scenario, rate_per_s, predictor_sha256, quantile, reservations,
                        revised=revised)
    cache.put(key, knee, deployment, scenario)
    return knee, "measured now"


def measure_knee(deployment: Deployment, pool: Sequence[Session], scenario: Scenario, rate_per_s: float,
                 predictor_sha256: str, quantile: float | None,
                 reservations: Mapping[str, float] | None, step_s: float = RAMP_STEP_S,
                 revised: Mapping[str, Mapping[int, float]] | None = None) -> KneeCalibration:
    """The knee ramp's calibration for one cache key (GPU cache, the deployment's lending)."""
    record = knee_record(dataclasses.replace(deployment, host_cache_tokens=0), pool, rate_per_s, RAMP_SEED,
                         reservations, f"basin-sim knee --deployment {deployment.name} --scenario {scenario.name}",
                         step_s, predictor_sha256=predictor_sha256, reservation_quantile=quantile, revised=revised)
    return KneeCalibration.of(record, f"the {deployment.name} knee ramp")

"""The overload-rate cache: a rate measured once per deployment shape and workload, on first use, kept under data/.

Rules:
- A scenario's `x_overload` multiplies the overload rate of the deployment's shape with a GPU-only
  cache, no lending and no session radix cache, measured for the scenario's workload, so every policy,
  cache tier, lending switch and session-cache key of that shape sees the same absolute arrivals.
- The key is everything the rate depends on: the shape (the profile's numbers, instance counts,
  per-instance memories; cache kind forced to gpu, lending and session_radix_cache left out), the
  whole `WorkloadSpec`, the client knobs, and a fingerprint of the pool (session ids, per-call tokens
  and tool gaps). Canonical JSON, so equal inputs give equal keys.
- How a rate is searched for depends on how long sessions live (`settings_for`): recorded sessions
  (2-3 minutes) with the default 30-minute horizon; sessions timed as a serving model runs them
  (workload.timing, ~5-10 minutes) with an hour at a finer resolution: 30 minutes from an empty
  cache would read a rate the steady state cannot hold.
- The cache is one JSON file (default data/sim/overload_rates.json; never the package folder),
  one entry per key with the rate, the calibration settings and the command that measured it. A
  missing entry is measured (overload.py, minutes) and written before it is used; the caller is told
  it was measured. A file that cannot be read is an error naming it, never ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from basin_runtime.session_table import Session
from basin_sim.clients import ClientPolicy
from basin_sim.experiments.calibrate.overload import Calibration, CalibrationSettings, find_overload_rate
from basin_sim.profile import Deployment
from basin_sim.workload.scenarios import WorkloadSpec
from basin_sim.workload.serving import RECORDED

log = logging.getLogger(__name__)

DEFAULT_RATES_FILE = Path("data/sim/overload_rates.json")
TIMED_SETTINGS = CalibrationSettings(horizon_s=3600.0, resolution_per_s=0.002, start_rate_per_s=0.02)


def settings_for(workload: WorkloadSpec) -> CalibrationSettings:
    """How the overload rate of a workload is searched for (see the rules above)."""
    return CalibrationSettings() if workload.timing == RECORDED else TIMED_SETTINGS


class RatesError(ValueError):
    """The overload-rate cache file cannot be read or written; the message names it."""


def pool_fingerprint(pool: Sequence[Session]) -> str:
    """A hash of what the pool replays: ids, per-call prompt/completion tokens and tool gaps."""
    digest = hashlib.sha256()
    for session in pool:
        calls = [(c.prompt_tokens, c.completion_tokens, c.gap_s) for c in session.calls]
        digest.update(json.dumps([session.session_id, session.benchmark, calls]).encode())
    return digest.hexdigest()[:16]


def rate_key(deployment: Deployment, workload: WorkloadSpec, clients: ClientPolicy,
             pool: Sequence[Session]) -> str:
    """The canonical key of one overload rate (see the rules above)."""
    shape = dataclasses.asdict(dataclasses.replace(deployment, name="", host_cache_tokens=0))
    del shape["lending"]  # measured without lending whatever the deployment's switch (`overload_shape`)
    del shape["session_radix_cache"]  # and without the session radix cache
    return json.dumps({"shape": shape, "workload": dataclasses.asdict(workload), "clients": dataclasses.asdict(clients),
                       "pool": pool_fingerprint(pool)}, sort_keys=True, default=list)


class JsonCache:
    """A JSON object file of measured entries by key, rewritten whole (keys sorted); unreadable: `RatesError`."""

    what = "cache"

    def __init__(self, path: Path) -> None:
        self.path = path

    def _entries(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RatesError(f"{self.path}: cannot read the {self.what}: {exc}") from exc
        if not isinstance(entries, dict):
            raise RatesError(f"{self.path}: the {self.what} must hold a JSON object")
        return entries

    def entry(self, key: str) -> Any:
        """The raw entry for `key`, or None."""
        return self._entries().get(key)

    def put_entry(self, key: str, entry: Mapping[str, Any]) -> None:
        """Record an entry."""
        entries = self._entries()
        entries[key] = dict(entry)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        except OSError as exc:
            raise RatesError(f"{self.path}: cannot write the {self.what}: {exc}") from exc


class RateCache(JsonCache):
    """The JSON file of measured overload rates."""

    what = "overload-rate cache"

    def __init__(self, path: Path = DEFAULT_RATES_FILE) -> None:
        super().__init__(path)

    def get(self, key: str) -> float | None:
        """The cached rate for `key`, or None."""
        entry = self.entry(key)
        if entry is None:
            return None
        rate = entry.get("overload_rate_per_s") if isinstance(entry, dict) else None
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0:
            raise RatesError(f"{self.path}: entry has no valid overload_rate_per_s: {entry!r}")
        return float(rate)

    def put(self, key: str, rate_per_s: float, note: Mapping[str, Any]) -> None:
        """Record a measured rate."""
        self.put_entry(key, {"overload_rate_per_s": rate_per_s, **note})


def overload_shape(deployment: Deployment) -> Deployment:
    """What the overload rate is measured on: the deployment's shape with a GPU cache and no lending."""
    return dataclasses.replace(deployment, host_cache_tokens=0, lending="none", session_radix_cache=False)


def measure_overload_rate(deployment: Deployment, pool: Sequence[Session], workload: WorkloadSpec,
                          clients: ClientPolicy, cache: RateCache, settings: CalibrationSettings, command: str,
                          report: Callable[[float, int], None] | None = None) -> float:
    """Measure the overload rate of `deployment`'s shape with a GPU cache on this workload; record it in `cache`."""
    found = find_overload_rate(overload_shape(deployment), "sglang", pool, settings, report)
    record_overload_rate(cache, deployment, workload, clients, pool, found, settings, command)
    return found.overload_rate_per_s


def record_overload_rate(cache: RateCache, deployment: Deployment, workload: WorkloadSpec, clients: ClientPolicy,
                         pool: Sequence[Session], found: Calibration, settings: CalibrationSettings,
                         command: str) -> None:
    """Record in `cache` the overload rate `found` for `deployment`'s shape on this workload, with how."""
    cache.put(rate_key(overload_shape(deployment), workload, clients, pool), found.overload_rate_per_s, {
        "deployment": deployment.name, "workload": dataclasses.asdict(workload),
        "settings": dataclasses.asdict(settings), "tried": [list(t) for t in found.tried], "command": command})


def overload_rate_for(deployment: Deployment, pool: Sequence[Session], workload: WorkloadSpec,
                      clients: ClientPolicy, cache: RateCache) -> tuple[float, str]:
    """(rate, source): the cached overload rate of this shape and workload, else measured now and cached.

    `source` is 'cache' or 'measured now'.
    """
    rate = cache.get(rate_key(overload_shape(deployment), workload, clients, pool))
    if rate is not None:
        return rate, "cache"
    log.warning("no overload rate recorded for %s (GPU cache) on this workload in %s: calibrating now "
                "(several minutes; cached after)", deployment.name, cache.path)
    command = "basin-sim calibrate (or the first run of this shape and workload)"
    return measure_overload_rate(deployment, pool, workload, clients, cache, settings_for(workload), command), \
        "measured now"

"""What one simulated run depends on: scenario, deployment, policy, seed, rates and what Basin is told.

A `RunSpec` is plain, frozen data; `simulate.run_scenario` runs it and `run_summary.summarize` reports
it, so both read it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from basin_runtime.policy.calibrated import Calibration
from basin_runtime.task_memory import Shrinkage
from basin_sim.profile import Deployment
from basin_sim.workload.scenarios import Scenario


@dataclass(frozen=True)
class RunSpec:
    """Everything one run depends on (besides the session pool)."""

    scenario: Scenario
    deployment: Deployment
    policy_name: str
    seed: int
    overload_rate_per_s: float  # of the deployment's shape (GPU cache) for this workload; 0 if nothing needs it
    tick_s: float = 10.0
    bin_s: float = 60.0
    step_s: float = 60.0  # how often the progress callback is called (simulated seconds)
    max_drain_s: float = 3 * 3600.0
    predicted_peak_tokens: Mapping[str, float] = field(default_factory=dict)  # pool session id -> peak (basin)
    reservation_scale: float = 1.0  # basin: an extra factor on each reservation (ablations)
    # basin: pool session id -> m(q) of the predictor file for its benchmark (`predictions.reservation_multipliers`)
    reservation_multipliers: Mapping[str, float] = field(default_factory=dict)
    reservation_quantile: float | None = None  # the q those multipliers are for (reported only)
    # basin: pool session id -> call k -> (re-estimated peak, m_k(q)) (`predictions.online_revisions`)
    revisions: Mapping[str, Mapping[int, tuple[float, float]]] = field(default_factory=dict)
    calibration: Calibration | None = None  # basin: what the operator measured; None: knee = capacity
    pin_ttl_s: float | None = None  # continuum: a fixed TTL for every pin; None: its online rule (continuum_ttl.py)
    policy_overrides: Mapping[str, Any] = field(default_factory=dict)  # basin: PolicyConfig fields (ablations)
    latency_gate: bool = False  # basin: the calibration's latency gate (beyond the paper)
    task_memory: Shrinkage | None = None  # basin: the memory of finished tasks with the pipeline's k; None: off

    @property
    def base_rate_per_s(self) -> float:
        """Arrival rate of the first segment (warm-up and the `pre` window)."""
        return self.scenario.base_rate_per_s(self.overload_rate_per_s)

"""`Calibration`, the budget it implies, and `policy_config`: one construction for every driver.

The one way to build the policy's configuration from what was measured of a deployment.

Rules:
- A `Calibration` holds the measured numbers: the cache knee and capacity (working-set tokens),
  optionally the plateau hit rate, the peak completion rate and the reservation ratio r (sum of
  predicted-peak reservations / sum of contexts of the live sessions on the knee ramp, >= 1), and
  what r was measured for (predictor SHA-256, reservation quantile, lending), checked by
  `check_serves` wherever a calibration meets the predictor that is served.
- The budget B = r x min(0.9 x knee, capacity), in the unit admission sums. Reservations are
  contexts in prototype mode, so r does not apply there (r = 1). This is the only place that
  turns a calibration into a budget; the gateway and the simulator both call it.
- The adaptive budget's upper bound from the completion peak: C = r x completion peak (reservation
  tokens, r = 1 in prototype mode; `completion_budget.py`), used while `completion_budget` is on, and
  only when B is the calibration's own (an explicit budget is the operator's word: no ceiling from
  the file beside it; an override `budget_ceiling_tokens` sets one by hand).
- `policy_config(calibration, overrides)`: the measured plateau, peak completion rate, budget ceiling C
  and (basin mode) reservation ratio, so admission engages on the working set against B / r (the paper's rule);
  then the overrides (any `PolicyConfig` field, e.g. a config file's `policy:` section), then an
  explicit budget if one is given. Neither calibration nor budget is an error. A bad value raises
  `PolicyError` naming the field.
- The latency gate is beyond the paper and off unless asked for (`latency_gate=True`): then, when the
  ramp measured the plateau's first-token latency and call cycle, the working set engages admission
  only while the engines are as slow as the first-token latency at which the median session would
  miss goodput's deadline (`Calibration.latency_gate_s`). An override `latency_gate_s` sets it by hand.
- `uncalibrated(capacity)` is the one stand-in for a deployment nobody measured: knee = capacity.
- Pure: no I/O (reading the file is `basin_runtime.calibration`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from basin_runtime.policy.budget import reference_budget_tokens
from basin_runtime.policy.completion_budget import completion_ceiling_tokens
from basin_runtime.policy.config import PolicyConfig, PolicyError
from basin_runtime.policy.deadline import GOODPUT_DEADLINE_FACTOR
from basin_runtime.policy.lending import LendingKind

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))


@dataclass(frozen=True)
class Calibration:
    """What was measured of the deployment (tokens are working-set tokens)."""

    knee_tokens: float
    cache_capacity_tokens: float
    hit_rate_plateau: float | None = None
    peak_completion_rate_per_s: float | None = None
    reservation_ratio: float = 1.0
    # What r was measured for: the predictor file's SHA-256 ("none": contexts, no predictor) and the
    # reservation quantile (None: the bare prediction); both None when the file does not say.
    predictor_sha256: str | None = None
    reservation_quantile: float | None = None
    lending: LendingKind | None = None  # the deployment's lending switch on the ramp (None: not said)
    ttft_plateau_s: float | None = None  # median time to first token on the ramp's plateau (None: not measured)
    call_cycle_plateau_s: float | None = None  # median session duration / its calls on the plateau (None: not measured)
    completion_peak_tokens: float | None = None  # working set where completions stop rising (None: not measured)

    def latency_gate_s(self) -> float | None:
        """The first-token latency at which the median session misses goodput's deadline (None: not measured).

        A session is good if it ends within GOODPUT_DEADLINE_FACTOR x its unloaded time U; n calls each
        d seconds slower than unloaded add n x d, so it misses once d > (factor - 1) x U / n, U / n being
        its call cycle. The gate is the plateau's first-token latency plus that much.
        """
        if self.ttft_plateau_s is None or self.call_cycle_plateau_s is None:
            return None
        return self.ttft_plateau_s + (GOODPUT_DEADLINE_FACTOR - 1) * self.call_cycle_plateau_s

    def budget_tokens(self, mode: str = "basin") -> int:
        """B = r x min(0.9 x knee, capacity) in reservation tokens; r = 1 in prototype mode."""
        ratio = 1.0 if mode == "prototype" else self.reservation_ratio
        return reference_budget_tokens(self.knee_tokens, self.cache_capacity_tokens, reservation_ratio=ratio)

    def completion_budget_tokens(self, mode: str = "basin") -> int | None:
        """C = r x completion peak in reservation tokens (r = 1 in prototype mode); None when not measured."""
        if self.completion_peak_tokens is None:
            return None
        ratio = 1.0 if mode == "prototype" else self.reservation_ratio
        return completion_ceiling_tokens(self.completion_peak_tokens, ratio)


def uncalibrated(cache_capacity_tokens: float) -> Calibration:
    """What an unmeasured deployment is taken to be: the knee at the cache capacity, nothing else measured."""
    return Calibration(knee_tokens=cache_capacity_tokens, cache_capacity_tokens=cache_capacity_tokens)


def policy_config(calibration: Calibration | None, overrides: Mapping[str, Any] | None = None, *,
                  budget_tokens: int | None = None, latency_gate: bool = False) -> PolicyConfig:
    """The policy's configuration: measured values (the latency gate only if asked for), then `overrides`, then an
    explicit budget."""
    extra = dict(overrides or {})
    unknown = sorted(set(extra) - _CONFIG_FIELDS)
    if unknown:
        raise PolicyError(f"unknown policy setting(s) {unknown}; known: {sorted(_CONFIG_FIELDS)}")
    mode = str(extra.get("mode", "basin"))
    budget = budget_tokens if budget_tokens is not None else extra.pop("budget_tokens", None)
    extra.pop("budget_tokens", None)
    ceiling = None
    if budget is None:
        if calibration is None:
            raise PolicyError("no budget: give a budget or a calibration")
        budget = calibration.budget_tokens(mode)
        ceiling = calibration.completion_budget_tokens(mode)  # only beside the calibration's own B
    measured: dict[str, Any] = {}
    if calibration is not None:
        measured = {key: getattr(calibration, key) for key in ("hit_rate_plateau", "peak_completion_rate_per_s")
                    if getattr(calibration, key) is not None}
        if ceiling is not None:
            measured["budget_ceiling_tokens"] = ceiling
        if mode != "prototype":
            measured["reservation_ratio"] = calibration.reservation_ratio
            gate = calibration.latency_gate_s() if latency_gate else None
            if gate is not None:
                measured["latency_gate_s"] = gate
    return PolicyConfig(budget_tokens=budget, **{**measured, **extra})


def check_serves(calibration: Calibration, predictor_sha256: str, reservation_quantile: float | None,
                 lending: str | None = None) -> None:
    """`PolicyError` if the calibration says it was measured for another predictor file, quantile or lending.

    A calibration that does not say (hand-written, or from before the keys existed) passes: its r is
    the operator's word; so does any lending when the caller has no switch (`lending` None). The
    message names both sides and the command that re-measures.
    """
    wrong = []
    if lending is not None and calibration.lending is not None and calibration.lending != lending:
        wrong.append(f"lending {calibration.lending!r} (served: {lending!r})")
    if calibration.predictor_sha256 is not None and calibration.predictor_sha256 != predictor_sha256:
        wrong.append(f"predictor SHA-256 {calibration.predictor_sha256[:12]}... (served: {predictor_sha256[:12]}...)")
    if calibration.predictor_sha256 is not None and calibration.reservation_quantile != reservation_quantile:
        wrong.append(f"reservation quantile {calibration.reservation_quantile} (served: {reservation_quantile})")
    if wrong:
        raise PolicyError("the calibration was measured for " + " and ".join(wrong) + "; its knee and reservation "
                          "ratio do not hold for what is served: re-measure with `basin-sim knee --model FILE "
                          "--reservation-quantile Q --out CALIBRATION`")

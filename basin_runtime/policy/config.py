"""Policy configuration and errors.

Policy configuration, the exception tree, and the value checks every policy module shares.

Rules:
- `PolicyConfig` is frozen and checks every field in `__post_init__`; a bad value raises
  `PolicyError` naming the field and the value.
- Every error the policy raises is a `PolicyError` (a `ValueError`); the subclasses let the HTTP
  layer map them to status codes in one place (unknown session, duplicate session, clock).
- Token counts are whole, non-negative numbers; times and rates are finite.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal, SupportsIndex, cast

PolicyMode = Literal["basin", "prototype"]
POLICY_MODES: tuple[PolicyMode, ...] = ("basin", "prototype")


class PolicyError(ValueError):
    """An illegal step or value; the policy state is unchanged when it is raised."""


class UnknownSessionError(PolicyError):
    """The session id is neither live nor queued."""


class DuplicateSessionError(PolicyError):
    """The session id already arrived and is still live or queued."""


class ClockError(PolicyError):
    """`now` is not finite or is earlier than the last `now` the policy saw."""


def require_finite(what: str, value: float, *, minimum: float | None = None) -> float:
    """Return `value` as a float if it is a finite real number (and >= `minimum`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"{what} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise PolicyError(f"{what} must be finite, got {value!r}")
    if minimum is not None and value < minimum:
        raise PolicyError(f"{what} must be >= {minimum:g}, got {value!r}")
    return float(value)


def require_tokens(what: str, value: object) -> int:
    """Return `value` as an int if it is a whole, non-negative token count."""
    if type(value) is int:  # the hot path: a plain int
        count = value
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise PolicyError(f"{what} must be a whole number of tokens, got {value!r}")
        count = int(value)
    elif not isinstance(value, bool) and hasattr(type(value), "__index__"):  # e.g. numpy integers
        count = operator.index(cast(SupportsIndex, value))
    else:
        raise PolicyError(f"{what} must be a whole number of tokens, got {value!r}")
    if count < 0:
        raise PolicyError(f"{what} must be >= 0, got {value!r}")
    return count


@dataclass(frozen=True)
class PolicyConfig:
    """Everything the policy core is tuned by; only `budget_tokens` has no default.

    `budget_tokens` is the reference budget B (see `reference_budget_tokens`), in the unit admission
    sums (reservations); `reservation_ratio` is the r it was built with (reservations / contexts of the
    live sessions on the knee ramp), so the working set (contexts) is compared with budget / r when
    admission decides whether to engage. `latency_gate_s` (None: no gate) lets the working set
    engage admission only while the engines' windowed time to first token is at least that long.
    `can_outgrow_reservation` False (the default) is the outgrowth rule (`core.py`): a later call whose
    context passes its session's reservation is re-reserved, and held in the queue if that does not fit
    while admission is engaged; True lets such calls through unchecked (the simulator's ablation).
    `budget_ceiling_tokens` (None: none measured) is the completion peak in reservation units: with
    `completion_budget` on (the default) the adaptive budget may rise up to it, beyond
    `budget_max_fraction` x B, while the hit rate holds its plateau and sessions wait (`completion_budget.py`).
    The hit-rate plateau should come from the measured hit-rate-vs-working-set curve of the deployment.
    `recovery` True (the default) holds admitted sessions at their tool boundary while a collapse is under
    way (`recovery.py`), each for at most `recovery_max_hold_s` (Assumption: 600 s, the openai client's
    default read timeout, `basin_sim/clients.py`: the longest a client is known to wait on one call, so a
    hold never outlasts the wait of the client it holds); False: never held (the ablation `basin:no-recovery`).
    """

    budget_tokens: int
    tokens_per_s: float = 30.0
    always_engaged: bool = False
    mode: PolicyMode = "basin"
    budget_step_fraction: float = 0.02
    budget_min_fraction: float = 0.85
    budget_max_fraction: float = 1.10
    budget_move_interval_s: float = 60.0
    hit_rate_plateau: float = 0.90
    hit_rate_tolerance: float = 0.05
    peak_completion_rate_per_s: float | None = None
    shed_wait_s: float = 900.0
    arrival_window_s: float = 3600.0
    reservation_ratio: float = 1.0
    latency_gate_s: float | None = None
    can_outgrow_reservation: bool = False
    completion_budget: bool = True
    budget_ceiling_tokens: int | None = None
    recovery: bool = True
    recovery_max_hold_s: float = 600.0

    def __post_init__(self) -> None:
        budget = require_tokens("PolicyConfig.budget_tokens", self.budget_tokens)
        if budget == 0:
            raise PolicyError("PolicyConfig.budget_tokens must be > 0, got 0")
        object.__setattr__(self, "budget_tokens", budget)  # 1e6 -> 1000000
        if self.mode not in POLICY_MODES:
            raise PolicyError(f"PolicyConfig.mode must be one of {POLICY_MODES}, got {self.mode!r}")
        for name in ("always_engaged", "can_outgrow_reservation", "completion_budget", "recovery"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"PolicyConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_positive("tokens_per_s", self.tokens_per_s)
        self._check_fractions()
        self._check_hit_rates()
        require_finite("PolicyConfig.budget_move_interval_s", self.budget_move_interval_s, minimum=0)
        require_finite("PolicyConfig.shed_wait_s", self.shed_wait_s, minimum=0)
        self._check_positive("arrival_window_s", self.arrival_window_s)
        self._check_positive("recovery_max_hold_s", self.recovery_max_hold_s)
        if self.latency_gate_s is not None:
            self._check_positive("latency_gate_s", self.latency_gate_s)
        if require_finite("PolicyConfig.reservation_ratio", self.reservation_ratio) < 1:
            raise PolicyError(f"PolicyConfig.reservation_ratio must be >= 1 (reservations are at least the "
                              f"contexts), got {self.reservation_ratio!r}")
        if self.peak_completion_rate_per_s is not None:
            self._check_positive("peak_completion_rate_per_s", self.peak_completion_rate_per_s)
        if self.budget_ceiling_tokens is not None:
            ceiling = require_tokens("PolicyConfig.budget_ceiling_tokens", self.budget_ceiling_tokens)
            if ceiling == 0:
                raise PolicyError("PolicyConfig.budget_ceiling_tokens must be > 0, got 0")
            object.__setattr__(self, "budget_ceiling_tokens", ceiling)

    @staticmethod
    def _check_positive(name: str, value: float) -> None:
        if require_finite(f"PolicyConfig.{name}", value) <= 0:
            raise PolicyError(f"PolicyConfig.{name} must be > 0, got {value!r}")

    def _check_fractions(self) -> None:
        step = require_finite("PolicyConfig.budget_step_fraction", self.budget_step_fraction)
        if not 0 < step < 1:
            raise PolicyError(f"PolicyConfig.budget_step_fraction must be in (0, 1), got {step!r}")
        low = require_finite("PolicyConfig.budget_min_fraction", self.budget_min_fraction)
        if not 0 < low <= 1:
            raise PolicyError(f"PolicyConfig.budget_min_fraction must be in (0, 1], got {low!r}")
        high = require_finite("PolicyConfig.budget_max_fraction", self.budget_max_fraction)
        if high < 1:
            raise PolicyError(f"PolicyConfig.budget_max_fraction must be >= 1, got {high!r}")

    def _check_hit_rates(self) -> None:
        for name in ("hit_rate_plateau", "hit_rate_tolerance"):
            value = require_finite(f"PolicyConfig.{name}", getattr(self, name))
            if not 0 <= value <= 1:
                raise PolicyError(f"PolicyConfig.{name} must be in [0, 1], got {value!r}")

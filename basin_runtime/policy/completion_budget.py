"""The budget where completions peak: the adaptive budget's upper bound from the ramp's completion peak.

The hit-rate knee sets the reference budget B; on the knee ramp completions may keep rising past it
(the completion peak, basin_sim/experiments/calibrate/completion_peak.py). This module is the rule
by which the adaptive budget (budget.py) may reach that peak, and how it comes back.

Rules:
- The ceiling C = floor(r x completion peak): the completion peak is a working set (contexts, as
  the knee is), and admission sums reservations, r of them per context token on the knee ramp, so C
  is in the budget's unit by the same r that turns the knee into B (`reference_budget_tokens`).
  No 0.9 margin: B sits below the knee because it is where the budget rests; C is an outer bound,
  reached only while the hit rate holds, and past it more working set buys no completions.
- With `completion_budget` on and a ceiling, the budget's upper bound is
  max(round(B x budget_max_fraction), C): a peak below the knee-based bound changes nothing.
  Off, or no ceiling: the bound is today's (B x budget_max_fraction).
- Loosening is today's rule, up to that bound: one step (round(B x budget_step_fraction)) per
  `budget_move_interval_s`, only while the hit rate is on its plateau and sessions are queued.
  Assumption: the step is left as it is (the paper's "moved only a little"): the hit rate shows
  an admission late (a session's context grows over its life), so the step bounds what one minute
  can let in unseen; only how far the budget may go changes.
- Tightening (hit rate below the plateau) from above the knee-based bound drops the budget to that
  bound at once (one move), then today's steps down to B x budget_min_fraction. Mechanism: above
  the knee-based bound the budget stands only on the plateau's evidence; while it lies above the
  sum of reservations, sessions that finish are replaced by queued ones, so stepping down 2% a
  minute from far above would keep admitting into a falling hit rate for many minutes.
- An operator change of B (`set_reference`) keeps C: C is measured of the deployment, as the knee is;
  the knee-based bound follows the new B.
- Pure: no I/O, no clock.
"""

from __future__ import annotations

import math

from basin_runtime.policy.config import PolicyConfig, PolicyError, require_finite


def completion_ceiling_tokens(completion_peak_tokens: float, reservation_ratio: float = 1.0) -> int:
    """C = floor(reservation_ratio x completion peak), in whole reservation tokens."""
    peak = require_finite("completion_peak_tokens", completion_peak_tokens)
    ratio = require_finite("reservation_ratio", reservation_ratio)
    if peak <= 0:
        raise PolicyError(f"completion_peak_tokens must be > 0, got {completion_peak_tokens!r}")
    if ratio < 1:
        raise PolicyError(f"reservation_ratio must be >= 1 (reservations are at least the contexts), got {ratio!r}")
    ceiling = math.floor(ratio * peak)
    if ceiling < 1:
        raise PolicyError(f"the completion ceiling rounds down to {ceiling} tokens; it must be >= 1")
    return ceiling


def knee_upper_tokens(reference_tokens: int, config: PolicyConfig) -> int:
    """Today's upper bound: round(B x budget_max_fraction)."""
    return round(reference_tokens * config.budget_max_fraction)


def upper_tokens(reference_tokens: int, config: PolicyConfig) -> int:
    """The budget's upper bound: the knee-based one, raised to the ceiling C while `completion_budget` is on."""
    knee_upper = knee_upper_tokens(reference_tokens, config)
    if not config.completion_budget or config.budget_ceiling_tokens is None:
        return knee_upper
    return max(knee_upper, config.budget_ceiling_tokens)


def tightened_tokens(old_tokens: int, step_tokens: int, low_tokens: int, reference_tokens: int,
                     config: PolicyConfig) -> int:
    """The budget after one tightening move: down one step, and never above the knee-based bound (floor `low`)."""
    new = old_tokens - step_tokens
    if config.completion_budget:
        new = min(new, max(low_tokens, knee_upper_tokens(reference_tokens, config)))
    return max(low_tokens, new)

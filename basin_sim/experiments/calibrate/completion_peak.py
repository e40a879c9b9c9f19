"""The completion peak: the working set at which a ramp's completed calls per second stop rising.

The hit-rate knee says where the cache stops holding the working set; completions may keep rising
past it (a lower hit rate, more sessions served). The completion peak is the outer limit the adaptive
budget may reach while the hit rate holds (basin_runtime/policy/completion_budget.py).

Rules:
- Input: a ramp's points (load, calls per second, standard error of that rate or None), in any
  order; they are sorted by load, as the knee sorts them (knee.py). Load is the working set over
  the cache capacity (or tokens): the peak comes out in the same unit.
- Noise is the ramp's own, measured on the same ramp (no extra runs): a step's standard error is
  that of the mean of its per-minute call rates over its measured half (`rate_standard_error`).
  Assumption: the minutes are treated as independent; they are not quite (a session's calls span
  minutes), which makes the error a little small, and the confirm rule below is the guard against
  one noisy step, as it is for the knee.
- A point rises when its rate exceeds the best so far by more than NOISE_SDS standard errors of the
  difference (sqrt(se_point^2 + se_best^2); a missing error counts as 0: any rise is a rise). The
  best so far is then that point.
- Completions stop rising at the first point that does not rise and is not followed by one that
  rises within CONFIRM points (the knee's `confirm`: one noisy point is not a turn; at the ramp's
  end fewer points count). The peak is the best point's load then.
- A ramp whose completions never stop rising gives the last point's load with `is_censored=True`:
  the peak lies beyond what was measured, and the last load is a safe (low) estimate, as for the knee.
- Pure: no I/O.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# Assumption: two standard errors, the usual ~95% bar for "not noise"; chosen before any ramp was read.
NOISE_SDS = 2.0
CONFIRM = 2  # the knee's confirm (ramp.py `ramp_knee`): the same bar for "one point is not a turn"
MINUTE_S = 60.0  # the bin of the per-minute rates: the timeline's and the hit-rate window's minute


@dataclass(frozen=True)
class CompletionPeak:
    """Where completed calls per second stop rising on a ramp."""

    load: float
    calls_per_s: float
    is_censored: bool
    index: int  # the peak point, in the caller's order


def rate_standard_error(times_s: Sequence[float], start_s: float, end_s: float,
                        bin_s: float = MINUTE_S) -> float | None:
    """The standard error of the mean per-bin rate of events at `times_s` in [start_s, end_s) (None: < 2 bins).

    Only whole bins count; `times_s` must be sorted.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s!r}")
    num_bins = math.floor((end_s - start_s) / bin_s + 1e-9)
    if num_bins < 2:
        return None
    rates = []
    for k in range(num_bins):
        lo, hi = start_s + k * bin_s, start_s + (k + 1) * bin_s
        rates.append((bisect_left(times_s, hi) - bisect_left(times_s, lo)) / bin_s)
    return statistics.stdev(rates) / math.sqrt(num_bins)


def _rises(rate: float, se: float | None, best_rate: float, best_se: float | None) -> bool:
    margin = NOISE_SDS * math.sqrt((se or 0.0) ** 2 + (best_se or 0.0) ** 2)
    return rate > best_rate + margin


def find_completion_peak(points: Sequence[tuple[float, float, float | None]]) -> CompletionPeak:
    """The completion peak of a ramp's (load, calls per second, its standard error) points."""
    if len(points) < 2:
        raise ValueError(f"a completion peak needs at least 2 ramp points, got {len(points)}")
    for load, rate, se in points:
        if not all(math.isfinite(v) and v >= 0 for v in (load, rate, 0.0 if se is None else se)):
            raise ValueError(f"ramp points must be finite and >= 0, got {(load, rate, se)!r}")
    order = sorted(range(len(points)), key=lambda k: (points[k][0], points[k][1]))
    best = order[0]
    for i in range(1, len(order)):
        load, rate, se = points[order[i]]
        if _rises(rate, se, points[best][1], points[best][2]):
            best = order[i]
            continue
        window = order[i + 1:i + CONFIRM]
        if not any(_rises(points[k][1], points[k][2], points[best][1], points[best][2]) for k in window):
            return CompletionPeak(points[best][0], points[best][1], is_censored=False, index=best)
    return CompletionPeak(points[best][0], points[best][1], is_censored=True, index=best)

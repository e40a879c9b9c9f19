"""Knee detection: where the hit rate leaves its high plateau as the working set grows on a load ramp.

Rules:
- Input: points (load, hit rate) from a ramp, load = working set / cache capacity (or tokens), in
  any order; they are sorted by load.
- The high plateau is the median hit rate of the leading points up to the first one that falls
  below (running max - tolerance); it is the level the deployment holds while the cache fits.
- The knee is where the curve first falls below (plateau - tolerance) and stays below for
  `confirm` points (one noisy dip is not a knee), placed by linear interpolation between the last
  point on the plateau and the first point off it.
- A ramp that never leaves the plateau gives the last load with `is_censored=True`: the knee lies
  beyond what was measured, so the measured maximum is a safe (low) estimate.
- `first_off_index` is the position, in the caller's order, of the first point off the plateau
  (None when censored): the ramp step at which the cache limit was hit.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Knee:
    """Where the high plateau ends."""

    load: float
    plateau_hit_rate: float
    is_censored: bool
    first_off_index: int | None = None  # the first point off the plateau, in the input's order


def _plateau(hit_rates: Sequence[float], tolerance: float) -> float:
    leading = [hit_rates[0]]
    running_max = hit_rates[0]
    for rate in hit_rates[1:]:
        if rate < running_max - tolerance:
            break
        running_max = max(running_max, rate)
        leading.append(rate)
    return statistics.median(leading)


def find_knee(points: Sequence[tuple[float, float]], tolerance: float = 0.05, confirm: int = 2) -> Knee:
    """The knee of a ramp's (load, hit rate) points."""
    if len(points) < 2:
        raise ValueError(f"a knee needs at least 2 ramp points, got {len(points)}")
    order = sorted(range(len(points)), key=lambda k: points[k])
    loads = [points[k][0] for k in order]
    rates = [points[k][1] for k in order]
    plateau = _plateau(rates, tolerance)
    floor = plateau - tolerance
    for i in range(1, len(order)):
        window = rates[i:i + confirm]
        if rates[i] < floor and all(r < floor for r in window):
            x0, y0, x1, y1 = loads[i - 1], rates[i - 1], loads[i], rates[i]
            share = (y0 - floor) / (y0 - y1) if y0 > y1 else 0.0
            return Knee(x0 + min(max(share, 0.0), 1.0) * (x1 - x0), plateau, is_censored=False,
                        first_off_index=order[i])
    return Knee(loads[-1], plateau, is_censored=True)

"""The completion peak (basin_sim/experiments/calibrate/completion_peak.py) on synthetic ramp curves, and the
calibration record that carries it (ramp.py `calibration_record`, knee_cache.py's record format)."""

from __future__ import annotations

import math
import random
import re

import pytest

from basin_runtime.calibration import calibration_from_mapping
from basin_sim.experiments.calibrate.completion_peak import (
    CONFIRM,
    NOISE_SDS,
    find_completion_peak,
    rate_standard_error,
)
from basin_sim.experiments.calibrate.knee_cache import RECORD_FORMAT, KneeCalibration
from basin_sim.experiments.calibrate.ramp import RampStep, calibration_record, ramp_completion_peak

LOADS = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0)


def test_rising_then_flat_peaks_where_the_flat_part_starts() -> None:
    rates = (2.0, 4.0, 6.0, 8.0, 9.0, 9.1, 8.9, 9.05)  # flat from 1.0 within a noise of 0.1
    peak = find_completion_peak([(load, rate, 0.1) for load, rate in zip(LOADS, rates, strict=True)])
    assert (peak.load, peak.calls_per_s, peak.is_censored, peak.index) == (1.0, 9.0, False, 4)


def test_a_rise_within_the_noise_is_no_rise_and_one_outside_it_is() -> None:
    # the margin between two steps of standard error 0.5 is 2 x sqrt(0.5^2 + 0.5^2) = 1.41
    margin = NOISE_SDS * math.sqrt(0.5**2 + 0.5**2)
    below = [(0.2, 5.0, 0.5), (0.4, 5.0 + margin - 0.01, 0.5), (0.6, 5.0, 0.5)]
    assert find_completion_peak(below).load == 0.2
    above = [(0.2, 5.0, 0.5), (0.4, 5.0 + margin + 0.01, 0.5), (0.6, 5.0, 0.5)]
    assert find_completion_peak(above).load == 0.4
    exact = [(0.2, 5.0, None), (0.4, 5.000001, None), (0.6, 5.0, None)]  # unmeasured noise: any rise is a rise
    assert find_completion_peak(exact).load == 0.4


def test_one_noisy_step_is_not_a_turn_two_are() -> None:
    dip = [(0.2, 2.0, 0.1), (0.4, 4.0, 0.1), (0.6, 3.9, 0.1), (0.8, 6.0, 0.1), (1.0, 6.05, 0.1), (1.2, 5.0, 0.1)]
    assert CONFIRM == 2
    assert find_completion_peak(dip).load == 0.8  # the dip at 0.6 is followed by a rise: it goes on
    two = [(0.2, 2.0, 0.1), (0.4, 4.0, 0.1), (0.6, 3.9, 0.1), (0.8, 3.95, 0.1), (1.0, 9.0, 0.1)]
    assert find_completion_peak(two).load == 0.4  # two steps without a rise: completions stopped rising


def test_completions_that_fall_past_a_peak_give_the_peak() -> None:
    rates = (2.0, 4.0, 6.0, 7.0, 5.0, 3.0, 1.0, 0.5)  # the collapse past 0.8
    peak = find_completion_peak([(load, rate, 0.05) for load, rate in zip(LOADS, rates, strict=True)])
    assert (peak.load, peak.is_censored) == (0.8, False)


def test_completions_that_never_stop_rising_are_censored_at_the_last_load() -> None:
    peak = find_completion_peak([(load, 10 * load, 0.01) for load in LOADS])
    assert (peak.load, peak.calls_per_s, peak.is_censored, peak.index) == (2.0, 20.0, True, 7)


def test_the_order_of_the_points_does_not_matter_and_the_index_is_the_callers() -> None:
    points = [(load, min(10 * load, 9.0), 0.1) for load in LOADS]
    shuffled = points[:]
    random.Random(3).shuffle(shuffled)
    peak = find_completion_peak(shuffled)
    assert peak.load == find_completion_peak(points).load == 1.0
    assert shuffled[peak.index][0] == 1.0


@pytest.mark.parametrize(("points", "fragment"), [
    ([(0.2, 1.0, None)], "at least 2 ramp points, got 1"),
    ([(0.2, 1.0, None), (0.4, math.nan, None)], "finite and >= 0"),
    ([(0.2, 1.0, None), (0.4, 2.0, -1.0)], "finite and >= 0"),
])
def test_bad_points_are_refused(points: list[tuple[float, float, float | None]], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        find_completion_peak(points)


def test_the_noise_is_the_standard_error_of_the_per_minute_rates() -> None:
    steady = [k * 0.5 for k in range(240)]  # 2 calls a second for two minutes: no noise
    assert rate_standard_error(steady, 0.0, 120.0) == 0.0
    uneven = sorted([*(k * 1.0 for k in range(60)), *(60.0 + k * 0.5 for k in range(120))])  # 1/s, then 2/s
    assert rate_standard_error(uneven, 0.0, 120.0) == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    assert rate_standard_error(uneven, 0.0, 150.0) == pytest.approx(math.sqrt(0.5) / math.sqrt(2))  # whole minutes
    assert rate_standard_error(steady, 0.0, 119.0) is None  # one whole minute: no spread to measure
    with pytest.raises(ValueError, match="bin_s must be > 0"):
        rate_standard_error(steady, 0.0, 120.0, bin_s=0.0)


def step(load: float, calls_per_s: float, hit: float = 0.95, se: float | None = 0.1) -> RampStep:
    return RampStep(0.1, load, hit, 10.0, calls_per_s, 0.05, 0.3, calls_per_s_se=se)


def test_the_calibration_record_carries_the_completion_peak_beside_the_knee() -> None:
    steps = [step(0.2, 2.0), step(0.5, 5.0), step(0.8, 8.0), step(1.1, 10.0, 0.8), step(1.4, 12.0, 0.6),
             step(1.7, 12.1, 0.5), step(2.0, 11.0, 0.4)]
    record = calibration_record(steps, 1_000_000, "test ramp")
    assert ramp_completion_peak(steps).load == 1.4
    assert record["completion_peak_tokens"] == 1_400_000
    assert record["knee_tokens"] < record["completion_peak_tokens"]  # completions peak past the hit-rate knee
    assert "completion peak censored" not in record["notes"]
    calibration = calibration_from_mapping(record, "test")
    assert calibration.completion_peak_tokens == 1_400_000
    rising = calibration_record([step(0.2, 2.0), step(0.4, 4.0), step(0.6, 6.0)], 1_000_000, "test ramp")
    assert rising["completion_peak_tokens"] == 600_000
    assert "completion peak censored: completions still rose at the last step" in rising["notes"]


def test_a_record_round_trips_and_one_without_the_peak_reads_as_not_measured() -> None:
    record = {"knee_tokens": 1_000_000, "cache_capacity_tokens": 1_500_000, "completion_peak_tokens": 2_000_000,
              "reservation_ratio": 2.0}
    knee = KneeCalibration.of(record, "test")
    assert knee.calibration.completion_peak_tokens == 2_000_000 and knee.record == record
    assert knee.calibration.completion_budget_tokens() == 4_000_000  # r x the peak
    assert knee.calibration.completion_budget_tokens("prototype") == 2_000_000  # contexts: r = 1
    old = KneeCalibration.of({"knee_tokens": 1_000_000, "cache_capacity_tokens": 1_500_000}, "old")
    assert old.calibration.completion_peak_tokens is None and old.calibration.completion_budget_tokens() is None
    assert RECORD_FORMAT == 4  # the records before the completion peak are measured anew, not read as complete

"""The live ramp measures each step's call-rate noise (its per-minute rates) and writes the completion peak into
the calibration file, as the simulated ramp does (basin_sim/experiments/calibrate/completion_peak.py)."""

from __future__ import annotations

import pytest

from basin_loadgen.live_ramp import calibration_record, measure_step
from basin_loadgen.metrics_scrape import TokenCounters
from basin_loadgen.replay_summary import CallRecord, SessionRecord
from basin_runtime.calibration import calibration_from_mapping
from basin_sim.experiments.calibrate.ramp import RampStep


def test_a_step_measures_the_standard_error_of_its_per_minute_call_rates() -> None:
    # first tokens over the half [0, 120): 30 in the first minute, 90 in the second -> 0.5/s and 1.5/s
    firsts = [k * 2.0 for k in range(30)] + [60.0 + k * 60.0 / 90 for k in range(90)]
    calls = [CallRecord(k, t, 100, 100, 5, t, t, t + 0.1) for k, t in enumerate(firsts)]
    record = SessionRecord("a", "p", "b", 0.0, len(calls), status="running", calls=calls)
    step = measure_step(0.5, 0.0, 120.0, TokenCounters(0, 1), TokenCounters(0, 1), [], [record], 10_000)
    assert step.calls_per_s == 1.0
    assert step.calls_per_s_se == pytest.approx(0.5)  # sd sqrt(0.5) over sqrt(2) minutes


def test_the_live_calibration_file_carries_the_completion_peak() -> None:
    steps = [RampStep(0.1 * k, load, 0.95, 10.0, rate, 0.05, 0.3, calls_per_s_se=0.1)
             for k, (load, rate) in enumerate([(0.3, 3.0), (0.6, 6.0), (0.9, 8.0), (1.2, 8.05), (1.5, 7.0)], 1)]
    record = calibration_record(steps, 1_000_000, "basin-live-ramp", 600.0)
    assert record["completion_peak_tokens"] == 900_000
    assert calibration_from_mapping(record, "live").completion_peak_tokens == 900_000

"""The timing fit: its loss, its grids, and the committed fit file against its own script."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from basin_sim.experiments.calibrate import timing_fit
from basin_sim.workload import serving

SHIPPED = "qwen3.6-35b-a3b"


def test_the_loss_weighs_every_fact_by_its_log_error_and_a_missing_fact_is_infinite() -> None:
    exact = dict(timing_fit.TARGETS)
    assert timing_fit.loss(exact) == 0
    doubled = {**exact, "goodput_per_hour": 2 * exact["goodput_per_hour"]}
    halved = {**exact, "hit_rate_post": exact["hit_rate_post"] / 2}
    assert timing_fit.loss(doubled) == pytest.approx(math.log(2) ** 2)
    assert timing_fit.loss(halved) == pytest.approx(timing_fit.loss(doubled))
    assert timing_fit.loss({**exact, "goodput_per_hour": 0.0}) == math.inf


def test_the_fine_grid_lies_between_the_best_coarse_point_s_neighbours() -> None:
    ranges = {"reasoning_scale": (0.36, 4.8)}
    coarse = timing_fit.grid(ranges, 7)
    assert len(coarse) == 7 and min(coarse) == (0.36,) and max(coarse) == (4.8,)
    axis = timing_fit.axis(0.36, 4.8, 7)
    assert timing_fit.refined(ranges, 7, (axis[3],))["reasoning_scale"] == (axis[2], axis[4])
    assert timing_fit.refined(ranges, 7, (axis[0],))["reasoning_scale"] == (axis[0], axis[1])  # clipped at the end


def test_points_within_two_noise_units_of_the_best_loss_are_indistinguishable_from_it() -> None:
    table = [{"reasoning_scale": r, "loss": loss, "loss_noise": 0.01}
             for r, loss in ((0.5, 0.10), (0.6, 0.115), (0.7, 0.121), (0.8, 3.0))]
    alike = timing_fit.indistinguishable(table, table[0])
    assert [p["reasoning_scale"] for p in alike] == [0.5, 0.6]


def test_the_committed_fit_is_the_best_point_of_its_own_grid_inside_the_free_ranges() -> None:
    path = serving.fit_path(serving.timing_path(SHIPPED))
    fit = yaml.safe_load(path.read_text())
    assert fit["targets"] == dict(timing_fit.TARGETS)
    assert fit["scenario"] == timing_fit.SCENARIO and fit["deployment"] == "1p1d"
    ranges = serving.free_parameters(SHIPPED)
    for key, value in fit["fitted"].items():
        low, high = ranges[key]
        assert low <= value <= high, key
    best = min(fit["grid"], key=lambda p: p["loss"])
    assert set(fit["fitted"]) == set(serving.SCALES) == {"reasoning_scale"}  # tool time is sourced, not fitted
    assert best["reasoning_scale"] == fit["fitted"]["reasoning_scale"]
    for point in fit["grid"]:  # each recorded loss is the loss of its recorded means
        assert point["loss"] == pytest.approx(timing_fit.loss(point["mean"]), abs=2e-3)  # means rounded to 4 digits
    alike = timing_fit.indistinguishable(fit["grid"], best)
    assert fit["indistinguishable"]["points"] == len(alike)
    assert fit["indistinguishable"]["reasoning_scale"] == [min(p["reasoning_scale"] for p in alike),
                                                           max(p["reasoning_scale"] for p in alike)]
    assert serving.load_timing(SHIPPED).reasoning_scale == fit["fitted"]["reasoning_scale"]


@pytest.mark.integration
@pytest.mark.real_data
def test_the_fit_runs_end_to_end_on_a_tiny_grid_and_writes_a_file_the_timing_reads(tmp_path: Path,
                                                                                   real_session_table: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(serving.timing_path(SHIPPED).read_text())
    assert timing_fit.main(["--timing", str(mine), "--sessions", str(real_session_table), "--seeds", "1",
                            "--points", "2", "--jobs", "1"]) == 0
    fit = yaml.safe_load(serving.fit_path(mine).read_text())
    assert len(fit["grid"]) >= 2 and set(fit["at_fit"]["error"]) == set(timing_fit.TARGETS)
    timing = serving.load_timing(str(mine))
    assert timing.reasoning_scale == fit["fitted"]["reasoning_scale"]

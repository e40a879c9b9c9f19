"""The overload-rate search: doubling then bisection, and what a trial calls overloaded."""

from __future__ import annotations

import pytest

from basin_sim.experiments.calibrate import overload as calibrate
from basin_sim.experiments.calibrate.overload import CalibrationSettings, find_overload_rate, trial_overloads
from basin_sim.profile import Deployment
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import deployment


def test_the_search_finds_the_first_overloading_rate_to_the_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, int]] = []

    def fake(dep: Deployment, policy: str, pool: object, rate: float, seed: int, s: CalibrationSettings) -> bool:
        calls.append((rate, seed))
        return rate >= 0.237 or (seed == 1 and rate >= 0.2)  # one seed overloads early: not a majority

    monkeypatch.setattr(calibrate, "trial_overloads", fake)
    found = find_overload_rate(deployment(), "sglang", [], CalibrationSettings(resolution_per_s=0.01))
    assert 0.237 <= found.overload_rate_per_s < 0.237 + 0.01
    assert [rate for rate, _ in found.tried[:4]] == [0.05, 0.1, 0.2, 0.4]
    assert found.tried[2] == (0.2, 1) and found.tried[3] == (0.4, 5)
    assert len(calls) == 5 * len(found.tried)


def test_a_trial_overloads_only_when_requests_keep_waiting() -> None:
    pool = generate_corpus(3, 10)
    small = deployment(cache_tokens=60_000, decode_tokens=200_000)
    settings = CalibrationSettings(horizon_s=900.0)
    assert not trial_overloads(small, "sglang", pool, 0.002, seed=1, settings=settings)
    assert trial_overloads(small, "sglang", pool, 0.5, seed=1, settings=settings)

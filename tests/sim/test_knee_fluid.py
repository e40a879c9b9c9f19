from __future__ import annotations

import math
import random

import pytest

from basin_sim.experiments.calibrate.fluid import FixedPoint, drift, fixed_points, risk_test
from basin_sim.experiments.calibrate.knee import find_knee


def _logistic_ramp(knee: float, noise: float, seed: int) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    loads = [0.1 * i for i in range(1, 21)]
    return [(x, 0.95 - 0.7 / (1 + math.exp(-(x - knee) * 25)) + rng.gauss(0, noise)) for x in loads]


@pytest.mark.parametrize("knee", [0.6, 0.85, 1.2])
def test_knee_of_a_noisy_logistic_drop(knee: float) -> None:
    for seed in range(5):
        found = find_knee(_logistic_ramp(knee, noise=0.01, seed=seed))
        assert not found.is_censored
        assert found.plateau_hit_rate == pytest.approx(0.95, abs=0.02)
        assert knee - 0.2 < found.load < knee + 0.05  # where the curve leaves plateau - 0.05


def test_a_single_dip_is_not_a_knee_and_order_does_not_matter() -> None:
    points = [(0.1, 0.95), (0.2, 0.94), (0.3, 0.80), (0.4, 0.95), (0.5, 0.94), (0.6, 0.5), (0.7, 0.3)]
    found = find_knee(list(reversed(points)))
    assert 0.5 < found.load < 0.6 and found.plateau_hit_rate == pytest.approx(0.945)


def test_a_ramp_that_never_leaves_the_plateau_is_censored() -> None:
    found = find_knee([(0.2, 0.9), (0.4, 0.92), (0.8, 0.91)])
    assert found.is_censored and found.load == 0.8
    with pytest.raises(ValueError, match="at least 2 ramp points"):
        find_knee([(0.1, 0.9)])


# X(N): calls/s rising to a peak near the cache knee, then falling as misses slow prefill.
NS = [0, 50, 100, 150, 200, 250, 300]
XS = [0, 20, 40, 50, 35, 20, 15]


def test_fixed_points_are_one_stable_and_one_unstable() -> None:
    points = fixed_points(NS, XS, arrival_rate_per_s=1.0, calls_per_session=30)  # X/K = 1 at X = 30
    assert points == [FixedPoint(75.0, True), FixedPoint(pytest.approx(216.6667), False)]
    assert drift(NS, XS, 1.0, 30, 80) < 0 < drift(NS, XS, 1.0, 30, 70)  # pushed back to 75 from both sides
    assert drift(NS, XS, 1.0, 30, 230) > 0  # past the unstable point N grows on its own


def test_too_much_load_has_no_fixed_point_and_bad_input_is_refused() -> None:
    assert fixed_points(NS, XS, arrival_rate_per_s=2.0, calls_per_session=30) == []
    with pytest.raises(ValueError, match="strictly increasing"):
        fixed_points([0, 10, 10], [0, 1, 2], 1.0, 1.0)


def test_risk_test_verdicts() -> None:
    cache_first = risk_test(knee_tokens=2_000_000, mean_context_tokens=20_000, decode_capacity_tokens=3_000_000,
                            decode_holding_share=0.3)
    # decode: 3M / ((20,000 + 512 headroom) x 0.3) = 487.5 live sessions
    assert cache_first.cache_limit_sessions == 100
    assert cache_first.decode_limit_sessions == pytest.approx(3_000_000 / (20_512 * 0.3))
    assert cache_first.verdict == "cache-first" and "100 live sessions" in cache_first.describe()
    decode_first = risk_test(2_000_000, 20_000, 300_000, 0.5)
    assert decode_first.verdict == "decode-first"


def test_the_knee_names_the_first_point_off_the_plateau_in_the_callers_order() -> None:
    points = [(0.1, 0.95), (0.9, 0.3), (0.3, 0.94), (0.6, 0.5), (0.2, 0.95)]  # off the plateau from 0.6 on
    assert find_knee(points).first_off_index == 3
    assert find_knee([(0.2, 0.9), (0.4, 0.92)]).first_off_index is None

"""Small parts: the queue key of a priority, the lag window, the weighted histogram."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from basin_emulate.clock import LagWindow
from basin_emulate.metrics import WeightedHistogram
from basin_emulate.ordering import QueueOrder


def test_a_missing_priority_runs_last_under_priority_scheduling() -> None:
    for order in (QueueOrder(True), QueueOrder(True, True)):
        assert order.key(None) > max(order.key(p) for p in (-(10**9), 0, 10**9))
    assert QueueOrder().key(None) == QueueOrder().key(7) == 0.0


def test_the_lag_window_reports_quantiles_of_timer_lateness() -> None:
    window = LagWindow(window_s=10.0)
    for k in range(100):
        window.record(float(k) / 10, k / 1000)
    summary = window.summary(10.0)
    assert (summary.count, summary.p50_s, summary.p99_s, summary.max_s) == (100, 0.049, 0.098, 0.099)
    later = window.summary(15.0)  # the first 50 samples left the window
    assert later.count == 50 and later.max_s == 0.099
    assert LagWindow().summary(0.0).count == 0


def test_a_weighted_observation_equals_that_many_observations() -> None:
    weighted_registry, plain_registry = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("x_seconds", "doc", "m", (0.01, 0.1))
    weighted_registry.register(weighted)
    plain = Histogram("x_seconds", "doc", ["model_name"], registry=plain_registry, buckets=(0.01, 0.1)).labels("m")
    for value, count in ((0.01, 3), (0.05, 1), (5.0, 2)):
        weighted.observe(value, count)
        for _ in range(count):
            plain.observe(value)
    plain_lines = [line for line in generate_latest(plain_registry).decode().splitlines() if "_created" not in line]
    assert generate_latest(weighted_registry).decode().splitlines() == plain_lines

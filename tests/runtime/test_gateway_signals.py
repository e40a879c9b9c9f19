"""The hit-rate and first-token latency windows, and reading usage from upstream answers."""

from __future__ import annotations

import math

import pytest

from basin_runtime.gateway.signals import Usage, usage_of
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import LatencyWindow


def test_the_window_is_cached_over_prompt_tokens_of_the_calls_inside_it() -> None:
    window = HitRateWindow(window_s=10.0, min_prompt_tokens=100)
    assert window.rate(0.0) is None
    window.record(0.0, 60, 30)
    assert window.rate(0.0) is None  # 60 < 100 prompt tokens: too little evidence
    window.record(5.0, 140, 140)
    assert window.rate(5.0) == pytest.approx(170 / 200)
    assert window.rate(10.0) == pytest.approx(170 / 200)  # the first call is exactly at the edge: kept
    assert window.rate(10.5) == 1.0  # the first call left the window
    window.record(11.0, 100, 0)
    assert window.rate(11.0) == pytest.approx(140 / 240)
    assert window.rate(30.0) is None


def test_cached_is_clipped_to_the_prompt_and_empty_prompts_are_ignored() -> None:
    window = HitRateWindow(window_s=10.0, min_prompt_tokens=1)
    window.record(0.0, 10, 50)
    window.record(0.0, 0, 5)
    assert window.rate(0.0) == 1.0


def test_the_window_holds_at_most_max_samples_calls() -> None:
    window = HitRateWindow(window_s=100.0, min_prompt_tokens=1, max_samples=2)
    window.record(0.0, 100, 100)
    window.record(1.0, 100, 0)
    window.record(2.0, 100, 0)
    assert window.rate(2.0) == 0.0


def test_usage_comes_from_openai_usage_or_generate_meta_info() -> None:
    openai = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert usage_of(openai) == Usage(9, 2, 4)
    assert usage_of({"usage": {"prompt_tokens": 9, "completion_tokens": 2}}) == Usage(9, 2, None)
    assert usage_of({"meta_info": {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 5}}) == Usage(7, 3, 5)
    assert usage_of({"usage": None}) is None
    assert usage_of([1, 2]) is None
    assert usage_of({"usage": {"prompt_tokens": -1, "completion_tokens": True}}) == Usage(None, None, None)


def test_the_latency_window_is_the_median_of_recent_first_tokens_and_of_calls_still_waiting() -> None:
    window = LatencyWindow(window_s=60.0, min_calls=3)
    for now, ttft in ((0.0, 9.0), (70.0, 0.2), (71.0, 0.3)):
        window.record(now, ttft)
    assert window.median_s(72.0) is None  # the 9 s call left the window: two calls are too few
    assert window.median_s(72.0, waiting_s=[0.1]) == pytest.approx(0.2)
    # engines that stop answering read as slow: the waits count, however few first tokens come back
    assert window.median_s(72.0, waiting_s=[40.0, 50.0, 60.0]) == pytest.approx(40.0)
    window.record(80.0, 0.25)
    assert window.median_s(80.0) == pytest.approx(0.25)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="finite number of seconds >= 0"):
            window.record(81.0, bad)
    assert window.median_s(80.0) == pytest.approx(0.25)  # a refused record changed nothing
    with pytest.raises(ValueError, match="min_calls must be >= 1"):
        LatencyWindow(min_calls=0)

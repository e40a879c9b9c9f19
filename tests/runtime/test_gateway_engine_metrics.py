"""The engines' /metrics scrape: the parser on a literal SGLang sample, the window math, and the
scraper through an `httpx.MockTransport` (failures counted and logged once a minute), and precedence."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from basin_runtime.clock import ManualClock
from basin_runtime.gateway.app import build_gateway
from basin_runtime.gateway.config import load_config
from basin_runtime.gateway.engine_metrics import EngineHitWindow, EngineScraper, hit_counts
from tests.runtime.test_gateway_config import EXAMPLE, parse

SAMPLE = """\
# HELP sglang:prefill_effective_tokens_total Prefill tokens by where they came from.
# TYPE sglang:prefill_effective_tokens_total counter
sglang:prefill_effective_tokens_total{engine_type="unified",mode="device_hit",model_name="qwen"} 600.0
sglang:prefill_effective_tokens_total{engine_type="unified",mode="host_hit",model_name="qwen"} 150.0
sglang:prefill_effective_tokens_total{engine_type="unified",mode="storage_hit",model_name="qwen"} 50.0
sglang:prefill_effective_tokens_total{engine_type="unified",mode="compute",model_name="qwen"} 200.0
# HELP sglang:cached_tokens_total Cached tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="qwen"} 1.0
# HELP sglang:num_running_reqs Running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 3.0
"""
FALLBACK = """\
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="qwen"} 300.0
sglang:cached_tokens_total{cache_source="host",model_name="qwen"} 100.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="qwen"} 1000.0
"""


def effective(hit: float, compute: float) -> str:
    return ("# TYPE sglang:prefill_effective_tokens_total counter\n"
            f'sglang:prefill_effective_tokens_total{{mode="device_hit"}} {hit}\n'
            f'sglang:prefill_effective_tokens_total{{mode="compute"}} {compute}\n')


def test_the_parser_reads_effective_tokens_and_falls_back_to_cached_vs_prompt() -> None:
    assert hit_counts(SAMPLE) == (800.0, 1000.0)
    assert hit_counts(FALLBACK) == (400.0, 1000.0)
    assert hit_counts("# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\n") is None


def test_the_window_takes_counter_increases_summed_over_engines() -> None:
    window = EngineHitWindow(window_s=10.0, min_prompt_tokens=100)
    window.record("a", 0.0, 0.0, 0.0)
    assert window.rate(0.0) is None  # no increase yet
    window.record("a", 5.0, 80.0, 100.0)
    window.record("b", 5.0, 1000.0, 5000.0)  # b's first sample is only its baseline
    assert window.rate(5.0) == pytest.approx(0.8)
    window.record("b", 10.0, 1000.0, 5100.0)
    assert window.rate(10.0) == pytest.approx(80 / 200)
    window.record("a", 20.0, 80.0, 200.0)  # a's baseline: its sample at t=5
    assert window.rate(20.0) == pytest.approx(0.0)  # a: +0 hit / +100; b: baseline t=10 (+0 / +0)
    window.record("a", 21.0, 10.0, 20.0)  # a restarted: its history starts again
    assert window.rate(21.0) is None
    window.record("a", 30.0, 200.0, 400.0)
    assert window.rate(30.0) == pytest.approx(190 / 380)


@pytest.mark.asyncio
async def test_the_scraper_records_counts_and_counts_failures_logging_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    bodies = {"http://e1/metrics": [effective(0, 0), effective(300, 100)]}
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        calls["n"] += 1
        queue = bodies[str(request.url)]
        return httpx.Response(200, text=queue.pop(0) if len(queue) > 1 else queue[0])

    clock = {"now": 0.0}
    errors = Counter("basin_engine_scrape_errors", "test", registry=CollectorRegistry())
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    scraper = EngineScraper(["http://e1/metrics", "http://down/metrics"], EngineHitWindow(60.0, 1),
                            lambda: clock["now"], errors, client=client)
    try:
        with caplog.at_level(logging.WARNING, logger="basin_runtime.gateway.engine_metrics"):
            await scraper.scrape_once()
            clock["now"] = 5.0
            await scraper.scrape_once()
            assert scraper.window.rate(5.0) == pytest.approx(300 / 400)
            clock["now"] = 70.0
            await scraper.scrape_once()
    finally:
        await scraper.aclose()
    assert scraper.window.rate(70.0) is None  # no increase in the last minute
    assert errors._value.get() == 3
    assert len([r for r in caplog.records if "http://down/metrics" in r.getMessage()]) == 2  # t=0 and t=70


def test_engine_metrics_options_from_the_command_line() -> None:
    config = load_config({"upstream": "http://r", "model": ["m.onnx"], "engine_metrics_urls": [
        "http://e1:30000/metrics", "http://e2:30000/metrics"], "engine_metrics_interval_s": 2.0})
    assert list(config.engine_metrics_urls) == ["http://e1:30000/metrics", "http://e2:30000/metrics"]
    assert config.engine_metrics_interval_s == 2.0
    assert load_config({"upstream": "http://r", "model": ["m.onnx"]}).engine_metrics_urls == ()


def test_scraped_engines_take_precedence_over_the_upstream_usage_window() -> None:
    config = parse("--config", str(EXAMPLE), "--engine-metrics", "http://127.0.0.1:9/metrics",
                   "--hit-rate-min-prompt-tokens", "10")
    gateway = build_gateway(config, clock=ManualClock())
    assert gateway.telemetry.engine_scraper is not None
    try:
        now = gateway.room.clock.now()
        gateway.telemetry.hit_window.record(now, 100, 10)
        assert gateway.hit_rate() == pytest.approx(0.1)  # engines without evidence yet: the usage window
        gateway.telemetry.engine_scraper.window.record("e", now, 0.0, 0.0)
        gateway.telemetry.engine_scraper.window.record("e", now, 90.0, 100.0)
        assert gateway.hit_rate() == pytest.approx(0.9)
    finally:
        asyncio.run(gateway.telemetry.engine_scraper.aclose())
        asyncio.run(gateway.upstream.aclose())

"""The emulator's Prometheus metrics, under SGLang's names, in a registry of its own (one per app).

Rules:
- State (load, memory, PD queues, cache counters) is read from an `EngineState` at each scrape by a
  collector, so it is never stale; request latencies and token counts are histograms and counters fed
  as requests finish. Every SGLang family carries the `model_name` label, as SGLang's do.
- Token modes as SGLang's `sglang:prefill_effective_tokens_total{mode}`: input (computed),
  device_hit, host_hit, storage_hit. `sglang:cached_tokens_total{cache_source}` counts each finished
  request's cached tokens by source (device, host, storage; a source with 0 tokens is not counted), on
  prefill and on decode alike, as SGLang's tokenizer metrics do (observe_one_finished_request).
  `sglang:prefetched_tokens_total` (storage -> host) and `sglang:backuped_tokens_total` (to storage).
- `sglang:num_requests_total` carries SGLang's `priority` label (the request's priority with priority
  scheduling on, else empty): the label set grows with every distinct value clients send.
- Latencies are wall seconds. Inter-token latency is observed once per generated token after the
  first, at the request's mean (as SGLang spreads a chunk's interval over its tokens), in one step per
  request (`WeightedHistogram`), so a 4k-token answer costs one bisect, not 4k observations.
- With `--enable-session-radix-cache`, `basin_emulate_session_*` (SESSION_COUNTS): tagged requests,
  references taken, late finishes, closes, chains dereferenced, and the tags holding a reference now
  (session_refs.py).
- `basin_emulate_lag_seconds` is the lateness of every timed event;
  `basin_emulate_lag_window_seconds{quantile}` its p50/p99/max over the lag window.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from basin_emulate.clock import LagSummary
from basin_emulate.session_refs import SessionRefs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS_S = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2,
                 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
E2E_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
LAG_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
CACHE_SOURCES = ("device", "host", "storage")
SESSION_COUNTS = {  # EngineState.session_cache key -> (basin_emulate_session_* family, help, is a counter)
    "tagged_requests": ("tagged_requests", "Requests that carried a session_id", True),
    "references_taken": ("references_taken", "Tagged normal finishes that took their session's reference", True),
    "late_finishes": ("late_finishes", "Tagged finishes of closed sessions (no reference taken)", True),
    "sessions_closed": ("closes", "/close_session calls, repeats included", True),
    "references_dropped": ("references_dropped", "Cache chains dereferenced by a close", True),
    "open_sessions": ("open", "Session tags holding a reference now", False),
}
PD_QUEUES = ("num_prefill_bootstrap_queue_reqs", "num_prefill_inflight_queue_reqs",
             "num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs")


@dataclass(frozen=True)
class EngineState:
    """What one emulated server holds now, for /metrics, /v1/loads and /server_info."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int  # in use by requests (pinned cache, or decode reservations)
    max_total_num_tokens: int
    kv_available_tokens: int  # free pool
    kv_evictable_tokens: int  # cached but unpinned
    cache_hit_rate: float  # of the last prefill batch (SGLang's gauge)
    pd_queues: dict[str, int]  # PD_QUEUES
    effective_tokens: dict[str, int]  # by mode: input, device_hit, host_hit, storage_hit
    generation_tokens: int
    prefetched_tokens: int = 0  # from the storage tier to the host
    backed_up_tokens: int = 0  # written to the storage tier
    session_cache: dict[str, int] | None = None  # SESSION_COUNTS, with --enable-session-radix-cache only

    @property
    def token_usage(self) -> float:
        """Share of the pool in use by requests."""
        return self.num_used_tokens / self.max_total_num_tokens


class WeightedHistogram(Collector):
    """A histogram that takes `count` equal observations in one step."""

    def __init__(self, name: str, documentation: str, model_name: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Observe `value`, `count` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else f"{bound:g}", float(cumulative)))
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class _StateCollector(Collector):
    def __init__(self, model_name: str, time_scale: float, state: Callable[[], EngineState],
                 lag: Callable[[], LagSummary]) -> None:
        self.model_name = model_name
        self.time_scale = time_scale
        self.state = state
        self.lag = lag

    def describe(self) -> list[Metric]:
        return []  # its families are built at each scrape; nothing to read before the server exists

    def collect(self) -> Iterator[Metric]:
        state, labels, value = self.state(), ["model_name"], [self.model_name]
        gauges = {
            "num_running_reqs": (state.num_running_reqs, "Running requests"),
            "num_queue_reqs": (state.num_queue_reqs, "Waiting requests"),
            "num_used_tokens": (state.num_used_tokens, "KV tokens in use by requests"),
            "max_total_num_tokens": (state.max_total_num_tokens, "KV pool size in tokens"),
            "token_usage": (state.token_usage, "Share of the KV pool in use"),
            "kv_available_tokens": (state.kv_available_tokens, "Free KV tokens"),
            "kv_evictable_tokens": (state.kv_evictable_tokens, "Cached, unpinned KV tokens"),
            "cache_hit_rate": (state.cache_hit_rate, "Prefix hit rate of the last prefill batch"),
            **{name: (state.pd_queues.get(name, 0), "PD queue length") for name in PD_QUEUES},
        }
        for name, (number, doc) in gauges.items():
            family = GaugeMetricFamily(f"sglang:{name}", doc, labels=labels)
            family.add_metric(value, number)
            yield family
        effective = CounterMetricFamily("sglang:prefill_effective_tokens", "Prompt tokens by how prefill got them",
                                        labels=[*labels, "mode"])
        for mode, tokens in state.effective_tokens.items():
            effective.add_metric([*value, mode], tokens)
        yield effective
        for name, tokens, doc in (("prefetched_tokens", state.prefetched_tokens, "Tokens prefetched from storage"),
                                  ("backuped_tokens", state.backed_up_tokens, "Tokens backed up to storage")):
            counter = CounterMetricFamily(f"sglang:{name}", doc, labels=labels)
            counter.add_metric(value, tokens)
            yield counter
        generated = CounterMetricFamily("sglang:generation_tokens", "Generated tokens", labels=labels)
        generated.add_metric(value, state.generation_tokens)
        yield generated
        if state.session_cache is not None:
            yield from _session_families(state.session_cache)
        scale = GaugeMetricFamily("basin_emulate_time_scale", "Model seconds per wall second")
        scale.add_metric([], self.time_scale)
        yield scale
        lag = self.lag()
        window = GaugeMetricFamily("basin_emulate_lag_window_seconds",
                                   f"Timed-event lateness over the last {lag.window_s:g} s", labels=["quantile"])
        for quantile, seconds in (("0.5", lag.p50_s), ("0.99", lag.p99_s), ("1", lag.max_s)):
            window.add_metric([quantile], seconds)
        yield window


def session_counts(refs: SessionRefs) -> dict[str, int]:
    """What the session radix cache did, keyed as SESSION_COUNTS."""
    return {"tagged_requests": refs.tagged_requests, "references_taken": refs.references_taken,
            "late_finishes": refs.late_finishes,
            "sessions_closed": refs.sessions_closed, "references_dropped": refs.references_dropped,
            "open_sessions": refs.num_open_sessions}


def _session_families(counts: Mapping[str, int]) -> Iterator[Metric]:
    for key, (name, doc, is_counter) in SESSION_COUNTS.items():
        kind = CounterMetricFamily if is_counter else GaugeMetricFamily
        family = kind(f"basin_emulate_session_{name}", doc)
        family.add_metric([], counts[key])
        yield family


class EmulatorMetrics:
    """Every metric one emulated server exports."""

    def __init__(self, model_name: str, time_scale: float, state: Callable[[], EngineState],
                 lag: Callable[[], LagSummary]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(model_name)
        self.requests_by_priority = Counter("sglang:num_requests", "Finished requests (by priority when priority "
                                            "scheduling is on, as SGLang labels them)", [*labels, "priority"],
                                            registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Cached prompt tokens of finished requests by source",
                                     [*labels, "cache_source"], registry=r)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Time to first token", labels, registry=r,
                              buckets=TTFT_BUCKETS_S).labels(model_name)
        self.itl = WeightedHistogram("sglang:inter_token_latency_seconds", "Time between tokens", model_name,
                                     ITL_BUCKETS_S)
        r.register(self.itl)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency", labels, registry=r,
                             buckets=E2E_BUCKETS_S).labels(model_name)
        self.lag = Histogram("basin_emulate_lag_seconds", "How late timed events of the model ran (wall)",
                             registry=r, buckets=LAG_BUCKETS_S)
        r.register(_StateCollector(model_name, time_scale, state, lag))

    def finished(self, prompt_tokens: int, completion_tokens: int, ttft_s: float, e2e_s: float,
                 cached_details: Mapping[str, int | str] | None = None, priority: int | None = None) -> None:
        """One request answered: its tokens, cached tokens by source and wall latencies (inter-token = mean over
        its decode)."""
        self.requests_by_priority.labels(self.model_name, "" if priority is None else str(priority)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        for source, tokens in (cached_details or {}).items():
            if source in CACHE_SOURCES and isinstance(tokens, int) and tokens > 0:
                self.cached_tokens.labels(self.model_name, source).inc(tokens)
        self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)
        if completion_tokens > 1:
            self.itl.observe(max(0.0, e2e_s - ttft_s) / (completion_tokens - 1), completion_tokens - 1)

    def exposition(self) -> bytes:
        """The text format of every metric."""
        return generate_latest(self.registry)

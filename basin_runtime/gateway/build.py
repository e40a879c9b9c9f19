"""Building the gateway whole from its `GatewayConfig`: every part made once, each given what it needs.

Rules:
- `build_gateway` loads the tokenizer, every model and the calibration before anything is built, so a
  bad file stops start-up with `ConfigError` naming it; without a client given, the gateway gets its own
  (`upstream_client`), made once everything has loaded.
- With `engine_session_cache` the telemetry holds the engines' session closer (`engine_sessions.py`) and
  the gateway tags every forwarded call with its session (`GatewaySettings.tags_engine_sessions`).
- The parts are made in the one order that needs no wiring afterwards (`assemble`): the telemetry first
  (metrics, signals, lending, session log); with `--state` the shared backend (given the telemetry's
  hooks) and its coordinator (given the telemetry's signal report); then the waiting room, given its
  signals (the telemetry's, or with `--state` the deployment's, as the leader combines them) and its
  listener (the telemetry); then the gateway with the live-sessions file read (`restart.py`).
- Redis is imported only with `--state` (`shared_state`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from basin_runtime.clock import Clock, MonotonicClock
from basin_runtime.gateway.config import ConfigError, GatewayConfig, gateway_policy_config, read_calibration
from basin_runtime.gateway.engine_metrics import EngineHitWindow, EngineScraper
from basin_runtime.gateway.engine_sessions import EngineSessions
from basin_runtime.gateway.gateway import DEFAULT_ADOPTION_WINDOW_S, Gateway, GatewaySettings
from basin_runtime.gateway.http1 import Http1UpstreamClient
from basin_runtime.gateway.identity import ForeignCall
from basin_runtime.gateway.lending import LendingTracker
from basin_runtime.gateway.measure import Meter
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.predictors import Predictors
from basin_runtime.gateway.priority import PriorityLevels
from basin_runtime.gateway.proxy import Upstream
from basin_runtime.gateway.restart import LiveSessionsFile, Restart
from basin_runtime.gateway.session_log import SessionLogWriter
from basin_runtime.gateway.task_memory import GatewayTaskMemory, TaskPeaks
from basin_runtime.gateway.telemetry import DeploymentSignals, Telemetry
from basin_runtime.gateway.upstream import UpstreamClient
from basin_runtime.gateway.waiting import WaitingRoom
from basin_runtime.policy import Policy, PolicyConfig
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.policy.latency import DEFAULT_MIN_CALLS
from basin_runtime.session_keys import SessionKeys
from basin_runtime.task_memory import Shrinkage, TaskMemoryError, load_shrinkage
from basin_runtime.task_text import TaskTextError, TaskTextRule
from basin_runtime.tokenizer import TokenizerError, get_tokenizer

if TYPE_CHECKING:
    from basin_runtime.state.leases import Coordinator


def build_gateway(config: GatewayConfig, client: UpstreamClient | None = None,
                  clock: Clock | None = None) -> Gateway:
    """The gateway `config` describes, built whole; `ConfigError` if a file it names cannot be used."""
    try:
        tokenizer = get_tokenizer(config.tokenizer)
        rule = TaskTextRule(config.task_text_pattern)
    except (TokenizerError, TaskTextError) as exc:
        raise ConfigError(str(exc)) from exc
    calibration = None if config.calibration is None else read_calibration(config.calibration, config)
    policy_settings = gateway_policy_config(config, calibration)
    predictors = Predictors.load(config.default_model, config.workload_models, tokenizer.name,
                                 config.reservation_quantile, config.revise_at_calls)
    clock = clock or MonotonicClock()
    telemetry = telemetry_for(config, clock, tokenizer.name)
    coordinator = None if config.state is None else shared_state(config, policy_settings, telemetry)
    settings = GatewaySettings(
        session_header=config.session_header, workload_header=config.workload_header,
        routing_key_header=config.routing_key_header, foreign_call=cast(ForeignCall, config.foreign_call),
        is_shadow=config.shadow, limits=config.limits, tick_interval_s=config.tick_interval_s,
        idle_timeout_s=config.idle_timeout_s, tags_engine_sessions=config.engine_session_cache,
        session_keys=SessionKeys(config.admin_token, run="" if coordinator is not None else None))
    upstream = Upstream(client if client is not None else upstream_client(config, clock), clock)
    live_sessions = None if config.live_sessions_file is None else LiveSessionsFile(config.live_sessions_file)
    meter = Meter(tokenizer, rule, max_prefix_bytes=config.resend_memo_bytes)
    return assemble(settings, clock, meter, predictors, upstream, telemetry,
                    policy=Policy(policy_settings) if coordinator is None else None, coordinator=coordinator,
                    retry_after_s=config.retry_after_s,
                    levels=PriorityLevels(config.engine_priority_levels, config.engine_preemption_threshold),
                    live_sessions=live_sessions, adoption_window_s=config.adoption_window_s)


def assemble(settings: GatewaySettings, clock: Clock, meter: Meter, predictors: Predictors, upstream: Upstream,
             telemetry: Telemetry, *, retry_after_s: float, policy: Policy | None = None,
             coordinator: Coordinator | None = None, levels: PriorityLevels | None = None,
             live_sessions: LiveSessionsFile | None = None,
             adoption_window_s: float = DEFAULT_ADOPTION_WINDOW_S) -> Gateway:
    """The waiting room (on `policy` in process, or on the coordinator's shared backend) and the gateway around it,
    from parts already made (see the rules: the coordinator was given the telemetry's report and hooks)."""
    if coordinator is None:
        room = WaitingRoom(policy, clock, retry_after_s=retry_after_s, signals=telemetry, listener=telemetry,
                           levels=levels)
    else:
        room = WaitingRoom(None, clock, retry_after_s=retry_after_s, signals=DeploymentSignals(coordinator),
                           listener=telemetry, levels=levels, backend=coordinator.backend)
    restart = Restart.begin(live_sessions, clock.now(), adoption_window_s)
    return Gateway(settings, room, meter, predictors, upstream, telemetry, restart, coordinator)


def telemetry_for(config: GatewayConfig, clock: Clock, tokenizer_name: str) -> Telemetry:
    """The metrics, signal windows, engines' scraper (when configured), lending reports and session log of `config`."""
    metrics = GatewayMetrics()
    hit_window = HitRateWindow(config.hit_rate_window_s, config.hit_rate_min_prompt_tokens)
    scraper = None if not config.engine_metrics_urls else EngineScraper(
        config.engine_metrics_urls, EngineHitWindow(hit_window.window_s, hit_window.min_prompt_tokens), clock.now,
        metrics.engine_scrape_errors, interval_s=config.engine_metrics_interval_s)
    session_log = None if config.session_log is None else SessionLogWriter(
        config.session_log, max_bytes=config.session_log_max_bytes, keep_files=config.session_log_keep_files,
        keep_text=config.session_log_keep_text)
    engine_sessions = None if not config.engine_session_cache else EngineSessions(
        config.session_close_urls, metrics.engine_session_close_failures, clock.now,
        timeout_s=config.engine_close_timeout_s)
    task_memory = None if config.task_memory is None else GatewayTaskMemory(
        read_shrinkage(config.task_memory), metrics.registry,
        None if config.state is None else shared_task_peaks(config))
    return Telemetry(clock, metrics, tokenizer_name=tokenizer_name, hit_window=hit_window, lending=LendingTracker(),
                     session_log=session_log, engine_scraper=scraper, engine_sessions=engine_sessions,
                     task_memory=task_memory)


def read_shrinkage(path: Path) -> Shrinkage:
    """The task-memory file's k (`--task-memory`); `ConfigError` naming the file if it cannot be used."""
    try:
        return load_shrinkage(path)
    except TaskMemoryError as exc:
        raise ConfigError(f"--task-memory: {exc}") from exc


def shared_task_peaks(config: GatewayConfig) -> TaskPeaks:
    """The memory of finished tasks in the shared Redis of `--state` (redis imported only here)."""
    from basin_runtime.state.redis_backend import redis_client
    from basin_runtime.state.task_peaks import RedisTaskPeaks

    assert config.state is not None
    lease_s = config.state_lease_s  # the timeouts of the backend's command client (`RedisBackend.start`)
    return RedisTaskPeaks(redis_client(config.state, socket_timeout=max(2.0, lease_s),
                                       socket_connect_timeout=max(1.0, lease_s / 2)))


def shared_state(config: GatewayConfig, policy_settings: PolicyConfig, telemetry: Telemetry) -> Coordinator:
    """The shared state's backend and coordinator for `--state` (redis imported only here), reporting to
    `telemetry` and on its clock."""
    from basin_runtime.state.leases import Coordinator
    from basin_runtime.state.redis_backend import RedisBackend

    assert config.state is not None
    backend = RedisBackend(config.state, policy_settings, lease_s=config.state_lease_s,
                           retry_after_s=max(1.0, config.state_lease_s), hooks=telemetry.state_hooks(),
                           clock=telemetry.clock)
    return Coordinator(backend, telemetry.signal_report, orphan_window_s=config.adoption_window_s,
                       tick_interval_s=config.tick_interval_s, min_prompt_tokens=config.hit_rate_min_prompt_tokens,
                       min_calls=DEFAULT_MIN_CALLS)


def upstream_client(config: GatewayConfig, clock: Clock) -> UpstreamClient:
    """The HTTP client to the upstream (`http1.py`), with the gateway's timeouts on its clock, no connection cap."""
    return Http1UpstreamClient(config.upstream, connect_s=config.upstream_connect_timeout_s,
                               read_s=config.upstream_timeout_s, max_head_bytes=config.max_header_bytes, clock=clock)

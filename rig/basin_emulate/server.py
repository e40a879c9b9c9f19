"""The HTTP surface of one emulated SGLang server (either role), and building the Starlette app from a config.

Rules:
- Inference: POST /generate, /v1/chat/completions, /v1/completions go to the role's `answer`.
- Info, as SGLang answers them: /health, /health_generate, /server_info and /get_server_info,
  /model_info and /get_model_info, /v1/models (owned_by "sglang"), /v1/loads and /loads,
  POST /flush_cache (device and host tiers; never storage), POST /hicache/storage-backend/clear (the
  storage tier; 400 without one), GET/POST /close_session (body {"session_id": str}, SGLang's
  CloseSessionReqInput; 200 with an empty body whatever the session, flag on or off, as SGLang's route
  answers once its tokenizer manager has passed the close on), and /metrics with --enable-metrics.
  /version is NOT served (404): smg takes a worker that answers both /version and /server_info for vLLM
  and then speaks vLLM's PD protocol.
- /server_info adds what the emulator is: time_scale, profile, model time, and the scheduler lag
  (p50/p99/max over the lag window) under "basin_emulate", so a run can be judged after the fact.
- `max_running_requests` is reported with SGLang's default formula; the emulator never enforces it
  (requests are limited by KV memory only, as in basin_sim).
- Errors become responses only through `errors.error_response`.
- The lifespan starts the model clock, then the role (prefill: its bootstrap port; decode: its HTTP
  client), and closes the role on shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from basin_emulate.calls import Call, Endpoint, parse_call, parse_close_session
from basin_emulate.clock import LagWindow, ModelClock
from basin_emulate.config import EmulatorConfig
from basin_emulate.context import ServerContext
from basin_emulate.decode_server import DecodeServer
from basin_emulate.errors import ClientGoneError, EmulatorError, error_response
from basin_emulate.identity import PromptCounter
from basin_emulate.metrics import CONTENT_TYPE, EmulatorMetrics, EngineState
from basin_emulate.ordering import QueueOrder
from basin_emulate.prefill_server import PrefillServer
from basin_runtime.clock import Clock
from basin_runtime.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)
SGLANG_VERSION = "0.5.23"  # the API the emulator follows (../shared/design/SGLANG_NOTES.md)
CONTEXT_LENGTH = 262_144  # Qwen3.6's context window, for SGLang's max_running_requests formula
CLIENT_CLOSED_STATUS = 499  # nobody reads it: the client is gone
FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


class Role(Protocol):
    """What the server needs of a prefill or decode role."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def answer(self, call: Call, receive: Receive) -> Response: ...

    def flush(self) -> bool: ...

    def clear_storage(self) -> bool: ...

    def close_session(self, session_id: str) -> None: ...

    def state(self) -> EngineState: ...


def max_running_requests(max_total_tokens: int) -> int:
    """SGLang's default when --max-running-requests is not set (reported, not enforced)."""
    return min(max(int(max_total_tokens / CONTEXT_LENGTH * 512), 2048), 4096)


def build_app(config: EmulatorConfig, wall: Clock | None = None) -> Starlette:
    """The emulated server for `config` (the tokenizer is loaded here), on the `wall` clock (the real one if None)."""
    lag = LagWindow()
    clock = ModelClock(config.time_scale, lag, wall)
    order = QueueOrder(config.enable_priority_scheduling, config.schedule_low_priority_values_first)
    role: Role | None = None

    def state() -> EngineState:  # the metrics read the role, which records into the metrics
        assert role is not None
        return role.state()

    metrics = EmulatorMetrics(config.model_name, config.time_scale, state, clock.lag_summary)
    lag.observe = metrics.lag.observe
    context = ServerContext(config, clock, PromptCounter(get_tokenizer(config.tokenizer)), order, metrics)
    role = PrefillServer(context) if config.role == "prefill" else DecodeServer(context)
    return create_app(context, role)


def create_app(context: ServerContext, role: Role) -> Starlette:
    """The Starlette app around one role."""
    config, clock = context.config, context.clock

    def inference(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            is_native = endpoint == Endpoint.GENERATE
            try:
                call = parse_call(endpoint, await request.body())
                return await role.answer(call, request.receive)
            except EmulatorError as exc:
                if exc.status_code >= 500:
                    logger.warning("%s %s: %s", config.role, endpoint.value, exc)
                return error_response(exc, is_native=is_native)
            except ClientGoneError:
                return Response(status_code=CLIENT_CLOSED_STATUS)
        return handle

    def server_info() -> dict[str, Any]:
        state = role.state()
        return {
            "model_path": config.model_name, "served_model_name": config.model_name,
            "tokenizer_path": config.tokenizer, "host": config.host, "port": config.port,
            "disaggregation_mode": config.role, "disaggregation_bootstrap_port": config.bootstrap_port,
            "max_total_tokens": config.max_total_tokens, "max_total_num_tokens": config.max_total_tokens,
            "max_running_requests": max_running_requests(config.max_total_tokens),
            "chunked_prefill_size": config.profile.chunked_prefill_tokens, "page_size": config.page_size, "tp_size": 1,
            "dp_size": 1, "hicache_storage_backend": None if config.storage_dir is None else "file",
            "hicache_storage_prefetch_policy": config.prefetch_policy,
            "disaggregation_decode_enable_offload_kvcache": config.enable_offload_kvcache,
            "disaggregation_decode_enable_radix_cache": config.enable_decode_radix_cache,
            "enable_priority_scheduling": config.enable_priority_scheduling,
            "radix_eviction_policy": config.radix_eviction_policy,
            "enable_session_radix_cache": config.enable_session_radix_cache,
            "schedule_low_priority_values_first": config.schedule_low_priority_values_first,
            "priority_scheduling_preemption_threshold": config.preemption_threshold,
            "enable_metrics": config.enable_metrics, "enable_cache_report": config.enable_cache_report,
            "enable_hierarchical_cache": config.enable_hierarchical_cache,
            "hicache_ratio": config.profile.host_cache_ratio, "time_scale": config.time_scale,
            "version": SGLANG_VERSION,
            "internal_states": [{"max_total_num_tokens": state.max_total_num_tokens,
                                 "num_running_reqs": state.num_running_reqs, "num_queue_reqs": state.num_queue_reqs,
                                 "token_usage": state.token_usage}],
            "basin_emulate": {"profile": config.profile.name, "time_scale": config.time_scale,
                              "model_time_s": clock.now_s, "lag": clock.lag_summary().as_dict(),
                              "host_cache_tokens": config.host_cache_tokens,
                              "session_radix_cache_mode": config.session_radix_cache_mode
                              if config.enable_session_radix_cache else None},
        }

    def loads() -> dict[str, Any]:
        state = role.state()
        load = {"dp_rank": 0, "timestamp": time.time(), "num_running_reqs": state.num_running_reqs,
                "num_waiting_reqs": state.num_queue_reqs, "num_used_tokens": state.num_used_tokens,
                "max_total_num_tokens": state.max_total_num_tokens, "token_usage": state.token_usage,
                "cache_hit_rate": state.cache_hit_rate,
                "max_running_requests": max_running_requests(config.max_total_tokens),
                "disaggregation": {"mode": config.role, **state.pd_queues}}
        return {"timestamp": time.time(), "version": SGLANG_VERSION, "dp_rank_count": 1, "loads": [load]}

    async def info(request: Request) -> Response:
        return JSONResponse(server_info())

    async def model_info(request: Request) -> Response:
        return JSONResponse({"model_path": config.model_name, "tokenizer_path": config.tokenizer,
                             "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                             "has_image_understanding": False, "has_audio_understanding": False})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": config.model_name, "max_model_len": CONTEXT_LENGTH}]})

    async def get_loads(request: Request) -> Response:
        return JSONResponse(loads())

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def flush_cache(request: Request) -> Response:
        return Response(FLUSH_TEXT, status_code=200 if role.flush() else 400, media_type="text/plain")

    async def close_session(request: Request) -> Response:
        try:
            role.close_session(parse_close_session(await request.body()))
        except EmulatorError as exc:
            return error_response(exc, is_native=True)
        return Response(status_code=200)

    async def clear_storage(request: Request) -> Response:
        if not role.clear_storage():
            return Response("No storage backend to clear.\n", status_code=400, media_type="text/plain")
        return Response("Hierarchical cache storage backend cleared.\n", media_type="text/plain")

    async def metrics(request: Request) -> Response:
        return Response(context.metrics.exposition(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        clock.start()
        await role.start()
        logger.info("basin-emulate %s on http://%s:%d (profile %s, time scale %g, pool %d tokens)", config.role,
                    config.host, config.port, config.profile.name, config.time_scale, config.max_total_tokens)
        try:
            yield
        finally:
            await role.close()

    routes = [Route(endpoint.value, inference(endpoint), methods=["POST"]) for endpoint in Endpoint]
    routes += [Route(path, info) for path in ("/server_info", "/get_server_info")]
    routes += [Route(path, model_info) for path in ("/model_info", "/get_model_info")]
    routes += [Route(path, get_loads) for path in ("/v1/loads", "/loads")]
    routes += [Route(path, health) for path in ("/health", "/health_generate")]
    routes += [Route("/v1/models", models), Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
               Route("/close_session", close_session, methods=["GET", "POST"]),
               Route("/hicache/storage-backend/clear", clear_storage, methods=["POST"])]
    if config.enable_metrics:
        routes.append(Route("/metrics", metrics))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.role, app.state.context = role, context  # for tests and tools that look inside
    return app

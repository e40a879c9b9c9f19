"""Admin endpoints: state, sessions, budget, reloads, shadow mode.

Rules:
- `GET /basin/state`: the policy snapshot, the hit rate, shadow mode and the lending reports.
  `GET /basin/sessions`: every live and queued session, without task text; `reserved_tokens` is what it holds
  against the budget now (max of m x its prediction, `reserved_peak_tokens`, and its context).
- `PUT /basin/budget {"budget_tokens": N}` sets the operator's reference budget at once (never
  evicts; may admit). `POST /basin/reload {"models": bool, "calibration": bool}` reloads the model
  files (swapped in only if every one loads) and/or the calibration file (its reference budget
  is applied; other calibration fields need a restart), from the paths the gateway started with.
- `PUT /basin/shadow {"enabled": bool}` turns shadow mode on or off.
- Bodies are read within the gateway's limits, as inference bodies are (`limits.py`), and a large one
  is parsed off the event loop, as theirs are; a bad body is 400 naming the field; a file that cannot
  be loaded is 400 naming it, and nothing changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from basin_runtime.gateway.calls import read_json_object
from basin_runtime.gateway.config import ConfigError, GatewayConfig, read_calibration
from basin_runtime.gateway.edge import body_chunks
from basin_runtime.gateway.errors import BadRequestError
from basin_runtime.gateway.gateway import OFF_LOOP_BODY_BYTES, Gateway
from basin_runtime.gateway.limits import Limits, read_body
from basin_runtime.gateway.predictors import Predictors
from basin_runtime.gateway.sessions import SessionEntry
from basin_runtime.policy import PolicyError

Guard = Callable[[Request], None]


@dataclass(frozen=True)
class Reloader:
    """Where the model and calibration files come from (the gateway's start-up configuration)."""

    config: GatewayConfig

    def models(self, tokenizer: str) -> Predictors:
        """Load every model file again; `ConfigError` naming the file, or naming the calibration file if it says
        it was measured for another default model file (re-measure it and reload both)."""
        predictors = Predictors.load(self.config.default_model, self.config.workload_models, tokenizer,
                                     self.config.reservation_quantile, self.config.revise_at_calls)
        if self.config.calibration is not None:
            read_calibration(self.config.calibration, self.config)
        return predictors

    def calibration_budget_tokens(self) -> int:
        """The reference budget of the calibration file; `ConfigError` if there is none or it is bad."""
        if self.config.calibration is None:
            raise ConfigError("the gateway was started without a calibration file")
        mode = str(self.config.policy.get("mode", "basin"))
        return read_calibration(self.config.calibration, self.config).budget_tokens(mode)


def sessions_view(gateway: Gateway) -> list[dict[str, Any]]:
    """Every live and queued session as plain JSON (no text)."""
    now = gateway.room.clock.now()
    views = []
    for entry in gateway.room.registry:
        kv = gateway.telemetry.lending.of(entry.session_id)
        last = entry.calls[-1] if entry.calls else None
        views.append({
            "session_id": entry.session_id, "state": entry.state, "priority_s": entry.priority_s,
            "engine_priority": gateway.room.registry.engine_priority(entry), "routing_key": entry.routing_key,
            "predicted_peak_tokens": entry.predicted_peak_tokens, "reserved_peak_tokens": entry.reserved_peak_tokens,
            "reserved_tokens": _reserved(gateway, entry), "context_tokens": entry.context_tokens,
            "is_held_for_growth": entry.is_held_for_growth,
            "workload": entry.workload, "model": entry.model,
            "is_adopted": entry.is_adopted, "num_calls": len(entry.calls), "in_flight": entry.in_flight,
            "waiters": entry.waiters, "age_s": now - entry.arrived_s, "idle_s": now - entry.last_active_s,
            "last_prompt_tokens": None if last is None else last.prompt_tokens,
            "last_cached_tokens": None if last is None else last.cached_tokens,
            "served_by": None if last is None else last.served_by,
            "cached_tiers": None if kv is None or kv.cached_tiers is None else dict(kv.cached_tiers),
            "calls_moved": 0 if kv is None else kv.calls_moved,
        })
    return views


def _reserved(gateway: Gateway, entry: SessionEntry) -> int:
    """What the policy reserves for the session (a re-reservation included); the entry's own count if this replica's
    copy of the shared state does not hold it yet."""
    try:
        return gateway.room.policy.reservation_of(entry.session_id)
    except PolicyError:
        return entry.reserved_tokens


def state_view(gateway: Gateway) -> dict[str, Any]:
    """Where the admission state lives and how this replica stands in it."""
    backend, coordinator = gateway.room.backend, gateway.coordinator
    view: dict[str, Any] = {"backend": "redis" if backend.is_shared else "in-process", "replica": backend.replica_id,
                            "is_up": backend.is_up, "is_leader": backend.is_leader,
                            "pending_steps": backend.num_pending,
                            "sessions_here": len(gateway.room.registry)}
    if coordinator is not None:
        shared = coordinator.backend
        view.update(epoch=shared.epoch, entry=shared.replicated.n, replicas=sorted(shared.replicated.replicas()),
                    orphans=len(shared.replicated.orphans), deployment_hit_rate=coordinator.hit_rate,
                    deployment_ttft_s=coordinator.ttft_s, dropped_steps=shared.num_dropped_steps,
                    down_reason=None if shared.is_up else shared.down_reason)
    return view


async def _json_body(request: Request, limits: Limits) -> dict[str, Any]:
    raw = await read_body(body_chunks(request), request.headers.get("content-length"), limits.max_body_bytes)
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return read_json_object(raw or b"{}", limits.max_json_depth, limits.max_json_items)
    return await asyncio.to_thread(read_json_object, raw, limits.max_json_depth, limits.max_json_items)


def _flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise BadRequestError(f"`{key}` must be true or false, got {value!r}")
    return value


def admin_routes(gateway: Gateway, guard: Guard, reloader: Reloader | None) -> list[Route]:
    """The `/basin/...` admin routes (the session-end route stays in `app.py`)."""

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            guard(request)
            return await handler(request)

        return endpoint

    async def state(request: Request) -> Response:
        return JSONResponse({"policy": gateway.room.policy.snapshot().to_dict(), "hit_rate": gateway.hit_rate(),
                             "is_shadow": gateway.is_shadow, "lending": gateway.telemetry.lending.to_dict(),
                             "state": state_view(gateway)})

    async def sessions(request: Request) -> Response:
        return JSONResponse({"sessions": sessions_view(gateway)})

    async def budget(request: Request) -> Response:
        value = (await _json_body(request, gateway.settings.limits)).get("budget_tokens")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise BadRequestError(f"`budget_tokens` must be a whole number > 0, got {value!r}")
        events = await gateway.room.set_budget(value)
        gateway.refresh_metrics()
        return JSONResponse({"policy": gateway.room.policy.snapshot().to_dict(), "num_admitted": len(events) - 1})

    async def reload(request: Request) -> Response:
        body = await _json_body(request, gateway.settings.limits)
        want_models, want_calibration = _flag(body, "models"), _flag(body, "calibration")
        if reloader is None:
            raise BadRequestError("this gateway was built without its configuration; nothing to reload from")
        done: dict[str, Any] = {}
        try:
            if want_models:
                predictors = await asyncio.to_thread(reloader.models, gateway.meter.tokenizer.name)
                gateway.predictors = predictors
                done["models"] = 1 + len(predictors.by_workload)
            if want_calibration:
                budget_tokens = await asyncio.to_thread(reloader.calibration_budget_tokens)
                await gateway.room.set_budget(budget_tokens)
                done["budget_tokens"] = budget_tokens
        except ConfigError as exc:
            raise BadRequestError(f"reload failed, nothing more changed: {exc}") from exc
        gateway.refresh_metrics()
        return JSONResponse({"reloaded": done})

    async def shadow(request: Request) -> Response:
        gateway.is_shadow = _flag(await _json_body(request, gateway.settings.limits), "enabled")
        gateway.refresh_metrics()
        return JSONResponse({"is_shadow": gateway.is_shadow})

    return [
        Route("/basin/state", guarded(state), methods=["GET"]),
        Route("/basin/sessions", guarded(sessions), methods=["GET"]),
        Route("/basin/budget", guarded(budget), methods=["PUT", "POST"]),
        Route("/basin/reload", guarded(reload), methods=["POST"]),
        Route("/basin/shadow", guarded(shadow), methods=["PUT", "POST"]),
    ]

"""The HTTP surface: Starlette routes around one `Gateway`, and building it from a `GatewayConfig`.

Rules:
- Inference (`/v1/chat/completions`, `/v1/completions`, `/generate`) goes through the session path;
  read-only SGLang/OpenAI info endpoints pass through untouched; `GET /health` is answered here (503
  `shutting_down` while the gateway drains) and says nothing of the upstream. `GET /metrics` is the
  gateway's own Prometheus exposition (open, like SGLang's).
- `/basin/...` are admin endpoints (`admin.py`): with an admin token configured they need
  `Authorization: Bearer <token>`; without one they are open (`cli.py` refuses to bind beyond loopback
  then, unless told `--insecure-admin`). `POST /basin/sessions/{id}/end` also takes that session's end
  key (`X-Basin-Session-Key`, `basin_runtime/session_keys.py`); a key opens nothing else, and a 401 names
  what each route takes.
- Errors become responses only through `errors.error_response`, and every answer the gateway makes itself
  is JSON: Starlette's 404 and 405 become `not_found` / `method_not_allowed`; any other exception before
  the answer started is logged and answered 500 `internal_error` (`_LastResort`).
- A POST to exactly one of the inference paths, or to a session's end, is served by `_InferencePath`
  ahead of Starlette's router and middleware (cheaper per call), answering exactly as that stack would;
  anything else takes the stack. The requests it serves are the gateway's `active_calls`, which a
  shutdown waits for and, at its drain's deadline, cuts with a JSON 503 `shutting_down`.
- The app is the edge: it reads each call into plain data (`edge.py` → `inbound.Inbound`: the headers the
  gateway reads, the body's chunks, the client's disconnect) and answers; nothing below it sees a
  Starlette request. Read-only pass-through requests are forwarded from here.
- Start-up builds the gateway whole (`build.py`: a bad file stops start-up with `ConfigError` naming it).
- The lifespan is the gateway's own (`async with gateway.running()`: the upstream client, the room's
  timers, the live-sessions writer, the engines' scraper, the shared state; at its end every session
  still held is ended or handed over and they are closed); then the upstream client is closed when the
  app built it (`on_shutdown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from basin_runtime.clock import Clock
from basin_runtime.gateway.admin import Reloader, admin_routes
from basin_runtime.gateway.build import build_gateway
from basin_runtime.gateway.calls import UPSTREAM_PATHS, CallKind
from basin_runtime.gateway.config import GatewayConfig
from basin_runtime.gateway.edge import inbound
from basin_runtime.gateway.errors import (
    AdminAuthError,
    GatewayError,
    GatewayInternalError,
    MethodNotAllowedError,
    RouteNotFoundError,
    error_response,
)
from basin_runtime.gateway.gateway import Gateway
from basin_runtime.gateway.metrics import CONTENT_TYPE
from basin_runtime.gateway.paths import forwarded_target
from basin_runtime.policy import PolicyError
from basin_runtime.session_keys import SESSION_KEY_HEADER
from basin_runtime.state.backend import StateUnavailableError

logger = logging.getLogger(__name__)

PASS_THROUGH_PATHS = (
    "/v1/models", "/v1/models/{model_id:path}", "/server_info", "/get_server_info", "/model_info",
    "/get_model_info", "/v1/loads", "/get_loads", "/health_generate",
)


def create_app(gateway: Gateway, *, admin_token: str | None = None,
               on_shutdown: Callable[[], Awaitable[None]] | None = None, reloader: Reloader | None = None) -> Starlette:
    """The ASGI app serving `gateway` (`admin_token`: what the admin endpoints take; the gateway's session end keys
    were derived from the same token when it was built)."""

    def call_route(kind: CallKind) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await serve_call(gateway, kind, request)

        return endpoint

    async def pass_through(request: Request) -> Response:
        """Forward a read-only request (models, server info) without session accounting.

        Only the listed paths go upstream, exactly as the client encoded them, and only a well-formed target
        (`paths.forwarded_target`): no `.` or `..` segment, empty segment or encoded slash or backslash, so
        `/v1/models/../../workers` cannot reach the router's internals.
        """
        raw_path = request.scope.get("raw_path") or request.scope["path"].encode("utf-8")
        path, query = forwarded_target(raw_path.split(b"?", 1)[0], request.scope.get("query_string", b""))
        return await gateway.upstream.forward(request.method, path, request.headers, None, request.receive,
                                              params=query)

    async def health(request: Request) -> Response:
        if gateway.room.is_draining:  # a load balancer sends nothing more here
            return error_response(gateway.shutting_down("it is draining"))
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        gateway.refresh_metrics()
        return Response(gateway.telemetry.metrics.render(), media_type=CONTENT_TYPE)

    async def end_session(request: Request) -> Response:
        session_id = request.path_params["session_id"]
        _require_end_permission(request, admin_token, gateway, session_id)
        ended = await gateway.end_session(session_id)
        return JSONResponse({"session_id": ended.session_id, "was": ended.was, "calls": ended.calls})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with gateway.running():
                yield
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    routes = [Route(path, call_route(kind), methods=["POST"]) for kind, path in UPSTREAM_PATHS.items()]
    routes += [Route(path, pass_through, methods=["GET"]) for path in PASS_THROUGH_PATHS]
    routes += [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/basin/sessions/{session_id:path}/end", end_session, methods=["POST"]),
    ]
    routes += admin_routes(gateway, lambda request: _require_admin(request, admin_token), reloader)
    handlers: dict[type[Exception], Callable[[Request, Exception], Awaitable[Response]]] = {
        error: _error_handler for error in _HANDLED_ERRORS}
    handlers[HTTPException] = _route_error_handler
    app = _GatewayApp(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                      middleware=[Middleware(_LastResort)])
    app.router.redirect_slashes = False  # a trailing slash is another path: 404 `not_found`, never a bare 307
    app.state.gateway = gateway  # the server's graceful shutdown drains it first (`cli.py`)
    app.state.end_session = end_session  # served ahead of the stack too (`_InferencePath`)
    return app


_HANDLED_ERRORS = (GatewayError, PolicyError, StateUnavailableError)  # answered by `error_response`


async def serve_call(gateway: Gateway, kind: CallKind, request: Request) -> Response:
    """One inference call: read at the edge (`edge.inbound`), served by the gateway."""
    settings = gateway.settings
    return await gateway.handle(kind, inbound(request, settings.session_header, settings.workload_header))


class _GatewayApp(Starlette):
    """Starlette with the inference calls served ahead of its stack (see the rules: the hot path)."""

    def build_middleware_stack(self) -> ASGIApp:
        return _InferencePath(super().build_middleware_stack(), self.state.gateway, self.state.end_session)


class _TrackedSend:
    """`send`, remembering whether the answer has started (after that, an error can no longer be answered)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.has_started = False

    async def __call__(self, message: Message) -> None:
        self.has_started = self.has_started or message["type"] == "http.response.start"
        await self.send(message)


_END_PATH = re.compile(r"/basin/sessions/(?P<session_id>.*)/end")  # the route's regex (Starlette's `path` is `.*`)


class _InferencePath:
    """Serves a POST to an inference path, or a session's end, itself; passes everything else to Starlette's
    stack."""

    def __init__(self, app: ASGIApp, gateway: Gateway, end_session: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self._gateway = gateway
        self._kinds = {path: kind for kind, path in UPSTREAM_PATHS.items()}
        self._end_session = end_session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_post = scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
        kind = self._kinds.get(scope["path"]) if is_post else None
        end = None if kind is not None or not is_post else _END_PATH.fullmatch(scope["path"])
        if kind is None and end is None:
            await self.app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        self._gateway.active_calls.add(task)
        try:
            await self._serve(scope, receive, send, kind, end)
        except asyncio.CancelledError:
            if self._gateway.is_cut and task.cancelling():  # the gateway's own cut: answered, so the request is done
                task.uncancel()
                return
            raise
        finally:
            self._gateway.active_calls.discard(task)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, kind: CallKind | None,
                     end: re.Match[str] | None) -> None:
        tracked = _TrackedSend(send)
        try:
            if kind is not None:
                response = await serve_call(self._gateway, kind, Request(scope, receive))
            else:
                assert end is not None
                scope["path_params"] = {"session_id": end["session_id"]}
                response = await self._end_session(Request(scope, receive))
            await response(scope, receive, tracked)
        except _HANDLED_ERRORS as exc:
            if tracked.has_started:
                raise
            await error_response(exc)(scope, receive, send)
        except Exception as exc:
            if tracked.has_started:
                raise
            await (await _answer_unexpected(scope, exc))(scope, receive, send)
        except asyncio.CancelledError:  # cut at the drain's deadline (or by the server after it): still JSON
            if not tracked.has_started:
                with anyio.CancelScope(shield=True):
                    await error_response(self._gateway.shutting_down(
                        "this call did not finish within its drain (drain_timeout_s)"))(scope, receive, send)
            raise


async def _error_handler(request: Request, exc: Exception) -> Response:
    return error_response(exc)


async def _route_error_handler(request: Request, exc: Exception) -> Response:
    """Starlette's routing errors (no route, wrong method) as the gateway's JSON errors."""
    assert isinstance(exc, HTTPException)
    path = request.url.path[:200]
    if exc.status_code == 404:
        return error_response(RouteNotFoundError(f"no route for {request.method} {path}"))
    if exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow", "")
        return error_response(MethodNotAllowedError(f"{path} does not take {request.method}; it takes {allow}", allow))
    return await _answer_unexpected(request.scope, exc)


class _LastResort:
    """Answers any exception no handler took with a JSON 500 `internal_error`, logged with its traceback.

    Once the answer has started nothing more can be said: the exception goes on to the server, which
    closes the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = _TrackedSend(send)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if tracked.has_started:
                raise
            response = await _answer_unexpected(scope, exc)
            await response(scope, receive, send)


async def _answer_unexpected(scope: Scope, exc: Exception) -> Response:
    logger.error("unexpected error serving %s %s; answered 500 internal_error", scope.get("method"),
                 str(scope.get("path"))[:200], exc_info=exc)
    return error_response(GatewayInternalError(f"the gateway failed unexpectedly ({type(exc).__name__}); "
                                               "the details are in its log"))


def _require_admin(request: Request, admin_token: str | None) -> None:
    if admin_token is not None and not _has_admin_token(request, admin_token):
        raise AdminAuthError(f"this admin endpoint needs `Authorization: Bearer <admin token>` (a session's "
                             f"{SESSION_KEY_HEADER} opens only POST /basin/sessions/{{id}}/end of that session)")


def _require_end_permission(request: Request, admin_token: str | None, gateway: Gateway, session_id: str) -> None:
    """The admin token, or the end key of the session's incarnation held now. The key is checked before the
    session's existence, with one answer for both (a 401: an id held and one not held look alike to a key that is
    not theirs, so ids cannot be probed); only the admin token learns of a 404. An orphan of a dead replica, whose
    key went with it: the admin token only."""
    if admin_token is None or _has_admin_token(request, admin_token):
        return
    key = request.headers.get(SESSION_KEY_HEADER)
    of = gateway.incarnation_of(session_id)
    if key is None or of is None or gateway.is_orphan(session_id) or not gateway.settings.session_keys.is_key_of(
            session_id, of, key):
        raise AdminAuthError(f"ending a session needs `{SESSION_KEY_HEADER}: <its key>` (sent on the session's "
                             f"first answer) or `Authorization: Bearer <admin token>`")


def _has_admin_token(request: Request, admin_token: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), admin_token.encode())


def build_app(config: GatewayConfig, clock: Clock | None = None) -> Starlette:
    """The whole gateway app from its configuration (it owns and closes its upstream client)."""
    gateway = build_gateway(config, clock=clock)
    return create_app(gateway, admin_token=config.admin_token, on_shutdown=gateway.upstream.aclose,
                      reloader=Reloader(config))

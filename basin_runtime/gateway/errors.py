"""Gateway errors and their HTTP responses.

Rules:
- Every failure a client can see is a `GatewayError` subclass raised where it is found; nothing
  else in the gateway picks a status code. `error_response` is the only mapping:
    400 bad request (malformed JSON, wrong shape, no messages/prompt; `invalid_request_error`)
    400/413/431 a limit passed (`LimitError`: `json_too_deep`, `session_id_too_long`, 413 `request_too_large`,
        413 `too_many_items`, 431 `headers_too_large`)
    408 a request head or body slower than `header_timeout_s` / `body_timeout_s` (`request_timeout`, a `LimitError`;
        answered by the server's protocol, which then closes the connection)
    503 too many large bodies at once (`too_many_large_bodies`, a `LimitError` with Retry-After: 1 s)
    401 admin token (or end key) missing or wrong             404 unknown session, path or route
    405 method not allowed on a route (with Allow)            409 session ended while it waited
    409 `session_id_in_use`: a call under a held session's id that does not continue its conversation, with
        `--foreign-call refuse` (`identity.py`)
    499 client went away (nobody reads it; for the logs)      502 upstream refused or answered 5xx
    503 session shed (with Retry-After and the reason)        504 upstream timed out
    503 shutting down (draining: no new session is admitted; with Retry-After)
    503 state unavailable (`--state`: the shared admission state is out of reach or being rebuilt, so
        no new session can be decided; with the reason and Retry-After; admitted sessions are served)
    502 upstream broke off mid-answer, answered 2xx with a body that is not the JSON it claims, a redirect
        (never followed nor passed on), or an answer head past `max_header_bytes`
    4xx the upstream's refusal, its status kept: passed on as written when its body is JSON with a string
        `type` (SGLang's and OpenAI's error shapes), else `upstream_rejected` quoting the body's start
    500 a policy error (a bug: the policy refused a step the gateway thought legal), or any
        unexpected exception (`internal_error`, turned into a `GatewayInternalError` by the app's
        last-resort handler): never a plain-text answer.
- Bodies are OpenAI-style: {"error": {"message", "type", "code", ...details}}; upstream failures
  carry the upstream's own words; a limit names itself, its value and the option that sets it
  (`limit`, `limit_value`, `option`).
- A failure after a streamed (SSE) answer has begun cannot change its status: `error_event` writes
  the same body as one SSE event (`data: {"error": {...}}`, as SGLang and smg do), whose `code` is
  the status the failure would have had.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from starlette.responses import JSONResponse

from basin_runtime.disconnect import ClientDisconnected
from basin_runtime.policy import PolicyError, Shed, UnknownSessionError
from basin_runtime.state.backend import StateUnavailableError


class GatewayError(Exception):
    """A failure the gateway reports to its client."""


class BadRequestError(GatewayError):
    """The request cannot be served as sent."""


class LimitError(BadRequestError):
    """A request passed one of the gateway's input limits (`limits.py`): names the limit and its option."""

    status_code: ClassVar[int] = 400
    kind: ClassVar[str] = "invalid_request_error"

    def __init__(self, message: str, limit: str, value: float) -> None:
        option = "--" + limit.replace("_", "-")
        super().__init__(f"{message} (limit `{limit}` = {value}; set it with {option} or `{limit}:` in the "
                         "config file)")
        self.limit = limit
        self.value = value
        self.option = option


class BodyTooLargeError(LimitError):
    """The request body is larger than `max_body_bytes`."""

    status_code: ClassVar[int] = 413
    kind: ClassVar[str] = "request_too_large"


class NestingTooDeepError(LimitError):
    """The request's JSON is nested deeper than `max_json_depth`."""

    kind: ClassVar[str] = "json_too_deep"


class TooManyItemsError(LimitError):
    """A request body holds more JSON values, messages, tools or content parts than its limit."""

    status_code: ClassVar[int] = 413
    kind: ClassVar[str] = "too_many_items"


class BodiesInFlightError(LimitError):
    """Large request bodies being read and handled at once already hold `max_body_bytes_in_flight` bytes."""

    status_code: ClassVar[int] = 503
    kind: ClassVar[str] = "too_many_large_bodies"
    retry_after_s: ClassVar[int] = 1


class HeadersTooLargeError(LimitError):
    """A request head is larger than `max_header_bytes`, or has more than `max_headers` headers."""

    status_code: ClassVar[int] = 431
    kind: ClassVar[str] = "headers_too_large"


class RequestTimeoutError(LimitError):
    """A request's head or body took longer to arrive than `header_timeout_s` or `body_timeout_s` (`server.py`)."""

    status_code: ClassVar[int] = 408
    kind: ClassVar[str] = "request_timeout"


class SessionIdTooLongError(LimitError):
    """A session id is longer than `max_session_id_chars`."""

    kind: ClassVar[str] = "session_id_too_long"


class AdminAuthError(GatewayError):
    """An admin endpoint was called without the right bearer token (or, to end a session, its end key)."""


class SessionNotFoundError(GatewayError):
    """No live or queued session has this id."""


class PathNotForwardedError(GatewayError):
    """A read-only path outside the forwarded list (e.g. `..` segments reaching the router's internals)."""


class RouteNotFoundError(GatewayError):
    """No route has this path."""


class MethodNotAllowedError(GatewayError):
    """The route exists but not for this method."""

    def __init__(self, message: str, allow: str) -> None:
        super().__init__(message)
        self.allow = allow


class GatewayInternalError(GatewayError):
    """An unexpected exception inside the gateway (a bug), answered as JSON instead of plain text."""


class SessionEndedError(GatewayError):
    """The session was ended while its first call waited for admission."""


class ForeignCallError(GatewayError):
    """`--foreign-call refuse`: a call under a held session's id does not continue its conversation (`identity.py`)."""

    def __init__(self, message: str, session_id: str) -> None:
        super().__init__(message)
        self.session_id = session_id


class ClientGoneError(GatewayError, ClientDisconnected):
    """The client disconnected before the answer."""


class SessionShedError(GatewayError):
    """The policy shed the session while it waited."""

    def __init__(self, shed: Shed, retry_after_s: float) -> None:
        super().__init__(f"session {shed.session_id!r} was shed: {shed.reason}")
        self.shed = shed
        self.retry_after_s = retry_after_s


class ShuttingDownError(GatewayError):
    """The gateway is draining for a shutdown and admits no new session."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamError(GatewayError):
    """The upstream failed to answer."""


class UpstreamRefusedError(UpstreamError):
    """The upstream could not be reached (connection refused, reset, DNS)."""


class UpstreamTimeoutError(UpstreamError):
    """The upstream did not answer in time."""


class UpstreamStreamError(UpstreamError):
    """The upstream's answer broke off after it began (reset, closed early, a stream without its end)."""


class UpstreamBadAnswerError(UpstreamError):
    """The upstream answered 2xx with a body that is not what it claims (JSON that does not parse)."""


class UpstreamRejectedError(UpstreamError):
    """The upstream refused the request (a 4xx) with a body that is not JSON with a `type`: passed on with the
    upstream's status, in the gateway's JSON."""

    def __init__(self, status_code: int, body_text: str) -> None:
        super().__init__(f"upstream answered {status_code}: {body_text}")
        self.status_code = status_code
        self.body_text = body_text


class UpstreamStatusError(UpstreamError):
    """The upstream answered with a 5xx status."""

    def __init__(self, status_code: int, body_text: str) -> None:
        super().__init__(f"upstream answered {status_code}: {body_text}")
        self.status_code = status_code
        self.body_text = body_text


def error_response(exc: Exception) -> JSONResponse:
    """The HTTP response for a gateway error or policy refusal (the only status mapping)."""
    status, kind, details, headers = _classify(exc)
    return JSONResponse(_body(exc, status, kind, details), status_code=status, headers=headers)


def error_event(exc: Exception) -> bytes:
    """The SSE event telling a streaming client of a failure after its answer began (same body as `error_response`)."""
    status, kind, details, _ = _classify(exc)
    return b"data: " + json.dumps(_body(exc, status, kind, details), ensure_ascii=False).encode("utf-8") + b"\n\n"


def _body(exc: Exception, status: int, kind: str, details: dict[str, Any]) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": kind, "code": status, **details}}


def _classify(exc: Exception) -> tuple[int, str, dict[str, Any], dict[str, str]]:
    match exc:
        case BodiesInFlightError():
            details = {"limit": exc.limit, "limit_value": exc.value, "option": exc.option}
            return exc.status_code, exc.kind, details, {"Retry-After": str(exc.retry_after_s)}
        case LimitError():
            return exc.status_code, exc.kind, {"limit": exc.limit, "limit_value": exc.value, "option": exc.option}, {}
        case BadRequestError():
            return 400, "invalid_request_error", {}, {}
        case AdminAuthError():
            return 401, "unauthorized", {}, {"WWW-Authenticate": "Bearer"}
        case SessionNotFoundError() | UnknownSessionError():
            return 404, "session_not_found", {}, {}
        case PathNotForwardedError() | RouteNotFoundError():
            return 404, "not_found", {}, {}
        case MethodNotAllowedError():
            return 405, "method_not_allowed", {}, {"Allow": exc.allow}
        case SessionEndedError():
            return 409, "session_ended", {}, {}
        case ForeignCallError():
            return 409, "session_id_in_use", {"session_id": exc.session_id, "option": "--foreign-call"}, {}
        case ClientGoneError():
            return 499, "client_closed_request", {}, {}
        case SessionShedError():
            return 503, "session_shed", _shed_details(exc), {"Retry-After": str(math.ceil(exc.retry_after_s))}
        case ShuttingDownError():
            return 503, "shutting_down", {}, {"Retry-After": str(math.ceil(exc.retry_after_s))}
        case StateUnavailableError():
            return 503, "state_unavailable", {"reason": exc.reason}, {"Retry-After": str(math.ceil(exc.retry_after_s))}
        case UpstreamTimeoutError():
            return 504, "upstream_timeout", {}, {}
        case UpstreamStatusError():
            return 502, "upstream_error", {"upstream_status": exc.status_code, "upstream_body": exc.body_text}, {}
        case UpstreamRejectedError():
            details = {"upstream_status": exc.status_code, "upstream_body": exc.body_text}
            return exc.status_code, "upstream_rejected", details, {}
        case UpstreamStreamError():
            return 502, "upstream_stream_error", {}, {}
        case UpstreamBadAnswerError():
            return 502, "upstream_bad_answer", {}, {}
        case UpstreamError():
            return 502, "upstream_unavailable", {}, {}
        case PolicyError():
            return 500, "policy_error", {}, {}
        case GatewayInternalError():
            return 500, "internal_error", {}, {}
    raise TypeError(f"no HTTP mapping for {type(exc).__name__}: {exc}")


def _shed_details(exc: SessionShedError) -> dict[str, Any]:
    shed = exc.shed
    return {
        "reason": shed.reason,
        "session_id": shed.session_id,
        "waited_s": round(shed.waited_s, 3),
        "retry_after_s": math.ceil(exc.retry_after_s),
    }

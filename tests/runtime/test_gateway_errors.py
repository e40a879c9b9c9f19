"""Every gateway error has exactly one HTTP status, set in one place (`errors.error_response`)."""

from __future__ import annotations

import json

from basin_runtime.gateway.errors import (
    BodiesInFlightError,
    BodyTooLargeError,
    ForeignCallError,
    GatewayError,
    HeadersTooLargeError,
    LimitError,
    MethodNotAllowedError,
    NestingTooDeepError,
    RequestTimeoutError,
    SessionIdTooLongError,
    SessionShedError,
    ShuttingDownError,
    TooManyItemsError,
    UpstreamRejectedError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    error_event,
    error_response,
)
from basin_runtime.policy import PolicyError, Shed, UnknownSessionError


def _subclasses(cls: type[GatewayError]) -> set[type[GatewayError]]:
    found: set[type[GatewayError]] = set()
    for direct in cls.__subclasses__():
        found |= {direct} | _subclasses(direct)
    return found


SHED = Shed("s", 1.0, 2.0, 3.0, 0.5, 0.1, 900.0, "arrival rate 0.5/s exceeds peak completion rate 0.1/s")
EXAMPLES: dict[type, GatewayError] = {
    SessionShedError: SessionShedError(SHED, 12.5),
    UpstreamStatusError: UpstreamStatusError(500, "scheduler crashed"),
    UpstreamRejectedError: UpstreamRejectedError(404, "Not Found"),
    LimitError: LimitError("too much", "max_things", 3),
    BodyTooLargeError: BodyTooLargeError("too large", "max_body_bytes", 10),
    NestingTooDeepError: NestingTooDeepError("too deep", "max_json_depth", 4),
    HeadersTooLargeError: HeadersTooLargeError("too big", "max_header_bytes", 8192),
    TooManyItemsError: TooManyItemsError("too many", "max_tools", 512),
    BodiesInFlightError: BodiesInFlightError("busy", "max_body_bytes_in_flight", 1 << 28),
    SessionIdTooLongError: SessionIdTooLongError("too long", "max_session_id_chars", 8),
    MethodNotAllowedError: MethodNotAllowedError("no PUT here", "GET"),
    ShuttingDownError: ShuttingDownError("draining", 7.2),
    RequestTimeoutError: RequestTimeoutError("no request head arrived within 30 s", "header_timeout_s", 30.0),
    ForeignCallError: ForeignCallError("session id 's' names another conversation", "s"),
}


def test_every_gateway_error_maps_to_one_status_and_an_openai_style_body() -> None:
    statuses = {}
    for cls in _subclasses(GatewayError):
        exc = EXAMPLES.get(cls) or cls("what happened")
        response = error_response(exc)
        error = json.loads(bytes(response.body))["error"]
        assert (error["message"], error["code"]) == (str(exc), response.status_code)
        statuses[cls.__name__] = response.status_code
    assert statuses == {
        "BadRequestError": 400, "LimitError": 400, "BodyTooLargeError": 413, "NestingTooDeepError": 400,
        "SessionIdTooLongError": 400, "AdminAuthError": 401, "SessionNotFoundError": 404,
        "PathNotForwardedError": 404, "RouteNotFoundError": 404, "MethodNotAllowedError": 405,
        "GatewayInternalError": 500, "SessionEndedError": 409,
        "ClientGoneError": 499, "SessionShedError": 503, "ShuttingDownError": 503, "UpstreamError": 502,
        "UpstreamRefusedError": 502,
        "UpstreamTimeoutError": 504, "UpstreamStatusError": 502, "UpstreamStreamError": 502,
        "UpstreamBadAnswerError": 502, "UpstreamRejectedError": 404, "HeadersTooLargeError": 431,
        "TooManyItemsError": 413, "BodiesInFlightError": 503, "RequestTimeoutError": 408, "ForeignCallError": 409,
    }


def test_an_error_event_carries_the_same_body_as_the_response_in_smgs_sse_shape() -> None:
    for cls in _subclasses(GatewayError):
        exc = EXAMPLES.get(cls) or cls("what \u00e9 happened")
        event = error_event(exc)
        assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n") == 2
        assert json.loads(event[len(b"data: "):]) == json.loads(bytes(error_response(exc).body))
    timeout = json.loads(error_event(UpstreamTimeoutError("no bytes for 900 s"))[len(b"data: "):])
    assert timeout == {"error": {"message": "no bytes for 900 s", "type": "upstream_timeout", "code": 504}}


def test_a_shed_answer_carries_retry_after_in_whole_seconds_and_the_reason() -> None:
    response = error_response(EXAMPLES[SessionShedError])
    error = json.loads(bytes(response.body))["error"]
    assert response.headers["retry-after"] == "13"
    assert (error["reason"], error["session_id"], error["retry_after_s"]) == (SHED.reason, "s", 13)


def test_a_limit_names_itself_its_value_and_its_option_with_a_stable_type() -> None:
    response = error_response(EXAMPLES[BodyTooLargeError])
    error = json.loads(bytes(response.body))["error"]
    assert (response.status_code, error["type"], error["limit"], error["limit_value"], error["option"]) == (
        413, "request_too_large", "max_body_bytes", 10, "--max-body-bytes")
    assert "`max_body_bytes` = 10" in error["message"] and "--max-body-bytes" in error["message"]
    kinds = {cls: json.loads(bytes(error_response(EXAMPLES[cls]).body))["error"]["type"]
             for cls in (NestingTooDeepError, SessionIdTooLongError)}
    assert kinds == {NestingTooDeepError: "json_too_deep", SessionIdTooLongError: "session_id_too_long"}


def test_a_slow_request_and_a_foreign_call_name_what_and_where() -> None:
    slow = json.loads(bytes(error_response(EXAMPLES[RequestTimeoutError]).body))["error"]
    assert (slow["type"], slow["limit"], slow["limit_value"], slow["option"]) == (
        "request_timeout", "header_timeout_s", 30.0, "--header-timeout-s")
    foreign = json.loads(bytes(error_response(EXAMPLES[ForeignCallError]).body))["error"]
    assert (foreign["type"], foreign["session_id"], foreign["option"]) == ("session_id_in_use", "s", "--foreign-call")


def test_a_wrong_method_answer_carries_allow() -> None:
    response = error_response(EXAMPLES[MethodNotAllowedError])
    assert (response.status_code, response.headers["allow"]) == (405, "GET")


def test_policy_refusals_map_too() -> None:
    assert error_response(UnknownSessionError("gone")).status_code == 404
    assert error_response(PolicyError("a bug")).status_code == 500

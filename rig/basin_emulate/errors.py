"""The errors the emulator answers with, and the one function that turns them into HTTP responses.

Rules:
- Every failure a client can see is an `EmulatorError` raised where it is found, carrying its HTTP
  status; nothing else picks a status code.
    400 bad request (malformed JSON, no prompt, a decode request without bootstrap fields)
    400 request too large (its KV needs more than the pool holds)
    500 bootstrap failure (the peer never showed, or was unreachable, or the prefill side failed)
- Bodies are SGLang's: OpenAI routes get {"object": "error", "message", "type", "param", "code"};
  `/generate` gets {"error": {"message", "type", "code"}}.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from basin_runtime.disconnect import ClientDisconnected


class EmulatorError(Exception):
    """A failure reported to the client, with its HTTP status."""

    status_code = 500
    error_type = "InternalServerError"


class BadRequestError(EmulatorError):
    """The request cannot be served as sent."""

    status_code = 400
    error_type = "BadRequestError"


class RequestTooLargeError(BadRequestError):
    """The request's KV would not fit in the instance's pool even when it is empty."""


class BootstrapError(EmulatorError):
    """The prefill and decode halves of a request did not meet (timeout, unreachable, aborted)."""


class ClientGoneError(ClientDisconnected):
    """The client disconnected before its answer was ready (nobody reads a response)."""


def error_response(error: EmulatorError, *, is_native: bool) -> JSONResponse:
    """The HTTP response for `error`: SGLang's native shape on /generate, OpenAI's elsewhere."""
    message = str(error)
    if is_native:
        body: dict[str, object] = {"error": {"message": message, "type": error.error_type,
                                             "code": error.status_code}}
    else:
        body = {"object": "error", "message": message, "type": error.error_type, "param": None,
                "code": error.status_code}
    return JSONResponse(body, status_code=error.status_code)

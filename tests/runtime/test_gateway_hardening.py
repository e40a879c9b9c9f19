"""Issue 36, the gateway's second hardening pass: what an outside attacker found, each through a real server.

Every test serves a rig's gateway with uvicorn as the CLI does (`served.serving`: the gateway's own HTTP protocol
and options, its own HTTP/1.1 client to a real aiohttp upstream) and talks to it over TCP, most with raw bytes:
- paths: any byte sequence in a pass-through path gets a JSON 4xx (item 6);
- answers that were not JSON: a trailing slash, an upstream's plain-text or empty refusal, a request llhttp cannot
  parse (item 8);
- heads: a request head past `max_header_bytes` or with more than `max_headers` headers gets a JSON 431, and an
  upstream answer head past `max_header_bytes` a JSON 502, never passed on (item 9).
"""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from tests.runtime.served import RawAnswer, raw_exchange, serving

pytestmark = pytest.mark.asyncio


def error_of(answer: RawAnswer | None) -> dict[str, object]:
    """The gateway's JSON error in `answer` (which must be JSON with a string `type` and its own status as `code`)."""
    assert answer is not None, "the connection closed without an answer"
    assert answer.headers.get("content-type") == "application/json", (answer.status, answer.headers, answer.body)
    error = json.loads(answer.body)["error"]
    assert isinstance(error["type"], str) and error["code"] == answer.status, error
    return dict(error)


def get(path: bytes, *headers: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: gateway\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


def post(body: bytes, session: bytes = b"s", path: bytes = b"/v1/chat/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: gateway\r\nX-Session-ID: " + session + b"\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


# --- item 6: paths ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [b"/v1/models/%ff", b"/v1/models/%C3%28", b"/v1/models/%zz", b"/v1/models/%",
                                  b"/v1/models/a%00b", b"/v1/models/%e2%82"])
async def test_a_pass_through_path_of_any_bytes_gets_a_json_4xx_and_is_never_forwarded(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        error = error_of(answer)
        assert answer is not None and 400 <= answer.status < 500, (answer.status, error)
        assert served.received == []
        health = await raw_exchange(served.port, get(b"/health"))
        assert health is not None and health.status == 200


async def test_a_pass_through_path_goes_upstream_as_the_client_encoded_it() -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(b"/v1/models/Qwen%20Qwen3%C3%A9?x=a%20b"))
        assert answer is not None and answer.status == 200
        assert [(m, p) for m, p, _ in served.received] == [("GET", "/v1/models/Qwen%20Qwen3%C3%A9?x=a%20b")]


@pytest.mark.parametrize("path", [b"/v1/models/\xff", b"/v1/models/a b", b"/v1/\x7fmodels"])
async def test_a_raw_byte_the_url_may_not_hold_gets_a_json_400(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        assert error_of(answer)["type"] == "invalid_request_error" and served.received == []


# --- item 8: every answer the gateway makes or relays is JSON with a stable type ----------------


@pytest.mark.parametrize("path", [b"/health/", b"/v1/models/", b"/basin/state/", b"/v1/chat/completions/"])
async def test_a_trailing_slash_is_a_json_404_not_a_bare_redirect(path: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, get(path))
        error = error_of(answer)
        assert answer is not None and answer.status in (404, 405) and "location" not in answer.headers, error


@pytest.mark.parametrize("status,body,content_type", [
    (404, b"Not Found", "text/plain"), (400, b"", "text/plain"), (422, b'{"detail": "Not Found"}', "application/json"),
    (429, b"<html>slow down</html>", "text/html")])
async def test_an_upstream_refusal_that_is_not_json_with_a_type_comes_back_as_json_with_its_status(
        status: int, body: bytes, content_type: str) -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, body=body, content_type=content_type)

    async with serving() as served:
        served.handler = refuse
        for request in (get(b"/v1/models/m"), post(b'{"messages": [{"role": "user", "content": "task 1"}]}')):
            answer = await raw_exchange(served.port, request)
            error = error_of(answer)
            assert answer is not None and answer.status == status
            assert (error["type"], error["upstream_status"]) == ("upstream_rejected", status)
            assert error["upstream_body"] == body.decode() or (not body and error["upstream_body"])


async def test_an_upstream_redirect_is_a_json_502_and_its_location_is_not_passed_on() -> None:
    async def redirect(request: web.Request) -> web.StreamResponse:
        return web.Response(status=307, headers={"Location": "http://10.0.0.7:30000/internal"})

    async with serving() as served:
        served.handler = redirect
        answer = await raw_exchange(served.port, get(b"/v1/models"))
        assert error_of(answer)["type"] == "upstream_bad_answer"
        assert answer is not None and answer.status == 502 and "location" not in answer.headers


@pytest.mark.parametrize("request_bytes", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS to plain HTTP
    b"GET /health HTTP/1.1\r\nHo st: x\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: zz\r\n\r\n"])
async def test_a_request_that_is_not_valid_http_gets_a_json_400_not_uvicorns_plain_text(request_bytes: bytes) -> None:
    async with serving() as served:
        answer = await raw_exchange(served.port, request_bytes)
        error = error_of(answer)
        assert answer is not None and answer.status == 400 and error["type"] == "invalid_request_error"
        assert "not valid HTTP/1.1" in str(error["message"]) and answer.headers.get("connection") == "close"


# --- item 9: heads ---------------------------------------------------------------------------------


async def test_a_request_head_past_the_limit_gets_a_json_431_naming_it_and_is_never_forwarded() -> None:
    async with serving(max_header_bytes=8192, max_headers=20) as served:
        big = get(b"/v1/models", b"X-Big: " + b"a" * 1_000_000)
        cases = {
            "one 1 MB header, in one write": (big,),
            "one 1 MB header, in 4 KiB writes": tuple(big[k:k + 4096] for k in range(0, len(big), 4096)),
            "a 1 MB URL": (get(b"/v1/models/" + b"m" * 1_000_000),),
            "10,000 small headers": (get(b"/v1/models", *(b"X-H%d: v" % k for k in range(10_000))),),
            "21 headers": (get(b"/v1/models", *(b"X-H%d: v" % k for k in range(20))),),
        }
        for name, pieces in cases.items():
            error = error_of(await raw_exchange(served.port, *pieces))
            limit = "max_headers" if "headers" in name and "small" not in name and "21" in name else None
            assert error["type"] == "headers_too_large" and error["code"] == 431, (name, error)
            assert error["limit"] in ((limit,) if limit else ("max_header_bytes", "max_headers")), (name, error)
        fits = await raw_exchange(served.port, get(b"/v1/models", *(b"X-H%d: v" % k for k in range(19))))
        assert fits is not None and fits.status == 200
        assert [p for _, p, _ in served.received] == ["/v1/models"]  # only the head within the limits went on


async def test_an_upstream_answer_head_past_the_limit_is_a_json_502_and_never_reaches_the_client() -> None:
    async def huge_header(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"ok": True}, headers={"X-Huge": "h" * 5_000_000})

    async with serving(max_header_bytes=65536) as served:
        served.handler = huge_header
        answer = await raw_exchange(served.port, get(b"/v1/models"))
        error = error_of(answer)
        assert answer is not None and (answer.status, error["type"]) == (502, "upstream_bad_answer")
        assert "x-huge" not in answer.headers and "max_header_bytes" in str(error["message"])

"""A test double of the upstream: `UpstreamClient` over an `httpx.AsyncClient`, so a test can put an
`httpx.MockTransport` (a function answering requests) where the router would be.

Not a production client: the gateway's one upstream client is `basin_runtime.gateway.http1`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping

import httpx

from basin_runtime.gateway.errors import UpstreamRefusedError, UpstreamTimeoutError
from basin_runtime.gateway.upstream import RequestBody, UpstreamBrokenError, joined, read_upto


class HttpxAnswer:
    """An `httpx.Response` opened with `stream=True`."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    @property
    def reason(self) -> str:
        return self._response.reason_phrase

    @property
    def url(self) -> str:
        return str(self._response.url)

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamBrokenError(f"{type(exc).__name__}: {exc or 'no detail'}",
                                      is_timeout=isinstance(exc, httpx.TimeoutException)) from exc

    async def read(self, limit: int) -> bytes:
        return await read_upto(self.chunks(), limit)

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxUpstreamClient:
    """`UpstreamClient` over an `httpx.AsyncClient` whose base URL is the upstream."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    @property
    def base_url(self) -> str:
        return str(self.client.base_url)

    @property
    def is_closed(self) -> bool:
        return self.client.is_closed

    @property
    def read_timeout_s(self) -> float | None:
        return self.client.timeout.read

    async def start(self) -> None:
        """Nothing to do: httpx opens connections on first use."""

    async def send(self, method: str, path: str, headers: Mapping[str, str], body: RequestBody | None,
                   params: str = "") -> HttpxAnswer:
        content = None if body is None else joined(body)
        request = self.client.build_request(method, path, headers=dict(headers), content=content,
                                            params=httpx.QueryParams(params))
        try:
            return HttpxAnswer(await self.client.send(request, stream=True))
        except httpx.TimeoutException as exc:
            raise UpstreamTimeoutError(f"upstream {request.url} did not answer in time "
                                       f"({type(exc).__name__}: {exc or 'no detail'})") from exc
        except httpx.TransportError as exc:
            raise UpstreamRefusedError(f"cannot reach upstream {request.url}: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self.client.aclose()


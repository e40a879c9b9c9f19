"""Fixtures shared by the gateway's in-process tests (the rig itself is `test_gateway_app.rig_for`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.runtime.redis_policy import LoopThread
from tests.runtime.test_gateway_app import Rig, rig_for


@pytest_asyncio.fixture
async def rig() -> AsyncIterator[Rig]:
    async with rig_for() as made:
        yield made


@pytest_asyncio.fixture
async def full() -> AsyncIterator[Rig]:
    """A one-token budget: once one session is live, every other one waits."""
    async with rig_for(budget_tokens=1) as made:
        yield made


@pytest.fixture(scope="session")
def redis_loop() -> Iterator[LoopThread]:
    """An event loop in a thread, for the synchronous suites that drive the Redis backend."""
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.close()

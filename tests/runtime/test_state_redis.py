"""The Redis backend on its own, against a real redis-server: wake-ups, exactly once, snapshots, epochs.

Backends here are `RedisBackend`s without a gateway, on the test's event loop, each on a key prefix of
its own per test; their listeners record what they apply.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from basin_runtime.clock import Clock, ManualClock
from basin_runtime.policy import Admitted, PolicyConfig
from basin_runtime.state.backend import StateUnavailableError
from basin_runtime.state.leases import Coordinator
from basin_runtime.state.redis_backend import RedisBackend, redis_client
from basin_runtime.state.replica import ReplicatedState
from basin_runtime.state.signals import SignalReport
from basin_runtime.state.steps import Step, encode_step
from tests.redis_server import RedisServer

pytestmark = pytest.mark.asyncio

CONFIG = PolicyConfig(budget_tokens=100, always_engaged=True)


@asynccontextmanager
async def backends(server: RedisServer, count: int, *, lease_s: float = 5.0, tail_block_ms: int = 50,
                   on_reset: Callable[[RedisBackend, bool], None] | None = None,
                   clock: Clock | None = None) -> AsyncIterator[list[RedisBackend]]:
    prefix = f"backend-{uuid.uuid4().hex[:10]}"
    made: list[RedisBackend] = []
    try:
        for k in range(count):
            backend = RedisBackend(server.url, CONFIG, replica_id=f"r{k + 1}", prefix=prefix, lease_s=lease_s,
                                   tail_block_ms=tail_block_ms, clock=clock)
            backend.applied = []  # type: ignore[attr-defined]
            backend.bind(backend.applied.append,  # type: ignore[attr-defined]
                         None if on_reset is None else (lambda lost, b=backend: on_reset(b, lost)))
            await backend.start(require=True)
            made.append(backend)
        yield made
    finally:
        for backend in made:
            await backend.aclose()


async def eventually(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait until `condition()` holds (the timeout only guards against a hang)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.002)


async def redis_window_closed(backend: RedisBackend) -> None:
    """Until Redis's own clock (TIME) has passed the end of the registration window it keeps."""
    until_us = int(await backend.client.hget(backend.keys.meta, "registering_until"))
    async with asyncio.timeout(60.0):  # a guard against a hang only
        while True:
            seconds, micros = await backend.client.time()
            if seconds * 1_000_000 + micros >= until_us:
                return
            await asyncio.sleep(0.01)


async def test_a_step_on_one_replica_wakes_a_session_queued_on_another_as_the_step_is_appended(
        redis_server: RedisServer) -> None:
    # The tail's XREAD blocks for an hour: only the entry appended by b's step can end it, so a wake-up at all
    # (before the hang guard) is pushed by that step, never a poll at the end of a block.
    async with backends(redis_server, 2, tail_block_ms=3_600_000) as (a, b):
        for k in range(20):
            assert await b.step(Step("arrive", f"live{k}", (100, 10))) != []
            assert await a.step(Step("arrive", f"queued{k}", (100, 10))) == []  # the budget is b's session's
            woken_by: list[tuple[str, str | None, int]] = []
            a.bind(lambda applied, w=woken_by, k=k: w.append((applied.step.kind, applied.step.session_id,
                                                              a.replicated.n)) if any(
                isinstance(e, Admitted) and e.session_id == f"queued{k}" for e in applied.events) else None)
            await b.step(Step("finish", f"live{k}", ()))
            finished_n = b.replicated.n  # b's own entry, answered to b: its number in the stream
            await eventually(lambda w=woken_by: bool(w))
            assert woken_by == [("finish", f"live{k}", finished_n)]  # woken by applying b's finish, on a's tail
            await a.step(Step("finish", f"queued{k}", ()))


async def test_a_batch_sent_again_after_its_answer_was_lost_applies_once(redis_server: RedisServer) -> None:
    async with backends(redis_server, 1) as (a,):
        payload = encode_step(Step("arrive", "twice", (50, 5)), 1)
        for _ in range(2):  # what a replica does when the connection drops before the answer: send it again
            await a.script("append")(keys=[a.keys.stream, a.keys.meta],
                                     args=[a.epoch, "0-0", "ghost-replica", "1", payload])
        await eventually(lambda: a.replicated.n == 2)
        assert a.policy.snapshot().live == ("twice",) and a.replicated.counters["ghost-replica"] == 1
        assert [x.is_duplicate for x in a.applied] == [False, True]  # type: ignore[attr-defined]


async def test_snapshots_trim_the_stream_and_a_replica_behind_them_reloads(redis_server: RedisServer) -> None:
    async with backends(redis_server, 2) as (a, b):
        for k in range(30):
            await a.step(Step("arrive", f"s{k}", (1, 1)))
        old = ReplicatedState.from_state(b.replicated.to_state())  # b, as it was at entry 30
        for k in range(30):
            await a.step(Step("observe", f"s{k}", (2,)))
        coordinator = Coordinator(a, lambda: SignalReport.of(0, 0, None, ()), orphan_window_s=600)
        assert await coordinator.keep_snapshot()
        assert await a.client.xlen(a.keys.stream) == 1  # trimmed up to the snapshot's entry
        await a.step(Step("finish", "s0", ()))
        async with backends(redis_server, 0):
            late = RedisBackend(redis_server.url, CONFIG, replica_id="late", prefix=a.keys.prefix, tail_block_ms=50)
            await late.start(require=True)
            try:
                assert late.replicated.to_state() == a.replicated.to_state()  # snapshot + the one entry after it
            finally:
                await late.aclose()
        b.replicated = old  # b fell behind the trim: its next read finds a gap, it reloads the snapshot
        b.request_resync("test: behind the snapshot")
        await eventually(lambda: b.is_up and b.replicated.n == a.replicated.n)
        assert b.replicated.to_state() == a.replicated.to_state()


async def test_after_the_state_is_lost_registrations_come_before_any_arrival(redis_server: RedisServer) -> None:
    registered: dict[str, bool] = {}

    def reregister(backend: RedisBackend, is_lost: bool) -> None:
        if is_lost and backend.replica_id == "r1":  # r1 held `old`: it registers it again (the room's reconcile)
            backend.submit(Step("adopt", "old", (100, 10)))
            registered["r1"] = True

    clock = ManualClock()  # the registration window is kept on it: it closes only when the test moves it
    async with backends(redis_server, 2, lease_s=1.0, on_reset=reregister, clock=clock) as (a, b):
        await a.step(Step("arrive", "old", (100, 10)))
        await eventually(lambda: b.replicated.n == 1)
        await a.client.delete(a.keys.meta, a.keys.stream, a.keys.snapshot)  # Redis lost everything
        b.request_resync("test: b notices first")
        await eventually(lambda: b.is_up)
        opened_s = clock.now()  # b opened the window (one lease) at this time on the clock
        a.submit(Step("observe", "old", (11,)))  # a finds out on its next step
        arriving = asyncio.create_task(b.step(Step("arrive", "new", (100, 10))))  # held while registration runs
        await eventually(lambda: clock.next_deadline() == opened_s + 1.0)  # b's sender waits for the window's end
        assert not arriving.done() and b.num_pending == 1  # the arrival is held here, not sent
        await eventually(lambda: a.is_up and registered.get("r1", False))
        await eventually(lambda: b.policy.is_live("old"))  # the registration is sequenced while the window is open
        assert not arriving.done() and b.num_pending == 1 and clock.now() == opened_s
        await redis_window_closed(b)  # Redis keeps the window too (on its clock): an arrival sent earlier fails
        await clock.drive(arriving)  # the window closes on b's clock: the arrival is sent
        assert await arriving == []  # queued behind the registered `old`: it was not admitted first
        assert clock.now() >= opened_s + 1.0  # held until the window had closed
        assert b.policy.snapshot().live == ("old",) and b.policy.snapshot().queued == ("new",)
        assert a.num_dropped_steps == 1  # the observe made for the lost state: the adopt carries the size
        assert b.epoch == a.epoch


async def test_steps_wait_while_redis_cannot_be_reached(redis_server: RedisServer) -> None:
    async with backends(redis_server, 1) as (a,):
        a.mark_down(None, "test: Redis gone")
        with pytest.raises(StateUnavailableError, match="test: Redis gone"):
            await a.step(Step("arrive", "x", (1, 1)))
        await eventually(lambda: a.is_up)
        assert await a.step(Step("arrive", "x", (1, 1))) != []


async def test_a_command_after_redis_restarted_is_sent_again_on_a_new_connection(tmp_path: Path) -> None:
    """The pool still holds connections to the old server: each would fail one command (and mark the shared
    state down for a moment) unless the command is sent again; a plain client shows the failure."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        for client, expected_first in ((redis_client(server.url, socket_timeout=2, socket_connect_timeout=1), True),
                                       (aioredis.Redis.from_url(server.url, socket_timeout=2), False)):
            await asyncio.gather(*(client.blpop([f"k{i}"], timeout=0.2) for i in range(3)))  # 3 pooled connections
            server.restart()
            outcomes = []
            for _ in range(3):
                try:
                    outcomes.append(await client.ping())
                except RedisConnectionError:
                    outcomes.append(False)
            await client.aclose()
            assert outcomes == [expected_first, True, True]
    finally:
        server.kill()

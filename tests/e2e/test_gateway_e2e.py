"""End to end: the official `openai` client -> basin-gateway -> the real SGLang router (`smg`, PD mode) -> stand-ins.

Everything runs as subprocesses on free loopback ports: a prefill and a decode stand-in worker
(`standin_worker.py`), `python -m smg.launch_router --pd-disaggregation`, and two gateways started
with their CLI (`python -m basin_runtime.gateway --config ...`):
- "full": a 1-token budget, so once one session is live every new one waits at the gateway;
- "shedding": the same, with shedding tuned to fire within a second (tiny shed wait, a peak
  completion rate far below any arrival rate).
Every test ends the sessions it opened, so each starts with an empty gateway. All processes are
killed in the fixture's teardown, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from basin_runtime.gateway.priority import routing_key
from basin_stack.stack import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
STARTUP_TIMEOUT_S = 30.0
RETRY_AFTER_S = 7
# Only so a broken rule fails instead of hanging: never what a test asserts (no test here asserts wall time).
HANG_GUARD_S = 60.0


@dataclass
class Process:
    """One subprocess and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)  # its own process group: the router's children go too
        self.popen.wait(timeout=10)


@dataclass
class Deployment:
    """Base URLs of everything the fixture started."""

    prefill: str
    decode: str
    router: str
    full_gateway: str
    shedding_gateway: str

    def records(self, content: str) -> dict[str, list[dict[str, Any]]]:
        """What each worker received for calls whose last user message is `content`."""
        return {role: [r for r in httpx.get(f"{url}/_records", timeout=5).json() if r["content"] == content]
                for role, url in (("prefill", self.prefill), ("decode", self.decode))}


def start(name: str, argv: list[str], logs: Path) -> Process:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return Process(name, popen, log)


def wait_ready(process: Process, url: str, deadline: float) -> None:
    """Poll `url` until it answers 200; fail with the process's log if it dies or the deadline passes."""
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            pytest.fail(f"{process.name} exited with {process.popen.returncode} before it was ready\n{process.tail()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.1)
    pytest.fail(f"{process.name} was not ready at {url} within {STARTUP_TIMEOUT_S} s\n{process.tail()}")


def gateway_config(logs: Path, name: str, router: str, port: int, **extra: Any) -> Path:
    config = {"upstream": router, "host": "127.0.0.1", "port": port, "model": str(MODEL_FILE), "budget_tokens": 1,
              "tick_interval_s": 0.1, "retry_after_s": RETRY_AFTER_S, "upstream_timeout_s": 20, **extra}
    path = logs / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def start_standin(role: str, port: int, logs: Path, *, bootstrap_port: int | None = None,
                  name: str | None = None) -> Process:
    """A stand-in worker (`standin_worker.py`) of `role` on `port` (a prefill one also on `bootstrap_port`)."""
    argv = [sys.executable, "-m", "tests.e2e.standin_worker", "--role", role, "--port", str(port)]
    if bootstrap_port is not None:
        argv += ["--bootstrap-port", str(bootstrap_port)]
    return start(name or role, argv, logs)


def start_pd_router(logs: Path, processes: list[Process], router_args: Sequence[str] = ()) -> dict[str, int]:
    """A prefill and a decode stand-in, then smg in PD mode in front of them, every one ready; the ports by name
    (prefill, bootstrap, decode, router). Each process started is appended to `processes` for the caller to kill."""
    ports = {name: free_port() for name in ("prefill", "bootstrap", "decode", "router", "metrics")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    workers = [start_standin("prefill", ports["prefill"], logs, bootstrap_port=ports["bootstrap"]),
               start_standin("decode", ports["decode"], logs)]
    processes += workers
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for process in workers:
        wait_ready(process, f"{url[process.name]}/health", deadline)
    router = start("router", [
        sys.executable, "-m", "smg.launch_router", "--pd-disaggregation",
        "--prefill", url["prefill"], str(ports["bootstrap"]), "--decode", url["decode"],
        "--host", "127.0.0.1", "--port", str(ports["router"]),
        # smg serves Prometheus metrics on 0.0.0.0:29000 unless told otherwise: keep it on loopback.
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["metrics"]), "--log-level", "warn",
        *router_args,
    ], logs)
    processes.append(router)
    wait_ready(router, f"{url['router']}/readiness", deadline)  # both workers registered and healthy
    return ports


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("e2e")
    processes: list[Process] = []
    try:
        ports = start_pd_router(logs, processes)
        ports.update(full=free_port(), shed=free_port())
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        shedding = {"policy": {"peak_completion_rate_per_s": 1e-4, "shed_wait_s": 0.5, "arrival_window_s": 60}}
        for name, extra in (("full", {}), ("shed", shedding)):
            config = gateway_config(logs, name, url["router"], ports[name], **extra)
            processes.append(start(name, [sys.executable, "-m", "basin_runtime.gateway", "--config", str(config)],
                                   logs))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for process in processes[3:]:
            wait_ready(process, f"{url[process.name]}/health", deadline)
        yield Deployment(url["prefill"], url["decode"], url["router"], url["full"], url["shed"])
    finally:
        for process in reversed(processes):
            process.kill()


def client_for(gateway: str, timeout_s: float = 10.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="test-key", max_retries=0, timeout=timeout_s)


async def ask(client: openai.AsyncOpenAI, session: str, content: str, *earlier: str) -> str:
    """One non-streamed chat call of `session` (its earlier user turns, each answered, then `content`); the
    answer's text. A later call keeps the session's first turn: a session id names one conversation (issue 46)."""
    messages: list[dict[str, str]] = []
    for turn in earlier:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "stand-in answer"}]
    reply = await client.chat.completions.create(model="standin-model",
                                                 messages=[*messages, {"role": "user", "content": content}],
                                                 extra_headers={"X-Session-ID": session})
    return reply.choices[0].message.content or ""


async def end(gateway: str, *sessions: str) -> None:
    async with httpx.AsyncClient(base_url=gateway, timeout=5) as http:
        for session in sessions:
            response = await http.post(f"/basin/sessions/{session}/end")
            assert response.status_code in (200, 404), response.text


async def test_replies_come_back_streamed_and_not(deployment: Deployment) -> None:
    async with client_for(deployment.full_gateway) as client:
        try:
            models = await client.models.list()
            reply = await client.chat.completions.create(
                model="standin-model", messages=[{"role": "user", "content": "e2e replies"}],
                extra_headers={"X-Session-ID": "e2e-replies"})
            stream = await client.chat.completions.create(
                model="standin-model", stream=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "e2e replies"}, {"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "e2e replies, streamed"}],
                extra_headers={"X-Session-ID": "e2e-replies"})
            chunks = [chunk async for chunk in stream]
        finally:
            await end(deployment.full_gateway, "e2e-replies")

    assert [m.id for m in models.data] == ["standin-model"]
    assert reply.choices[0].message.content == "stand-in answer"
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert isinstance(reply.usage.prompt_tokens_details.cached_tokens, int)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "stand-in streamed answer"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None
    for content in ("e2e replies", "e2e replies, streamed"):
        seen = deployment.records(content)
        assert len(seen["prefill"]) == len(seen["decode"]) == 1
        assert seen["decode"][0]["authorization"] == "Bearer test-key"  # the client's credential reaches the engine


async def test_priority_rid_and_routing_key_reach_both_workers(deployment: Deployment) -> None:
    """smg forwards the body's bounded priority and stable rid, and the routing-key header, to both halves."""
    async with client_for(deployment.full_gateway) as client:
        await ask(client, "e2e-keyed", "e2e keyed task")
        await ask(client, "e2e-keyed", "e2e keyed task, again", "e2e keyed task")
        await end(deployment.full_gateway, "e2e-keyed")

    key = routing_key("e2e-keyed")
    for call, text in enumerate(("e2e keyed task", "e2e keyed task, again")):
        (prefill,), (decode,) = deployment.records(text).values()
        assert type(decode["priority"]) is int and decode["priority"] == prefill["priority"] == 0  # alone: level 0
        assert decode["rid"] == prefill["rid"] == f"{key}_t{call}"
        assert decode["routing_key"] == prefill["routing_key"] == key
        assert decode["bootstrap_room"] == prefill["bootstrap_room"] is not None  # smg's PD protocol, SGLang style


async def test_with_a_full_budget_a_second_session_waits_and_runs_once_the_first_ends(deployment: Deployment) -> None:
    gateway = deployment.full_gateway
    async with client_for(gateway, timeout_s=HANG_GUARD_S) as client, \
            httpx.AsyncClient(base_url=gateway, timeout=5) as http:
        try:
            await ask(client, "e2e-first", "e2e first task")
            second = asyncio.create_task(ask(client, "e2e-second", "e2e second task"))
            await until_state(http, lambda s: s["policy"]["queued"] == ["e2e-second"])  # it arrived, and waits
            assert not second.done()
            assert deployment.records("e2e second task")["decode"] == []
            await end(gateway, "e2e-first")
            assert await second == "stand-in answer"  # admitted by the end: nothing else frees the one-token budget
        finally:
            await end(gateway, "e2e-first", "e2e-second")
    assert len(deployment.records("e2e second task")["decode"]) == 1


async def test_a_session_whose_client_gives_up_leaves_the_queue(deployment: Deployment) -> None:
    async with client_for(deployment.full_gateway, timeout_s=HANG_GUARD_S) as client, \
            httpx.AsyncClient(base_url=deployment.full_gateway, timeout=5) as http:
        try:
            await ask(client, "e2e-holder", "e2e holder task")
            withdrawn = await metric(http, "basin_sessions_ended_total", reason="withdrawn")
            with pytest.raises(openai.APITimeoutError):  # the client gives up: 1 s is its patience, not a bound
                await ask(client.with_options(timeout=1.0), "e2e-quitter", "e2e quitter task")

            async def quitter_withdrawn() -> bool:  # the gateway saw the closed connection
                return await metric(http, "basin_sessions_ended_total", reason="withdrawn") == withdrawn + 1

            await until(quitter_withdrawn)
            assert (await http.get("/basin/state")).json()["policy"]["queued"] == []
            await end(deployment.full_gateway, "e2e-holder")
            # Had the quitter stayed queued, it would now be live and this new session would wait behind it.
            assert await ask(client, "e2e-next", "e2e next task") == "stand-in answer"
        finally:
            await end(deployment.full_gateway, "e2e-holder", "e2e-quitter", "e2e-next")
    assert deployment.records("e2e quitter task")["decode"] == []


async def test_a_shed_session_gets_503_with_a_reason(deployment: Deployment) -> None:
    async with client_for(deployment.shedding_gateway, timeout_s=HANG_GUARD_S) as client, \
            httpx.AsyncClient(base_url=deployment.shedding_gateway, timeout=5) as http:
        try:
            await ask(client, "e2e-shed-holder", "e2e shed holder")
            shed = await metric(http, "basin_sessions_shed_total")
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError) as caught:
                await ask(client, "e2e-shed-victim", "e2e shed victim")
            waited_s = time.monotonic() - started
            assert await metric(http, "basin_sessions_shed_total") == shed + 1  # shed by the policy, counted once
        finally:
            await end(deployment.shedding_gateway, "e2e-shed-holder", "e2e-shed-victim")

    error = caught.value
    assert error.status_code == 503
    assert error.response.headers["retry-after"] == str(RETRY_AFTER_S)
    assert isinstance(error.body, dict) and error.body["type"] == "session_shed"
    assert "arrival rate" in error.body["reason"] and error.body["session_id"] == "e2e-shed-victim"
    # Shed after its shed wait (0.5 s), as the gateway measured it; the client cannot have waited less.
    assert math.isfinite(error.body["waited_s"]) and error.body["waited_s"] >= 0.5 and waited_s >= 0.5
    assert deployment.records("e2e shed victim")["decode"] == []


def restartable_gateway(tmp_path: Path, router: str, port: int, name: str, budget_tokens: int,
                        **extra: Any) -> Process:
    """A gateway process logging to tmp_path/log (raw text kept), its live-sessions file beside the log."""
    config = gateway_config(tmp_path, name, router, port, budget_tokens=budget_tokens,
                            session_log=str(tmp_path / "log" / "sessions.jsonl"), session_log_keep_text=True,
                            drain_timeout_s=5, **extra)
    process = start(name, [sys.executable, "-m", "basin_runtime.gateway", "--config", str(config)], tmp_path)
    wait_ready(process, f"http://127.0.0.1:{port}/health", time.monotonic() + STARTUP_TIMEOUT_S)
    return process


def stop_with_sigterm(process: Process) -> None:
    os.killpg(process.popen.pid, signal.SIGTERM)
    process.popen.wait(timeout=20)


async def test_sigterm_logs_live_sessions_and_the_restarted_gateway_adopts_them(deployment: Deployment,
                                                                                tmp_path: Path) -> None:
    from basin_pipeline.adapters.gateway_log import read_gateway_log
    from basin_runtime.session_log import SessionLogRecord

    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    sessions = [f"e2e-restart-{k}" for k in range(6)]
    first = restartable_gateway(tmp_path, deployment.router, port, "restart-1", budget_tokens=1_000_000)
    try:
        async with client_for(gateway) as client:
            for session in sessions:
                await ask(client, session, f"e2e restart task {session}")
        stop_with_sigterm(first)
    finally:
        first.kill()
    log = tmp_path / "log" / "sessions.jsonl"
    cut = [SessionLogRecord.from_json(line) for line in log.read_text().splitlines()]
    assert sorted(r.session_id for r in cut) == sessions and {r.end_reason for r in cut} == {"shutdown"}

    second = restartable_gateway(tmp_path, deployment.router, port, "restart-2", budget_tokens=1)
    try:
        async with client_for(gateway) as client:
            await ask(client, "e2e-restart-blocker", "e2e restart blocker")  # fills the one-token budget
            for session in sessions:  # each resumes its conversation: adopted, so none waits
                history = [{"role": "user", "content": f"e2e restart task {session}"},
                           {"role": "assistant", "content": "stand-in answer"}, {"role": "user", "content": "go on"}]
                reply = await asyncio.wait_for(client.chat.completions.create(
                    model="standin-model", messages=history, extra_headers={"X-Session-ID": session}), HANG_GUARD_S)
                assert reply.choices[0].message.content == "stand-in answer"
            fabricated = asyncio.create_task(client.chat.completions.create(  # a made-up history still waits
                model="standin-model", extra_headers={"X-Session-ID": "e2e-restart-fake"},
                messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                          {"role": "user", "content": "z"}]))
            async with httpx.AsyncClient(base_url=gateway, timeout=5) as http:
                await until_state(http, lambda s: s["policy"]["queued"] == ["e2e-restart-fake"])
            assert not fabricated.done()
            fabricated.cancel()
            await end(gateway, "e2e-restart-blocker", *sessions)
        stop_with_sigterm(second)
    finally:
        second.kill()
    resumed = [SessionLogRecord.from_json(line) for line in log.read_text().splitlines()][len(cut):]
    assert {r.session_id for r in resumed if r.adopted} == set(sessions)
    joined = [s for s in read_gateway_log(log, "e2e") if getattr(s, "session_id", "") in sessions]
    assert len(joined) == 6 and all(len(s.calls) == 2 for s in joined)  # type: ignore[union-attr]


async def test_after_sigkill_the_adopted_sessions_are_logged_whole_and_ingest_reads_them(deployment: Deployment,
                                                                                         tmp_path: Path) -> None:
    """Issue 36 item 11: kill -9 leaves the last periodic live-sessions file; the next run adopts each session that
    continues its conversation and logs it whole (the killed run's calls, one the file never saw, its own)."""
    from basin_pipeline.adapters.gateway_log import read_gateway_log
    from basin_pipeline.records import Reject
    from basin_runtime.session_log import SessionLogRecord

    port = free_port()
    gateway = f"http://127.0.0.1:{port}"
    sessions = [f"e2e-kill-{k}" for k in range(3)]

    def history(session: str, turns: int) -> list[dict[str, str]]:
        messages = [{"role": "user", "content": f"e2e kill task {session}"}]
        for k in range(1, turns):
            messages += [{"role": "assistant", "content": "stand-in answer"}, {"role": "user", "content": f"step {k}"}]
        return messages

    async def call(client: openai.AsyncOpenAI, session: str, turns: int) -> None:
        await asyncio.wait_for(client.chat.completions.create(model="standin-model", messages=history(
            session, turns), extra_headers={"X-Session-ID": session}), HANG_GUARD_S)  # type: ignore[arg-type]

    live_file = tmp_path / "log" / "sessions.live.json"

    async def file_has_both_calls() -> bool:  # the live-sessions file is written every 2 s, from a thread
        listed = json.loads(live_file.read_text())["sessions"] if live_file.exists() else {}
        return all(len(listed.get(s, {}).get("calls", ())) == 2 for s in sessions)

    first = restartable_gateway(tmp_path, deployment.router, port, "kill-1", budget_tokens=1_000_000)
    try:
        async with client_for(gateway) as client:
            for session in sessions:
                await call(client, session, 1)
                await call(client, session, 2)
            await until(file_has_both_calls)
            await call(client, sessions[0], 3)  # a call the file never sees
        os.killpg(first.popen.pid, signal.SIGKILL)
        first.popen.wait(timeout=10)
    finally:
        first.kill()
    log = tmp_path / "log" / "sessions.jsonl"
    assert not log.exists() or log.read_text() == ""  # killed: nothing logged
    second = restartable_gateway(tmp_path, deployment.router, port, "kill-2", budget_tokens=1)
    try:
        async with client_for(gateway) as client:
            await ask(client, "e2e-kill-blocker", "e2e kill blocker")  # fills the one-token budget
            for session in sessions:  # each continues its conversation: adopted, none waits
                await call(client, session, 4 if session == sessions[0] else 3)
            await end(gateway, "e2e-kill-blocker", *sessions)
        stop_with_sigterm(second)
    finally:
        second.kill()
    records = {r.session_id: r for r in map(SessionLogRecord.from_json, log.read_text().splitlines())}
    assert all(not records[s].adopted for s in sessions)
    assert [len(records[s].calls) for s in sessions] == [4, 3, 3]
    read = list(read_gateway_log(log, "e2e"))
    joined = {s.session_id: s for s in read if not isinstance(s, Reject)}  # type: ignore[union-attr]
    assert not [r for r in read if isinstance(r, Reject)], read
    assert {s: len(joined[s].calls) for s in sessions} == {sessions[0]: 4, sessions[1]: 3, sessions[2]: 3}


async def test_a_later_call_past_its_reservation_waits_and_a_ride_is_a_session_of_its_own(
        deployment: Deployment) -> None:
    """Issue 46 through smg: the two-step (a tiny first call, then a made-up history) is held at the gateway and never
    reaches the workers until it fits; a ride on a live id is a session of its own, under its own admission."""
    gateway = deployment.full_gateway
    async with client_for(gateway, timeout_s=30) as client, httpx.AsyncClient(base_url=gateway, timeout=5) as http:
        try:
            assert (await http.put("/basin/budget", json={"budget_tokens": 10**9})).status_code == 200
            await ask(client, "e2e-owner", "e2e owner task")
            await ask(client, "e2e-two-step", "e2e two-step task")
            views = {v["session_id"]: v for v in (await http.get("/basin/sessions")).json()["sessions"]}
            reserved = views["e2e-owner"]["reserved_tokens"] + views["e2e-two-step"]["reserved_tokens"]
            reference = math.ceil(reserved / 1.1) + 5  # moved down from 10**9, the budget stops at 1.1 x the reference
            assert (await http.put("/basin/budget", json={"budget_tokens": reference})).status_code == 200
            made_up = "word " * (reserved + 2_000)  # past the budget: its context alone engages admission
            second = asyncio.create_task(ask(client, "e2e-two-step", "e2e two-step, more", "e2e two-step task",
                                             made_up))
            ride = asyncio.create_task(ask(client, "e2e-owner", "e2e ride", "e2e not the owner's task"))
            await until_state(http, lambda s: len(s["policy"]["queued"]) == 2)
            state = (await http.get("/basin/state")).json()["policy"]
            assert "e2e-two-step" in state["queued"] and state["reserved_tokens"] <= state["budget_tokens"]
            (rider,) = [sid for sid in state["queued"] if sid.startswith("e2e-owner~")]
            assert deployment.records("e2e two-step, more")["decode"] == []  # held: never forwarded
            assert deployment.records("e2e ride")["decode"] == []
            await end(gateway, "e2e-owner")
            assert await asyncio.wait_for(second, HANG_GUARD_S) == "stand-in answer"  # alone now: in over budget
            await end(gateway, "e2e-two-step")
            assert await asyncio.wait_for(ride, HANG_GUARD_S) == "stand-in answer"
            await end(gateway, rider)
            assert (await http.get("/basin/state")).json()["policy"]["reserved_tokens"] == 0
        finally:
            await http.put("/basin/budget", json={"budget_tokens": 1})
            await end(gateway, "e2e-owner", "e2e-two-step")
            for sid in (await http.get("/basin/state")).json()["policy"]["queued"]:
                await end(gateway, sid)
    assert len(deployment.records("e2e two-step, more")["decode"]) == 1


async def until_state(http: httpx.AsyncClient, condition: Any, timeout_s: float = HANG_GUARD_S) -> None:
    """Poll /basin/state until `condition(state)` holds (`timeout_s` is a hang guard)."""
    async with asyncio.timeout(timeout_s):
        while not condition((await http.get("/basin/state")).json()):
            await asyncio.sleep(0.05)


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float = HANG_GUARD_S) -> None:
    """Poll until `await condition()` is true (`timeout_s` is a hang guard)."""
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.05)


async def metric(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    """One sample of the gateway's /metrics, by its name and labels (0 if it has not been exported yet)."""
    response = await http.get("/metrics")
    response.raise_for_status()
    return next((sample.value for family in text_string_to_metric_families(response.text)
                 for sample in family.samples if sample.name == name and sample.labels == labels), 0.0)

"""Faults through the real router: the official `openai` client -> basin-gateway -> smg 1.13 (PD) -> stand-ins.

The rig reuses `test_gateway_e2e.py`'s: a prefill and a decode stand-in (`standin_worker.py`) and smg in PD
mode in front of them (`start_pd_router`), and one gateway with a session log and a live-sessions file
(`restartable_gateway`), a budget nobody reaches and `upstream_timeout_s` 2 s. The decode stand-in acts out
the fault a call's last user message scripts (`fault:<kind>`). Each case is a session's second call (its
first is served, so the failed one leaves the session live), then a third that must be served. After each:
the client saw a clear error (an openai exception with the status and words, or an SSE error event it
reads), the gateway counted the call once under the outcome named, `/basin/state` equals the sums over
`/basin/sessions`, nothing is in flight, and the session ends with 200 leaving nothing held
(`test_load_faults.Probe`).

smg runs with `--disable-circuit-breaker` (a worker's failures count against the prefill worker's breaker
too, and ten of them would turn every later case into 503 `no_available_workers`: `test_load_faults.py`
measures that) and `--sse-keepalive-secs 1` (with its default, 15 s, the hang case would take 15 s).

What smg 1.13 does with each decode-worker fault, measured here and asserted below:
- A worker 429, 500 or 503 is retried: 5 attempts in about 0.45 s (backoff from 50 ms). Then, not
  streamed, smg answers 500 `decode_error` for a 429 (!), 500 `decode_internal_error` for a 500 and 503
  `decode_unavailable` for a 503, each with the worker's message: the gateway's 502 `upstream_error` with
  `upstream_status`, openai's `InternalServerError`. Streamed, smg answers the worker's status with
  `text/event-stream` and the worker's own Content-Length over a longer body, `data: {"error":{"message":
  {<the worker's JSON>...`, which therefore arrives cut: the gateway passes the 429 on unchanged (openai's
  `RateLimitError`; the call is `rejected`) and answers 500/503 with its 502.
- A 200 whose body is not JSON is passed on as is (1 attempt), streamed or not: the gateway answers the
  plain one 502 `upstream_bad_answer`; the streamed one (`text/event-stream`, the same bytes) ends
  without [DONE], so the client gets the gateway's `upstream_stream_error` event quoting it.
- A stream the worker ends cleanly without [DONE] is passed on as it is: smg adds nothing, and without
  the gateway's `upstream_stream_error` event the openai client would take the short answer for a whole one.
- A worker silent after its first chunk: smg writes a `: ping` comment every `--sse-keepalive-secs` for
  as long as it waits (its request timeout is 1800 s), so no read timeout ever fires (the gateway's, the
  client's); the gateway ends the stream `upstream_timeout_s` after its last event, with an
  `upstream_timeout` event (before that rule the call hung for good).
- A worker killed mid-stream: smg ends the stream with `data: {"error": {"message": "Stream error: ...",
  "type": "stream_error"}}` and [DONE] (openai: `APIError("Stream error: ...")`); its next call fails,
  502 "Transport error: error sending request for url (<the dead worker>)", until the worker is back.
- The gateway killed with SIGKILL: sessions ended before are in its session log; after its restart on
  the same files, a session it held resumes (adopted: it is on the live-sessions file) and new ones start.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio

from basin_runtime.session_log import SessionLogRecord
from tests.e2e.test_gateway_e2e import (
    STARTUP_TIMEOUT_S,
    Process,
    ask,
    client_for,
    free_port,
    restartable_gateway,
    start_pd_router,
    start_standin,
    wait_ready,
)
from tests.e2e.test_load_faults import Probe, delta, probing, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

SMG_ARGS = ("--disable-circuit-breaker", "--sse-keepalive-secs", "1")
UPSTREAM_TIMEOUT_S = 2
BUDGET_TOKENS = 1_000_000_000
MODEL = "standin-model"
# Only so a broken rule fails instead of hanging (smg's pings defeat every read timeout): never what a test asserts.
HANG_GUARD_S = 60.0


@dataclass
class FaultRig:
    """The stand-ins, smg and the gateway; the gateway and the decode worker can be killed and started again."""

    logs: Path
    ports: dict[str, int]
    gateway_port: int
    processes: list[Process] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)  # stand-ins show no engine gauges (`Probe`)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['decode']}"

    @property
    def session_log(self) -> Path:
        return self.logs / "log" / "sessions.jsonl"

    def process(self, prefix: str) -> Process:
        """The latest process whose name starts with `prefix`."""
        return next(p for p in reversed(self.processes) if p.name.startswith(prefix))

    def start_gateway(self) -> None:
        """Start the gateway (again) on its port, with the same session log and live-sessions file."""
        name = f"gateway-{sum(p.name.startswith('gateway') for p in self.processes)}"
        self.processes.append(restartable_gateway(self.logs, self.router_url, self.gateway_port, name, BUDGET_TOKENS,
                                                  upstream_timeout_s=UPSTREAM_TIMEOUT_S))

    def restart_decode(self) -> None:
        """Start the decode stand-in again on its port (after a `fault:kill`)."""
        name = f"decode-{sum(p.name.startswith('decode') for p in self.processes)}"
        process = start_standin("decode", self.ports["decode"], self.logs, name=name)
        self.processes.append(process)
        wait_ready(process, f"{self.decode_url}/health", time.monotonic() + STARTUP_TIMEOUT_S)

    def attempts(self, content: str) -> int:
        """How many requests whose last user message is `content` the decode worker received (since its start)."""
        records = httpx.get(f"{self.decode_url}/_records", timeout=5).json()
        return sum(r["content"] == content for r in records)

    def logged(self) -> dict[str, SessionLogRecord]:
        """The session log's records by session id (the last one of each)."""
        return {r.session_id: r for r in (SessionLogRecord.from_json(line)
                                          for line in self.session_log.read_text(encoding="utf-8").splitlines())}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultRig]:
    made = FaultRig(tmp_path_factory.mktemp("faults"), {}, free_port())
    try:
        made.ports = start_pd_router(made.logs, made.processes, SMG_ARGS)
        made.start_gateway()
        yield made
    finally:
        for process in reversed(made.processes):
            process.kill()


@pytest_asyncio.fixture
async def probe(rig: FaultRig) -> AsyncIterator[Probe]:
    """A probe of the rig's gateway."""
    async with probing(rig) as made:
        yield made


def calls_delta(after: Counter[str], before: Counter[str]) -> dict[str, float]:
    """`basin_calls_total` by outcome, what changed between two scrapes."""
    keys = {k for k in (*after, *before) if k.startswith("basin_calls_total{")}
    return {k.split("=", 1)[1].rstrip("}"): d for k in keys if (d := delta(after, before, k))}


async def call(client: openai.AsyncOpenAI, session: str, content: str, *, is_stream: bool) -> str:
    """One chat call of `session` whose last user message is `content`; the answer's text."""
    messages = [{"role": "user", "content": f"task of {session}"}, {"role": "assistant", "content": "stand-in answer"},
                {"role": "user", "content": content}]
    headers = {"X-Session-ID": session}
    if not is_stream:
        reply = await client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers)
        return reply.choices[0].message.content or ""
    stream = await client.chat.completions.create(model=MODEL, messages=messages, extra_headers=headers, stream=True)
    async with stream:
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


@dataclass(frozen=True)
class Case:
    """A scripted worker fault, and what the client and the gateway's metrics must show for it."""

    fault: str
    is_stream: bool
    attempts: int  # decode requests smg made for the call
    error: type[openai.APIError]  # exactly this openai exception
    status: int | None  # its HTTP status (None: an error event in a 200 stream)
    error_type: str  # the error body's `type`
    words: str  # in the error's message or upstream body
    outcome: str = "upstream_error"  # the call's label in basin_calls_total
    upstream_status: int | None = None  # smg's status, in the gateway's 502

    @property
    def name(self) -> str:
        return f"{self.fault}-{'stream' if self.is_stream else 'whole'}"


CASES = [
    Case("status-429", False, 5, openai.InternalServerError, 502, "upstream_error", "scripted status-429",
         upstream_status=500),
    # smg's cut SSE body under the worker's 429 is not JSON: the gateway answers its own JSON with the 429 kept
    Case("status-429", True, 5, openai.RateLimitError, 429, "upstream_rejected", "scripted status-429",
         outcome="rejected", upstream_status=429),
    Case("status-500", False, 5, openai.InternalServerError, 502, "upstream_error", "scripted status-500",
         upstream_status=500),
    Case("status-500", True, 5, openai.InternalServerError, 502, "upstream_error", "scripted status-500",
         upstream_status=500),
    Case("status-503", False, 5, openai.InternalServerError, 502, "upstream_error", "scripted status-503",
         upstream_status=503),
    Case("status-503", True, 5, openai.InternalServerError, 502, "upstream_error", "scripted status-503",
         upstream_status=503),
    Case("garbage", False, 1, openai.InternalServerError, 502, "upstream_bad_answer",
         "with a body that is not JSON: b'<html>stand-in garbage, not JSON'"),
    Case("garbage", True, 1, openai.APIError, None, "upstream_stream_error",
         "its unfinished last event was dropped: b'<html>stand-in garbage, not JSON'"),
    Case("truncate", True, 1, openai.APIError, None, "upstream_stream_error",
         "ended its stream without `data: [DONE]`"),
    Case("hang", True, 1, openai.APIError, None, "upstream_timeout",
         f"sent nothing but SSE comments for {UPSTREAM_TIMEOUT_S:g} s mid-answer"),
]


def check_error(error: openai.APIError, case: Case) -> None:
    """The client's exception is the one `case` names, with its status, type and words."""
    assert type(error) is case.error, (type(error), error)
    body = error.body if isinstance(error.body, dict) else {}
    assert body.get("type") == case.error_type, error.body
    if case.status is not None:
        assert isinstance(error, openai.APIStatusError) and error.status_code == case.status
    else:  # read from the gateway's error event: the status the failure would have had
        assert body["code"] == (504 if case.error_type == "upstream_timeout" else 502), body
    if case.upstream_status is not None:
        assert body["upstream_status"] == case.upstream_status, body
    text = str(body.get("upstream_body", "")) + str(body.get("message", "")) if body else str(error.body)
    assert case.words in text, text


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_a_worker_fault_reaches_the_client_clearly_and_the_gateway_accounts_for_the_call(
        rig: FaultRig, probe: Probe, case: Case) -> None:
    session, content = f"fault-{case.name}", f"fault:{case.fault} {case.name}"
    async with client_for(rig.gateway_url) as client:
        assert await ask(client, session, f"task of {session}") == "stand-in answer"
        before = await probe.gateway_metrics()
        started = time.monotonic()
        with pytest.raises(openai.APIError) as caught:
            await asyncio.wait_for(call(client, session, content, is_stream=case.is_stream), HANG_GUARD_S)
        took_s = time.monotonic() - started
        await probe.wait_gateway_calls_done(timeout_s=HANG_GUARD_S)
        after = await probe.gateway_metrics()

        check_error(caught.value, case)
        assert rig.attempts(content) == case.attempts
        assert calls_delta(after, before) == {case.outcome: 1}
        assert after["basin_calls_in_flight{}"] == 0
        await probe.check_accounting({session})
        if case.fault == "hang":
            # Cut BY the gateway's stall rule despite smg's pings: the event names the timeout and the comments it
            # saw (`check_error`: "sent nothing but SSE comments for 2 s"). Causality gives the lower bound only.
            assert took_s >= UPSTREAM_TIMEOUT_S
        assert await call(client, session, "go on", is_stream=case.is_stream) != ""  # the session goes on
    await probe.check_accounting({session})
    await probe.end_and_check_empty([session])


async def test_a_worker_killed_mid_stream_fails_that_call_with_smgs_error_event_and_the_session_goes_on(
        rig: FaultRig, probe: Probe) -> None:
    session = "fault-kill"
    async with client_for(rig.gateway_url) as client:
        assert await ask(client, session, f"task of {session}") == "stand-in answer"
        before = await probe.gateway_metrics()
        with pytest.raises(openai.APIError) as killed:
            await call(client, session, "fault:kill", is_stream=True)
        assert rig.process("decode").popen.wait(timeout=HANG_GUARD_S) != 0
        with pytest.raises(openai.InternalServerError) as dead:  # smg still routes to the dead worker
            await call(client, session, "while it is dead", is_stream=True)
        await probe.wait_gateway_calls_done(timeout_s=HANG_GUARD_S)
        after = await probe.gateway_metrics()

        assert type(killed.value) is openai.APIError and killed.value.message.startswith("Stream error: ")
        assert isinstance(killed.value.body, dict) and killed.value.body["type"] == "stream_error"
        body = dead.value.body if isinstance(dead.value.body, dict) else {}
        assert (dead.value.status_code, body.get("type"), body.get("upstream_status")) == (502, "upstream_error", 502)
        assert "Transport error" in body["upstream_body"] and rig.decode_url in body["upstream_body"]
        assert calls_delta(after, before) == {"upstream_error": 2}
        await probe.check_accounting({session})

        await asyncio.to_thread(rig.restart_decode)
        assert await call(client, session, "it is back", is_stream=True) == "stand-in streamed answer"
    await probe.end_and_check_empty([session])


async def test_an_idle_client_connection_outlives_the_client_pools_idle_time(rig: FaultRig) -> None:
    # uvicorn's default keep-alive (5 s) is the idle time of the httpx / openai pools: a client reusing a
    # connection at 5 s raced the close and got a reset (issue 16, item 13). The gateway now keeps it 90 s.
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.gateway_port)
    request = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"
    try:
        for pause_s in (0.0, 5.5):
            await asyncio.sleep(pause_s)  # idle, as a pooled connection between two calls
            writer.write(request)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            assert json.loads(await reader.readexactly(length)) == {"status": "ok"}
    finally:
        writer.close()


async def test_a_gateway_killed_with_sigkill_loses_no_ended_session_and_serves_again_once_restarted(
        rig: FaultRig, probe: Probe) -> None:
    live_file = rig.session_log.with_name("sessions.live.json")

    async def is_listed() -> bool:
        return live_file.exists() and "gw-live" in json.loads(live_file.read_text())["sessions"]

    async with client_for(rig.gateway_url) as client:
        assert await ask(client, "gw-ended", "task of gw-ended") == "stand-in answer"
        await probe.end_all(["gw-ended"])
        assert await ask(client, "gw-live", "task of gw-live") == "stand-in answer"
        await wait_for(is_listed, HANG_GUARD_S, "the live-sessions file listing gw-live")  # written every 2 s
    rig.process("gateway").kill()  # SIGKILL to its process group: no drain, no shutdown logging

    logged = rig.logged()
    assert logged["gw-ended"].end_reason == "ended" and len(logged["gw-ended"].calls) == 1
    assert "gw-live" not in logged  # live at the kill: never ended, so never logged

    await asyncio.to_thread(rig.start_gateway)
    async with client_for(rig.gateway_url) as client:
        assert await call(client, "gw-live", "resumed after the restart", is_stream=True) == "stand-in streamed answer"
        assert await ask(client, "gw-new", "task of gw-new") == "stand-in answer"
    sessions = await probe.check_accounting({"gw-live", "gw-new"})
    assert sessions["gw-live"]["is_adopted"] and not sessions["gw-new"]["is_adopted"]
    assert calls_delta(await probe.gateway_metrics(), Counter()) == {"completed": 2}  # a new process, new counters
    await probe.end_and_check_empty(["gw-live", "gw-new"])

    async def both_logged() -> bool:  # the writer thread appends them a moment after the ends
        return {"gw-live", "gw-new"} <= set(rig.logged())

    await wait_for(both_logged, HANG_GUARD_S, "the restarted gateway logging its ended sessions")
    logged = rig.logged()
    # killed, not shut down: the adopted session is logged whole, its call before the kill from the live-sessions
    # file (issue 36 item 11), so ingest reads it as one session
    assert not logged["gw-live"].adopted and len(logged["gw-live"].calls) == 2 and not logged["gw-new"].adopted
    assert logged["gw-live"].task_text == "task of gw-live"
    assert logged["gw-ended"].end_reason == "ended"  # the earlier record is intact after the kill

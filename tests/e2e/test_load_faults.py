"""Load and fault tests of the whole stack: openai client -> Basin gateway -> smg (PD) -> emulated engines.

Everything runs on loopback through `basin_stack.stack.LocalStack` (each process in its own process group,
all killed when the fixture's `with` block exits): one prefill and two decode emulators on the TINY
profile (tests/emulate/rig.py: prefill 10 ms + 0.1 ms/token, decode 20 ms/step), the real `smg` router
and the gateway with a budget nobody reaches (admission never holds a session here; these tests are
about the data path and the accounting, not the policy). Sizes are small so the module takes well
under a minute and a half on two cores.

1. Load: 48 replayed sessions (basin_loadgen.replay_client, streamed calls) at once; every call answered
   with the planned token counts, cached tokens on every later call, and the gateway's accounting and
   the engines' queues back to empty once the sessions end.
2. Faults: a decode engine and then the prefill engine SIGKILLed under load and restarted. Failed calls
   must reach the client as a clear error (the gateway's 502 JSON with smg's words, or the error event
   smg writes into a stream it cannot finish), the gateway's count of upstream errors must match what
   clients saw, other sessions go on, and no admitted session's accounting is lost.
3. A slow engine (a second stack, engines at time scale 0.05) past the gateway's `upstream_timeout_s`:
   504 with a clear message, the call's in-flight accounting released, the session usable after.
4. Clients that read one chunk of a stream and close it: the gateway ends the call (client_gone), the
   engines drop the request (none runs to its end: their generated-token counters do not move), the session
   goes on.
No test asserts wall time: events are ordered by `time.monotonic()` stamps, and every wait for one has a
generous hang guard (`HANG_GUARD_S`) that is never the claim.

What smg 1.13 does with a dead worker (measured here and in benchmarks/bench_load.py):
- A request sent to a dead decode is retried (up to 5 attempts, backoff from 50 ms); the retry may pick
  the same dead worker again (a lone client then gets 502 "Transport error: error sending request for
  url (<decode>)") or another one.
- Failed attempts count against the PREFILL worker's circuit breaker too (10 failures open it): with
  one prefill, a couple of failed client calls open it and smg answers every request 503 "No available
  prefill workers (all circuits open or unhealthy)" - the healthy decode cannot be used either - until
  `--cb-timeout-duration-secs` (default 60 s) has passed.
- Health checks (`--health-check-interval-secs`, default 60 s; 3 failures mark a worker unhealthy, 2
  successes re-admit it) are what take the dead worker out of rotation and put a restarted one back.
  With smg's defaults a killed decode (one of two) cost a full 60 s outage in the benchmark, the restart
  after 10 s did not shorten it, and health checks had not noticed the death. These tests run smg with
  a 1 s health check and a 2 s circuit-breaker timeout (`SMG_FAST_RECOVERY`): the dead worker is out
  after ~2-3 s, a restarted one back ~1.5 s after it is ready.
- A stream cut by a dying decode reaches the gateway as `data: {"error": {..."Stream error: ..."}}`
  then `[DONE]` on a cleanly ended response; the openai client raises `APIError("Stream error: ...")`.
- A dead prefill: every call fails 502 (smg's 503 "no_available_workers"); decodes drop their requests.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from basin_loadgen.replay import ConversationBuilder, RateSchedule, plan_sessions
from basin_loadgen.replay_client import ClientSettings, Replayer
from basin_runtime.tokenizer import get_tokenizer
from basin_stack.stack import LocalStack, StackSpec
from tests.emulate.rig import tiny_profile_file
from tests.sim.builders import session as pool_session

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio]

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE = ROOT / "models" / "peak_predictor.onnx"
MODEL = "tiny"  # the profile's name is the served model name
# smg's defaults (60 s health checks, 60 s circuit-breaker timeout) make a kill cost minutes; see the docstring.
SMG_FAST_RECOVERY = ("--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "2")
GATEWAY = {"model": [str(MODEL_FILE)], "budget_tokens": 1_000_000_000, "upstream_timeout_s": 20.0,
           "log_level": "warning"}
# Only so a broken rule fails instead of hanging: never what a test asserts (no test here asserts wall time).
HANG_GUARD_S = 60.0
# Every gauge an emulated engine holds a request in (SGLang's names; PD queues included).
ENGINE_QUEUES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs",
                 "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
                 "sglang:num_decode_transfer_queue_reqs")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """1 prefill + 2 decode emulators (TINY profile, real time), smg and the gateway."""
    folder = tmp_path_factory.mktemp("load-faults")
    spec = StackSpec(folder / "logs", num_prefill=1, num_decode=2, time_scale=1.0, max_total_tokens=200_000,
                     profile=str(tiny_profile_file(folder)), gateway=GATEWAY, router_args=SMG_FAST_RECOVERY)
    with LocalStack(spec) as running:
        yield running


# --- looking at the gateway and the engines ------------------------------------------------------


class GatewayHost(Protocol):
    """Where a probe looks: a `LocalStack`, or any rig with a gateway (`test_faults_smg.py`)."""

    @property
    def gateway_url(self) -> str | None: ...

    @property
    def engine_urls(self) -> list[str]: ...  # engines whose SGLang /metrics show the requests they hold


@dataclass
class Probe:
    """Reads the gateway's admin endpoints and metrics and the engines' metrics."""

    stack: GatewayHost
    http: httpx.AsyncClient

    @property
    def gateway(self) -> str:
        assert self.stack.gateway_url is not None
        return self.stack.gateway_url

    async def policy(self) -> dict[str, Any]:
        response = await self.http.get(f"{self.gateway}/basin/state")
        response.raise_for_status()
        policy: dict[str, Any] = response.json()["policy"]
        return policy

    async def sessions(self) -> dict[str, dict[str, Any]]:
        response = await self.http.get(f"{self.gateway}/basin/sessions")
        response.raise_for_status()
        return {s["session_id"]: s for s in response.json()["sessions"]}

    async def gateway_metrics(self) -> Counter[str]:
        """Every gateway sample by `name{label=value,...}`."""
        response = await self.http.get(f"{self.gateway}/metrics")
        response.raise_for_status()
        samples: Counter[str] = Counter()
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    async def end_all(self, session_ids: Sequence[str], *, missing_ok: bool = False) -> None:
        for session_id in session_ids:
            response = await self.http.post(f"{self.gateway}/basin/sessions/{session_id}/end")
            assert response.status_code == 200 or (missing_ok and response.status_code == 404), response.text

    async def engine_queues(self) -> dict[str, dict[str, float]]:
        """Each engine's non-zero request gauges."""
        busy = {}
        for url in self.stack.engine_urls:
            response = await self.http.get(f"{url}/metrics")
            response.raise_for_status()
            values = {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples}
            busy[url] = {name: values[name] for name in ENGINE_QUEUES if values.get(name)}
        return busy

    async def engine_total(self, name: str, urls: Sequence[str]) -> float:
        """A counter's samples (`sglang:generation_tokens_total`, say) summed over the engines at `urls`; each engine
        must export it (a misspelt name would make every comparison of totals vacuous)."""
        total = 0.0
        for url in urls:
            response = await self.http.get(f"{url}/metrics")
            response.raise_for_status()
            values = [s.value for f in text_string_to_metric_families(response.text) for s in f.samples
                      if s.name == name]
            assert values, f"{url} exports no {name}"
            total += sum(values)
        return total

    async def wait_engines_idle(self, timeout_s: float) -> float:
        """Seconds until no engine holds a request; fails past `timeout_s`."""
        started = time.monotonic()
        while True:
            busy = await self.engine_queues()
            if not any(busy.values()):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                pytest.fail(f"engines still hold requests after {timeout_s:g} s: {busy}")
            await asyncio.sleep(0.05)

    async def wait_gateway_calls_done(self, timeout_s: float) -> float:
        """Seconds until no session has a call in flight at the gateway; fails past `timeout_s`."""
        started = time.monotonic()
        while True:
            in_flight = {sid: s["in_flight"] for sid, s in (await self.sessions()).items() if s["in_flight"]}
            if not in_flight:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                pytest.fail(f"calls still in flight at the gateway after {timeout_s:g} s: {in_flight}")
            await asyncio.sleep(0.05)

    async def check_accounting(self, live: set[str]) -> dict[str, dict[str, Any]]:
        """The gateway holds exactly `live`, all idle, and the policy's sums equal the sums over them."""
        policy, sessions = await self.policy(), await self.sessions()
        assert set(sessions) == live and set(policy["live"]) == live and policy["queued"] == []
        for s in sessions.values():
            assert (s["state"], s["in_flight"], s["waiters"]) == ("live", 0, 0), s
        assert policy["working_set_tokens"] == sum(s["last_prompt_tokens"] for s in sessions.values())
        assert policy["reserved_tokens"] == sum(max(math.ceil(s["reserved_peak_tokens"]), s["last_prompt_tokens"])
                                                for s in sessions.values())
        return sessions

    async def end_and_check_empty(self, session_ids: Sequence[str]) -> None:
        """End the sessions; the gateway then holds nothing, reserves nothing, and the engines hold nothing."""
        await self.end_all(session_ids)
        policy = await self.policy()
        assert (policy["live"], policy["queued"], policy["reserved_tokens"], policy["working_set_tokens"]) == (
            [], [], 0, 0)
        assert await self.sessions() == {}
        await self.wait_engines_idle(timeout_s=HANG_GUARD_S)


@asynccontextmanager
async def probing(host: GatewayHost) -> AsyncIterator[Probe]:
    """A probe of `host`'s gateway; whatever sessions a failed test left behind are ended after it."""
    async with httpx.AsyncClient(timeout=10) as http:
        made = Probe(host, http)
        yield made
        await made.end_all(list(await made.sessions()), missing_ok=True)


@pytest_asyncio.fixture
async def probe(stack: LocalStack) -> AsyncIterator[Probe]:
    """A probe of the shared stack."""
    async with probing(stack) as made:
        yield made


def delta(after: Counter[str], before: Counter[str], key: str) -> float:
    return after[key] - before[key]


CALLS = "basin_calls_total{{outcome={}}}"


# --- a session that keeps calling, for the fault tests -------------------------------------------


@dataclass
class CallResult:
    """One streamed chat call as the client saw it."""

    session: str
    started: float
    ended: float
    kind: str  # ok | http (an HTTP error status) | stream_error (an error event in the stream) | other
    status: int | None = None
    error_type: str | None = None
    message: str = ""
    served_by: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


async def stream_call(client: openai.AsyncOpenAI, session: str, messages: list[dict[str, Any]],
                      max_tokens: int) -> tuple[CallResult, str]:
    """One streamed call with usage; the result and the answer's text (empty on failure)."""
    result = CallResult(session, time.monotonic(), math.nan, "ok")
    parts: list[str] = []
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[], extra_body={"messages": messages}, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session})
        result.served_by = raw.headers.get("x-smg-routed-worker-id")
        async with raw.parse() as stream:
            async for chunk in stream:
                parts += [choice.delta.content or "" for choice in chunk.choices]
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    result.prompt_tokens, result.completion_tokens = (chunk.usage.prompt_tokens,
                                                                      chunk.usage.completion_tokens)
                    result.cached_tokens = None if details is None else details.cached_tokens
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        result.kind, result.status = "http", exc.status_code
        result.error_type, result.message = body.get("type"), str(body.get("message", exc.message))
    except openai.APIError as exc:  # an error event inside the stream (smg: the engine died mid-answer)
        result.kind = "stream_error" if exc.message.startswith("Stream error") else "other"
        result.error_type, result.message = type(exc).__name__, exc.message
    result.ended = time.monotonic()
    return result, "".join(parts)


@dataclass
class Agent:
    """A session calling in a loop until stopped: its conversation grows on success, is resent on failure."""

    session: str
    task_words: int = 40
    results: list[CallResult] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": "You are a careful coding agent."},
                         {"role": "user", "content": f"Task {self.session}: " + "fix the test " * self.task_words}]

    async def call(self, client: openai.AsyncOpenAI, max_tokens: int = 30) -> CallResult:
        result, answer = await stream_call(client, self.session, self.messages, max_tokens)
        self.results.append(result)
        if result.ok:
            self.messages += [{"role": "assistant", "content": answer},
                              {"role": "user", "content": f"step {len(self.results)}: " + "tool output " * 20}]
        return result

    async def run(self, client: openai.AsyncOpenAI, stop: asyncio.Event, gap_s: float = 0.05) -> None:
        """Call until `stop`, `gap_s` apart (4x that after a failure, as an agent backs off)."""
        while not stop.is_set():
            result = await self.call(client)
            await asyncio.sleep(gap_s if result.ok else 4 * gap_s)


def client_for(stack: LocalStack, timeout_s: float = 30.0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="test-key", max_retries=0, timeout=timeout_s)


async def worker_health(http: httpx.AsyncClient, stack: LocalStack) -> dict[str, bool]:
    """smg's view: worker URL -> is_healthy."""
    response = await http.get(f"{stack.router_url}/workers")
    response.raise_for_status()
    return {w["url"]: w["is_healthy"] for w in response.json()["workers"]}


async def wait_for(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Seconds until `await condition()` is true; fails past `timeout_s`."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def assert_clear_failure(result: CallResult, words: Sequence[str]) -> None:
    """A failed call reached the client as the gateway's JSON error or smg's stream error, in smg's words."""
    assert "Traceback" not in result.message and result.message, result
    if result.kind == "http":
        assert (result.status, result.error_type) == (502, "upstream_error"), result
        assert result.message.startswith("upstream answered 50"), result
        assert any(w in result.message for w in words), result
    else:
        assert result.kind == "stream_error" and len(result.message) > len("Stream error: "), result


# --- 1. load ---------------------------------------------------------------------------------------


async def test_many_concurrent_streaming_sessions_are_all_answered_and_leave_nothing_behind(stack: LocalStack,
                                                                                          probe: Probe) -> None:
    prompts, completion = [300, 600, 900, 1200], 8
    pool = [pool_session(f"pool-{k}", [p + 40 * k for p in prompts], completion=completion, gap_s=0.2)
            for k in range(4)]
    planned = plan_sessions(pool, RateSchedule.steady(400.0, 1.0), seed=3, tag="load", max_sessions=48)
    assert len(planned) == 48 and planned[-1].arrival_s < 0.5  # they all overlap
    settings = ClientSettings(f"{stack.base_url}/v1", time_scale=1.0, max_wait_s=30.0, request_timeout_s=60.0,
                              end_sessions=False, max_drain_s=60.0)
    replayer = Replayer(settings, ConversationBuilder(pool, get_tokenizer("qwen3.6"), "load"))
    before = await probe.gateway_metrics()
    started = time.monotonic()
    records = await asyncio.wait_for(replayer.run(planned), timeout=60)
    took_s = time.monotonic() - started
    after = await probe.gateway_metrics()

    calls = [c for r in records for c in r.calls]
    assert [r.status for r in records] == ["finished"] * 48, [(r.run_id, r.reason) for r in records]
    assert len(calls) == 48 * len(prompts) and all(c.error is None for c in calls)
    for record in records:
        for call in record.calls:
            assert call.prompt_tokens == call.built_prompt_tokens  # the engine counts what the client built
            assert call.completion_tokens == completion
            assert call.cached_tokens is not None and 0 <= call.cached_tokens <= call.prompt_tokens
        for earlier, later in itertools.pairwise(record.calls):
            assert earlier.prompt_tokens is not None and later.cached_tokens is not None
            assert later.cached_tokens == earlier.prompt_tokens, (record.run_id, earlier, later)  # all of it hits
    assert delta(after, before, CALLS.format("completed")) == len(calls)
    assert delta(after, before, "basin_sessions_admitted_total{}") == 48

    # Before they end: the gateway's view of each session matches the engines' usage.
    sessions = await probe.check_accounting({r.run_id for r in records})
    for record in records:
        seen, last = sessions[record.run_id], record.calls[-1]
        assert seen["num_calls"] == len(prompts)
        assert (seen["last_prompt_tokens"], seen["last_cached_tokens"]) == (last.prompt_tokens, last.cached_tokens)
        assert seen["served_by"] in stack.decode_urls
    await probe.end_and_check_empty([r.run_id for r in records])
    ended = await probe.gateway_metrics()
    assert delta(ended, before, "basin_sessions_ended_total{reason=ended}") == 48
    print(f"\n{len(calls)} calls of 48 sessions in {took_s:.1f} s; emulator lag {await asyncio.to_thread(stack.lag)}")


# --- 4. clients disconnecting mid-stream -----------------------------------------------------------


async def test_clients_leaving_mid_stream_release_the_call_at_the_gateway_and_the_engines(stack: LocalStack,
                                                                                          probe: Probe) -> None:
    agents = [Agent(f"leave-{k}") for k in range(8)]
    long_answer = 1000  # 20 s of decode steps: an engine that ran them to their end would count 8,000 tokens

    async def read_one_chunk_and_leave(client: openai.AsyncOpenAI, agent: Agent) -> None:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[], extra_body={"messages": agent.messages}, max_tokens=long_answer, stream=True,
            extra_headers={"X-Session-ID": agent.session})
        async with stream:
            async for _ in stream:
                break  # one chunk, then the `async with` closes the connection

    async with client_for(stack) as client:
        before = await probe.gateway_metrics()
        generated = await probe.engine_total("sglang:generation_tokens_total", stack.decode_urls)
        await asyncio.gather(*(read_one_chunk_and_leave(client, a) for a in agents))
        gateway_s = await probe.wait_gateway_calls_done(timeout_s=HANG_GUARD_S)
        engines_s = await probe.wait_engines_idle(timeout_s=HANG_GUARD_S)
        after = await probe.gateway_metrics()

        # Released BECAUSE the clients left, not because the answers ended: the engines are idle and none of
        # the 8 requests finished there (the emulator counts a request's 1,000 tokens when it finishes).
        assert await probe.engine_total("sglang:generation_tokens_total", stack.decode_urls) == generated
        assert delta(after, before, CALLS.format("client_gone")) == len(agents)
        assert delta(after, before, CALLS.format("completed")) == 0
        await probe.check_accounting({a.session for a in agents})

        results = await asyncio.gather(*(a.call(client) for a in agents))  # each session's next call
    assert all(r.ok and r.completion_tokens == 30 for r in results), results
    await probe.check_accounting({a.session for a in agents})
    await probe.end_and_check_empty([a.session for a in agents])
    print(f"\nreleased: gateway {gateway_s:.2f} s, engines {engines_s:.2f} s after the clients left")


# --- 2. an engine killed under load and restarted -------------------------------------------------


async def test_a_decode_engine_killed_under_load_fails_only_its_calls_and_comes_back(stack: LocalStack,
                                                                                     probe: Probe) -> None:
    agents = [Agent(f"dk-{k}") for k in range(12)]
    late = [Agent(f"dk-late-{k}") for k in range(4)]  # sessions that arrive while the engine is dead
    everyone, stop = agents + late, asyncio.Event()
    dead = ""

    async def a_decode_is_busy() -> bool:  # the one to kill mid-answer (smg's cache-aware routing may favour one)
        nonlocal dead
        running = {url: q.get("sglang:num_running_reqs", 0) for url, q in (await probe.engine_queues()).items()
                   if url in stack.decode_urls}
        dead = max(running, key=lambda url: running[url])
        return running[dead] >= 2

    async def dead_is_out() -> bool:
        return not (await worker_health(probe.http, stack))[dead]

    async def dead_is_back() -> bool:
        return (await worker_health(probe.http, stack))[dead]

    async def dead_serves_again() -> bool:
        return any(r.ok and r.served_by == dead and r.started > restarted for a in everyone for r in a.results)

    async def served_while_out() -> bool:  # the other decode carries the load while this one is dead
        return sum(r.ok and r.started > detected for a in everyone for r in a.results) >= 20

    async def each_called_since_back() -> bool:  # every session's call after the recovery has its answer
        return all(any(r.started > back for r in a.results) for a in everyone)

    async with client_for(stack) as client:
        before = await probe.gateway_metrics()
        runs = [asyncio.create_task(a.run(client, stop)) for a in agents]
        try:
            await wait_for(a_decode_is_busy, HANG_GUARD_S, "requests running on a decode")
            name, alive = f"decode{stack.decode_urls.index(dead)}", next(u for u in stack.decode_urls if u != dead)
            killed = time.monotonic()
            await asyncio.to_thread(stack.kill, name)
            runs += [asyncio.create_task(a.run(client, stop)) for a in late]
            detect_s = await wait_for(dead_is_out, HANG_GUARD_S, "smg marking the killed decode unhealthy")
            detected = time.monotonic()
            await wait_for(served_while_out, HANG_GUARD_S, "20 calls served while the killed decode is out")
            await asyncio.to_thread(stack.restart, name)
            restarted = time.monotonic()
            healthy_s = await wait_for(dead_is_back, HANG_GUARD_S, "smg re-admitting the restarted decode")
            back_s = await wait_for(dead_serves_again, HANG_GUARD_S, "a call served by the restarted decode")
            back = time.monotonic()
            await wait_for(each_called_since_back, HANG_GUARD_S, "a call of every session after the recovery")
        finally:
            stop.set()
            await asyncio.gather(*runs)
        finals = await asyncio.gather(*(a.call(client) for a in everyone))  # one more call each, all healthy
    after = await probe.gateway_metrics()

    results = [r for a in everyone for r in a.results]
    failed = [r for r in results if not r.ok]
    assert all(r.ok for r in results if r.ended < killed), [r for r in results if r.ended < killed and not r.ok]
    assert failed, "no call noticed the dead engine"
    for result in failed:
        assert killed <= result.ended and result.started <= back, result
        assert_clear_failure(result, [dead, "no_available_workers"])
    served_while_dead = [r for r in results if r.ok and detected < r.started and r.ended < restarted]
    assert len(served_while_dead) >= 20 and {r.served_by for r in served_while_dead} == {alive}
    assert all(r.ok for r in results if r.started > back)
    assert all(r.ok for r in finals), finals
    # The gateway counted exactly the failures the clients saw, stream errors included.
    assert delta(after, before, CALLS.format("upstream_error")) == len(failed)
    assert delta(after, before, CALLS.format("completed")) == len(results) - len(failed)
    assert delta(after, before, CALLS.format("client_gone")) == 0

    sessions = await probe.check_accounting({a.session for a in everyone})
    for agent in everyone:
        seen = sessions[agent.session]
        # Every call the client made was forwarded and recorded, but a session none of whose calls was
        # served yet is released (`failed`) when such a call fails: its next call starts it anew.
        unserved = next((k for k, r in enumerate(agent.results) if r.ok), len(agent.results))
        assert seen["num_calls"] == len(agent.results) - unserved
        assert seen["last_prompt_tokens"] == agent.results[-1].prompt_tokens
    await probe.end_and_check_empty([a.session for a in everyone])
    kinds = Counter((r.kind, r.status) for r in failed)
    print(f"\n{name} killed: {len(failed)} calls failed {dict(kinds)}; smg marked it unhealthy after {detect_s:.1f} s; "
          f"{len(served_while_dead)} calls served meanwhile; re-admitted {healthy_s:.1f} s after its restart, "
          f"serving {back_s:.1f} s after it")


async def test_the_prefill_engine_killed_under_load_fails_calls_clearly_and_service_resumes(stack: LocalStack,
                                                                                            probe: Probe) -> None:
    agents = [Agent(f"pk-{k}") for k in range(8)]
    stop = asyncio.Event()

    async def each_served() -> bool:  # every session served before the kill
        return all(any(r.ok for r in a.results) for a in agents)

    async def each_failed_while_dead() -> bool:  # every session met the dead prefill
        return all(any(not r.ok and r.started > dead for r in a.results) for a in agents)

    async def served_again() -> bool:
        return any(r.ok and r.started > restarted for a in agents for r in a.results)

    async def each_called_since_back() -> bool:  # every session's call after the recovery has its answer
        return all(any(r.started > back for r in a.results) for a in agents)

    async with client_for(stack) as client:
        before = await probe.gateway_metrics()
        runs = [asyncio.create_task(a.run(client, stop, gap_s=0.2)) for a in agents]
        try:
            await wait_for(each_served, HANG_GUARD_S, "a call of every session served")
            killed = time.monotonic()
            await asyncio.to_thread(stack.kill, "prefill0")
            dead = time.monotonic()  # reaped: a call sent from now on finds no prefill
            await wait_for(each_failed_while_dead, HANG_GUARD_S, "a failed call of every session")
            restarting = time.monotonic()
            await asyncio.to_thread(stack.restart, "prefill0")
            restarted = time.monotonic()
            back_s = await wait_for(served_again, HANG_GUARD_S, "a call served after the prefill's restart")
            back = time.monotonic()
            await wait_for(each_called_since_back, HANG_GUARD_S, "a call of every session after the recovery")
        finally:
            stop.set()
            await asyncio.gather(*runs)
    after = await probe.gateway_metrics()

    results = [r for a in agents for r in a.results]
    failed = [r for r in results if not r.ok]
    assert all(r.ok for r in results if r.ended < killed)
    assert all(not r.ok for r in results if dead < r.started and r.ended < restarting)  # nothing to serve
    assert failed and all(killed <= r.ended and r.started <= back for r in failed)
    for result in failed:
        assert_clear_failure(result, [stack.prefill_urls[0], "no_available_workers"])
    assert delta(after, before, CALLS.format("upstream_error")) == len(failed)
    assert delta(after, before, CALLS.format("completed")) == len(results) - len(failed)
    sessions = await probe.check_accounting({a.session for a in agents})
    assert all(sessions[a.session]["num_calls"] == len(a.results) for a in agents)
    await probe.end_and_check_empty([a.session for a in agents])
    print(f"\nprefill killed: {len(failed)} calls failed {dict(Counter((r.kind, r.status) for r in failed))}; "
          f"served again {back_s:.1f} s after its restart")


# --- 3. a slow engine -------------------------------------------------------------------------------


@pytest.fixture
def slow_stack(tmp_path: Path) -> Iterator[LocalStack]:
    """1 prefill + 1 decode at time scale 0.05 (20x slower than TINY: 0.4 s per decode step), timeout 1 s."""
    spec = StackSpec(tmp_path / "logs", num_prefill=1, num_decode=1, time_scale=0.05, max_total_tokens=50_000,
                     profile=str(tiny_profile_file(tmp_path)), gateway={**GATEWAY, "upstream_timeout_s": 1.0})
    with LocalStack(spec) as running:
        yield running


async def test_a_call_slower_than_the_upstream_timeout_gets_504_and_its_accounting_is_released(
        slow_stack: LocalStack) -> None:
    stack = slow_stack
    agent = Agent("slow-1", task_words=300)  # ~1,000 prompt tokens: ~2 s of prefill here, no byte within 1 s
    async with httpx.AsyncClient(timeout=10) as http, client_for(stack) as client:
        probe = Probe(stack, http)
        before = await probe.gateway_metrics()
        streamed = await agent.call(client, max_tokens=5)
        started = time.monotonic()
        try:  # not streamed: nothing comes back before the whole answer, 10 steps of 0.4 s
            await client.chat.completions.create(model=MODEL, messages=[], extra_body={"messages": agent.messages},
                                                 max_tokens=10, extra_headers={"X-Session-ID": agent.session})
            pytest.fail("the slow call was answered")
        except openai.APIStatusError as exc:
            whole = exc
        whole_s = time.monotonic() - started
        gateway_s = await probe.wait_gateway_calls_done(timeout_s=HANG_GUARD_S)
        engines_s = await probe.wait_engines_idle(timeout_s=HANG_GUARD_S)
        after = await probe.gateway_metrics()

        assert (streamed.kind, streamed.status, streamed.error_type) == ("http", 504, "upstream_timeout"), streamed
        body = whole.body if isinstance(whole.body, dict) else {}
        assert (whole.status_code, body.get("type")) == (504, "upstream_timeout")
        for message in (streamed.message, str(body.get("message"))):
            assert "did not answer in time" in message and stack.router_url in message, message
        # Cut BY the timeout, not at the answer's end: an answer that came would have been served, not a 504 "did
        # not answer in time"; causality gives the lower bound only.
        assert streamed.ended - streamed.started >= 1.0 and whole_s >= 1.0
        assert delta(after, before, CALLS.format("upstream_error")) == 2
        # Neither call was served, so each time the session was released (`failed`): nothing is held.
        assert delta(after, before, "basin_sessions_ended_total{reason=failed}") == 2
        await probe.check_accounting(set())

        agent.messages = [agent.messages[0], {"role": "user", "content": "a short task"}]
        quick = await agent.call(client, max_tokens=3)  # a token every 0.4 s: never 1 s without a byte
        assert quick.ok and quick.completion_tokens == 3, quick
        await probe.check_accounting({agent.session})
        await probe.end_and_check_empty([agent.session])
    print(f"\n504 after {whole_s:.2f} s; gateway released the call in {gateway_s:.2f} s, engines in {engines_s:.2f} s")

"""Drive a live OpenAI-compatible endpoint with replayed sessions; `python -m basin_loadgen.replay_client`.

Replay planned agent sessions against a live OpenAI-compatible server (the Basin gateway, the `smg`
router, an SGLang engine or the emulator) with the official `openai` client, as agents would.

Rules:
- Time comes from an injected `basin_runtime.clock.Clock` (the wall; monotonic by default). Model time
  is a `ScaledClock` over it started with the replay; every wait (arrivals, tool gaps, state samples,
  a call's max wait and timeout, the drain's checks) is on that clock, so a `ManualClock` drives a
  replay in tests; the CLI's `main` takes the clock and the coroutine that runs the replay (`Drive`) too.
- One asyncio task per live session, started at its planned arrival (model time / time scale on the
  wall). Calls are streamed chat completions with usage (`stream_options.include_usage`), max_tokens
  = the recorded completion, headers X-Session-ID (the run id, also sent as `user`) and
  X-Basin-Workload (the benchmark). After an answer the session waits its tool gap / time scale.
  The messages travel in `extra_body` (same JSON; skips the SDK's per-message transform, see _call).
- The client never retries (`max_retries=0`): a retry would hide a shed or an error. A call that
  gets no first token within `max_wait_s` WALL seconds is given up (session "aborted": the socket
  closes, which a gateway reads as the session withdrawing). HTTP 503 with Retry-After, or a body
  of type `session_shed`, ends the session as "shed" with the body's reason. Any other failure ends
  it as "error" with the message.
- A session that ends other than shed is ended at the gateway (POST /basin/sessions/{id}/end,
  best effort: other servers answer 404) so it stops holding budget; `end_sessions=False` skips it.
  It is ended with the session's own end key, kept from the answer that carried it
  (X-Basin-Session-Key, the gateway's first answer of the session), as an agent would: no admin
  token needed. `admin_token` is only a fallback, for a session whose key never arrived.
- Stopping: with `stop_s`, everything still running at that model time is cancelled (the knee
  ramp). Without, the run drains after the last arrival until every session is over or past its
  goodput deadline (`goodput_deadline_s`: arrival + 4 x unloaded time), at most `max_drain_s` model seconds.
  Cancelled sessions stay "unfinished". Ctrl-C cancels every task; the records so far are kept.
- The server is probed first (GET /v1/models): an unreachable URL is a `ReplayError` naming it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai

from basin_loadgen.replay import ConversationBuilder, PlannedSession
from basin_loadgen.replay_summary import CallRecord, SessionRecord, StateSample
from basin_runtime.clock import Clock, Deadline, MonotonicClock, ScaledClock
from basin_runtime.logs import configure_logging, quiet_level
from basin_runtime.policy.deadline import goodput_deadline_s
from basin_runtime.session_keys import SESSION_KEY_HEADER
from basin_sim.workload.pool import load_pool
from basin_sim.workload.scenarios import DEFAULT_GAP_S

log = logging.getLogger(__name__)
HTTP_LOGGERS = ("httpx", "httpx2", "openai")  # the HTTP stacks log every request at INFO; a replay sends thousands

DRAIN_CHECK_S = 1.0  # wall seconds between checks of the drain's end while sessions run


class ReplayError(RuntimeError):
    """The server cannot be replayed against (unreachable, no model); the message names the URL."""


@dataclass(frozen=True)
class ClientSettings:
    """How the replayer talks to the server."""

    base_url: str  # the OpenAI base, e.g. http://127.0.0.1:8080/v1
    api_key: str = "basin-replay"
    model: str | None = None  # None: the first id of GET /v1/models
    time_scale: float = 1.0  # model seconds per wall second
    max_wait_s: float = 600.0  # wall seconds a call may wait for its first token
    request_timeout_s: float = 3600.0  # wall seconds a whole call may take
    end_sessions: bool = True
    admin_token: str | None = None  # ends a session whose end key never arrived (the gateway's operator token)
    sample_s: float = 10.0  # model seconds between state samples
    max_drain_s: float = 3600.0  # model seconds the run may go on after the last arrival
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name in ("time_scale", "max_wait_s", "request_timeout_s", "sample_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")

    @property
    def server_root(self) -> str:
        """The base URL without its trailing /v1 (where the gateway's /basin/ endpoints live)."""
        root = self.base_url.rstrip("/")
        return root[:-3] if root.endswith("/v1") else root


class _SessionStop(Exception):
    """A call ended its session early."""

    def __init__(self, status: str, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.retry_after_s = status, reason, retry_after_s


Observer = Callable[["Replayer"], Coroutine[Any, Any, None]]
Run = Coroutine[Any, Any, list[SessionRecord]]
Drive = Callable[["Replayer", Run], Run]  # runs a replay to its end (a test moves its manual clock meanwhile)


async def run_as_is(replayer: Replayer, run: Run) -> list[SessionRecord]:
    """The replay `run`, awaited (on a real clock, time moves by itself)."""
    return await run


class Replayer:
    """Replays planned sessions; its records and state samples grow while it runs."""

    def __init__(self, settings: ClientSettings, builder: ConversationBuilder,
                 on_session_end: Callable[[SessionRecord], None] | None = None, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or MonotonicClock()  # the wall clock
        self._model = ScaledClock(self.clock, settings.time_scale)  # model time, started by `run`
        self.builder = builder
        self.on_session_end = on_session_end
        self.records: dict[str, SessionRecord] = {}
        self.samples: list[StateSample] = []
        self.model: str | None = settings.model
        self._live: dict[str, SessionRecord] = {}
        self._end_keys: dict[str, str] = {}  # run id -> the end key the gateway gave the session
        self._client: openai.AsyncOpenAI | None = None
        self._http: httpx.AsyncClient | None = None

    def now_s(self) -> float:
        """Model seconds since the run started."""
        if not self._model.is_started:
            raise RuntimeError("the replay has not started")
        return self._model.now()

    async def sleep_until(self, model_s: float) -> None:
        """Sleep until model time `model_s`."""
        delay = model_s - self.now_s()
        if delay > 0:
            await self._model.sleep(delay)

    def state(self) -> StateSample:
        """Sessions arrived and not over, those waiting for call 1's response, calls in flight, working set."""
        live = list(self._live.values())
        waiting = sum(len(r.calls) == 1 and r.calls[0].response_s is None for r in live)
        in_flight = sum(bool(r.calls) and r.calls[-1].end_s is None for r in live)
        return StateSample(self.now_s(), len(live), waiting, in_flight, sum(r.context_tokens for r in live))

    async def run(self, planned: Sequence[PlannedSession], unloaded_s: Mapping[str, float] | None = None, *,
                  stop_s: float | None = None, observers: Sequence[Observer] = ()) -> list[SessionRecord]:
        """Replay `planned` (in arrival order); records in plan order. Observers run beside the replay
        (model clock started) and are awaited before it is torn down."""
        unloaded = unloaded_s or {}
        async with self._open_client() as client, httpx.AsyncClient(timeout=10.0) as http:
            self._client, self._http = client, http
            self.model = await self._probe(client)
            self._model.start()
            tasks: dict[str, asyncio.Task[None]] = {}
            sampler = asyncio.create_task(self._sample_forever())
            watched = [asyncio.create_task(self._drive(planned, unloaded, tasks, stop_s))]
            watched += [asyncio.create_task(observer(self)) for observer in observers]
            try:
                for finished in asyncio.as_completed(watched):
                    await finished  # an observer's error (a failed scrape) stops the run
            finally:
                pending = [*tasks.values(), *watched, sampler]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                self.samples.append(self.state())
        return [self.records[p.run_id] for p in planned if p.run_id in self.records]

    def _open_client(self) -> openai.AsyncOpenAI:
        s = self.settings
        # openai >= 3 builds on httpx2, older versions on httpx: take the Limits class the SDK itself uses.
        limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=s.max_connections,
                                                        max_keepalive_connections=s.max_connections)
        return openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0,
                                  timeout=openai.Timeout(s.request_timeout_s, connect=10.0),
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits))

    async def _probe(self, client: openai.AsyncOpenAI) -> str:
        url = self.settings.base_url
        try:
            page = await client.models.list()
        except openai.APIConnectionError as exc:
            raise ReplayError(f"cannot reach {url}: {exc.__cause__ or exc}") from exc
        except openai.APIStatusError as exc:
            if self.settings.model is not None:
                return self.settings.model
            raise ReplayError(f"{url}/models answered HTTP {exc.status_code}; pass the model name") from exc
        ids = [m.id for m in page.data]
        if self.settings.model is not None:
            return self.settings.model
        if not ids:
            raise ReplayError(f"{url}/models lists no model; pass the model name")
        return ids[0]

    async def _drive(self, planned: Sequence[PlannedSession], unloaded: Mapping[str, float],
                     tasks: dict[str, asyncio.Task[None]], stop_s: float | None) -> None:
        for p in planned:
            if stop_s is not None and p.arrival_s >= stop_s:
                break
            await self.sleep_until(p.arrival_s)
            tasks[p.run_id] = asyncio.create_task(self._session(p, unloaded.get(p.run_id)))
        if stop_s is not None:
            await self.sleep_until(stop_s)
            return
        last = planned[-1].arrival_s if planned else 0.0
        deadlines = {rid: goodput_deadline_s(self.records[rid].arrival_s, t) for rid, t in unloaded.items()
                     if rid in self.records}
        limit = last + self.settings.max_drain_s
        while True:
            pending = [rid for rid, task in tasks.items() if not task.done()]
            now = self.now_s()
            if not pending or now >= limit or all(deadlines.get(rid, math.inf) < now for rid in pending):
                return
            await self._wait_all([tasks[rid] for rid in pending], DRAIN_CHECK_S)

    async def _wait_all(self, tasks: Sequence[asyncio.Task[None]], timeout_s: float) -> None:
        """Until every task is done or `timeout_s` wall seconds have passed on the clock."""
        waits = [asyncio.ensure_future(asyncio.wait(tasks)), asyncio.ensure_future(self.clock.sleep(timeout_s))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _sample_forever(self) -> None:
        while True:
            self.samples.append(self.state())
            await self._model.sleep(self.settings.sample_s)

    async def _session(self, planned: PlannedSession, unloaded_s: float | None) -> None:
        s = planned.session
        record = SessionRecord(planned.run_id, s.session_id, s.benchmark, planned.arrival_s, s.n_calls, unloaded_s)
        self.records[planned.run_id] = record
        self._live[planned.run_id] = record
        conversation = self.builder.conversation(planned)
        messages = conversation.first_call()
        try:
            while True:
                call = CallRecord(conversation.call_index, self.now_s(), conversation.target_prompt_tokens,
                                  conversation.prompt_tokens, conversation.max_tokens)
                record.calls.append(call)
                record.context_tokens = conversation.prompt_tokens
                answer = await self._call(record, call, messages)
                if not conversation.has_next:
                    break
                messages = conversation.next_call(answer)  # built during the tool gap
                ended = self.now_s() if call.end_s is None else call.end_s
                await self.sleep_until(ended + planned.gaps_s[call.index])
            record.status, record.end_s = "finished", call.end_s
        except _SessionStop as stop:
            record.status, record.reason, record.retry_after_s = stop.status, stop.reason, stop.retry_after_s
            record.end_s = self.now_s()
        except Exception as exc:  # a bug of the replayer: counted (status error) and logged loudly, not lost
            log.exception("session %s failed inside the replayer", planned.run_id)
            record.status, record.reason, record.end_s = "error", f"replayer: {type(exc).__name__}: {exc}", self.now_s()
        finally:
            self._live.pop(planned.run_id, None)
        if self.on_session_end is not None:
            self.on_session_end(record)
        if record.status != "shed" and self.settings.end_sessions:
            await self._end_session(record.run_id)
        self._end_keys.pop(record.run_id, None)

    async def _call(self, record: SessionRecord, call: CallRecord, messages: list[dict[str, Any]]) -> str:
        assert self._client is not None and self.model is not None
        s = self.settings
        parts: list[str] = []
        try:
            async with Deadline(self.clock, s.max_wait_s) as scope:
                # The messages go in `extra_body` (which overrides `messages` in the JSON): the SDK walks
                # `messages` through its TypedDict transform on every call, ~1 ms of CPU per message, which
                # for a 100-message conversation costs more than the call.
                raw = await self._client.chat.completions.with_raw_response.create(
                    model=self.model, messages=[], max_tokens=call.max_tokens, stream=True,
                    stream_options={"include_usage": True}, user=record.run_id, extra_body={"messages": messages},
                    extra_headers={"X-Session-ID": record.run_id, "X-Basin-Workload": record.benchmark})
                call.response_s = self.now_s()
                key = raw.headers.get(SESSION_KEY_HEADER)
                if key is not None:
                    self._end_keys[record.run_id] = key
                stream = raw.parse()
                async with stream:
                    async for chunk in stream:
                        if chunk.usage is not None:
                            details = chunk.usage.prompt_tokens_details
                            call.prompt_tokens, call.completion_tokens = (chunk.usage.prompt_tokens,
                                                                          chunk.usage.completion_tokens)
                            call.cached_tokens = None if details is None else details.cached_tokens
                        for choice in chunk.choices:
                            text = choice.delta.content or ""
                            parts.append(text)
                            if call.first_token_s is None and (text or getattr(choice.delta, "reasoning_content", None)
                                                               or choice.finish_reason):
                                call.first_token_s = self.now_s()
                                scope.reschedule(s.request_timeout_s)
        except TimeoutError as exc:
            call.error = "no first token" if call.first_token_s is None else "call timed out"
            if call.first_token_s is None:
                raise _SessionStop("aborted", f"no first token within {s.max_wait_s:g} s") from exc
            raise _SessionStop("error", f"a call took over {s.request_timeout_s:g} s") from exc
        except openai.APIStatusError as exc:
            call.error = f"HTTP {exc.status_code}"
            raise _status_stop(exc) from exc
        except openai.APIError as exc:
            call.error = type(exc).__name__
            cause = f" ({type(exc.__cause__).__name__})" if exc.__cause__ is not None else ""
            raise _SessionStop("error", f"{type(exc).__name__}: {exc}{cause}") from exc
        finally:
            call.end_s = self.now_s()
        if call.first_token_s is None:
            call.first_token_s = call.end_s
        return "".join(parts)

    async def _end_session(self, run_id: str) -> None:
        assert self._http is not None
        key = self._end_keys.get(run_id)
        if key is not None:
            headers = {SESSION_KEY_HEADER: key}
        elif self.settings.admin_token is not None:
            headers = {"Authorization": f"Bearer {self.settings.admin_token}"}
        else:
            headers = {}
        try:
            response = await self._http.post(f"{self.settings.server_root}/basin/sessions/{run_id}/end",
                                             headers=headers)
        except httpx.HTTPError as exc:
            log.debug("ending session %s: %s", run_id, exc)
            return
        if response.status_code == 401:  # it goes on holding budget until the gateway's idle timeout
            log.warning("the gateway refused to end session %s: %s", run_id, response.text[:300])


def _status_stop(exc: openai.APIStatusError) -> _SessionStop:
    """A shed (503 with Retry-After or a session_shed body) or an HTTP error."""
    body = exc.body if isinstance(exc.body, dict) else {}
    retry_after = exc.response.headers.get("retry-after")
    if exc.status_code == 503 and (retry_after is not None or body.get("type") == "session_shed"):
        reason = str(body.get("reason") or body.get("message") or exc.message)
        try:
            seconds = float(retry_after) if retry_after is not None else None
        except ValueError:
            seconds = None
        return _SessionStop("shed", reason, seconds)
    message = body.get("message") if isinstance(body.get("message"), str) else exc.message
    return _SessionStop("error", f"HTTP {exc.status_code}: {message}")


def default_run_tag(seed: int) -> str:
    """A run tag unique to this start (so a warm cache holds nothing of an earlier run with the same seed)."""
    return f"s{seed}-{int(time.time()):x}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m basin_loadgen.replay_client", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"), help="session table")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic corpus")
    parser.add_argument("--rate", type=float, required=True, help="arrivals per model second outside the surge")
    parser.add_argument("--duration-s", type=float, required=True, help="model seconds of arrivals")
    parser.add_argument("--surge", type=float, nargs=3, metavar=("START", "END", "FACTOR"),
                        help="arrivals x FACTOR in [START, END) model seconds")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="model seconds per wall second (match the emulator's; 1 for real engines)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-tag", help="prefix of the session ids (default: seed and start time); reuse it to "
                        "resend exactly the same text")
    parser.add_argument("--max-sessions", type=int, help="stop planning after this many sessions")
    parser.add_argument("--out", type=Path, required=True, help="JSON: settings, summary and per-session records")
    parser.add_argument("--plot", type=Path, help="PNG of the timeline")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default="basin-replay")
    parser.add_argument("--deployment", default="1p3d-h100", help="simulated deployment whose cost model gives each "
                        "session's unloaded time (goodput's reference)")
    parser.add_argument("--cache", choices=("gpu", "host"), default="gpu")
    parser.add_argument("--default-gap-s", type=float, default=DEFAULT_GAP_S, help="tool gap where none was recorded")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="wall seconds a call may wait for its "
                        "first token before the session is given up (aborted)")
    parser.add_argument("--no-end-sessions", dest="end_sessions", action="store_false",
                        help="do not POST /basin/sessions/{id}/end when a session is over")
    parser.add_argument("--admin-token", help="the gateway's admin token, to end a session whose end key never "
                        "arrived (sessions are ended with their own keys)")
    parser.add_argument("--bin-s", type=float, default=60.0, help="timeline bin (model seconds)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="state sample period (model seconds)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, warnings only")
    return parser


def _replay(args: argparse.Namespace, clock: Clock | None = None, drive: Drive = run_as_is) -> int:
    from tqdm import tqdm

    from basin_loadgen.replay import RateSchedule, plan_sessions, unloaded_times
    from basin_loadgen.replay_summary import records_json, summarize, windows_for
    from basin_runtime.tokenizer import get_tokenizer
    from basin_sim import catalog

    pool, workload = load_pool(args.sessions, args.synthetic)
    surge = None if args.surge is None else (args.surge[0], args.surge[1], args.surge[2])
    schedule = RateSchedule.steady(args.rate, args.duration_s, surge)
    tag = args.run_tag or default_run_tag(args.seed)
    planned = plan_sessions(pool, schedule, args.seed, tag, args.default_gap_s, args.max_sessions)
    unloaded = unloaded_times(planned, pool, catalog.load_deployment(args.deployment).build(args.cache))
    settings = ClientSettings(args.base_url, args.api_key, args.model, args.time_scale, args.max_wait_s,
                              end_sessions=args.end_sessions, admin_token=args.admin_token, sample_s=args.sample_s)
    log.info("replaying %d sessions (%s pool, run tag %s) against %s", len(planned), workload, tag, args.base_url)
    bar = tqdm(total=len(planned), unit="session", file=sys.stderr, disable=args.quiet, desc="sessions over")
    replayer = Replayer(settings, ConversationBuilder(pool, get_tokenizer(), tag), lambda _: bar.update(1),
                        clock=clock)
    interrupted = False
    try:
        asyncio.run(drive(replayer, replayer.run(planned, unloaded)))
    except KeyboardInterrupt:
        interrupted = True
        log.warning("interrupted: writing what was recorded so far")
    finally:
        bar.close()
    records = [replayer.records[p.run_id] for p in planned if p.run_id in replayer.records]
    windows = windows_for(args.duration_s, surge)
    if interrupted and replayer.samples:  # judge only the time that was replayed
        stopped_s = replayer.samples[-1].time_s
        windows = [replace(w, end_s=min(w.end_s, stopped_s)) for w in windows if w.start_s < stopped_s]
    summary = summarize(records, replayer.samples, windows, time_scale=args.time_scale, bin_s=args.bin_s)
    summary.update(workload=workload, run_tag=tag, model=replayer.model, interrupted=interrupted)
    document = {"settings": {**asdict(settings), "rate_per_s": args.rate, "duration_s": args.duration_s,
                             "surge": surge, "seed": args.seed, "deployment": args.deployment},
                "summary": summary, "sessions": records_json(records)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document) + "\n")
    if args.plot is not None:
        from basin_loadgen.replay_plots import plot_timeline

        plot_timeline(summary, args.plot, title=f"replay of {len(records)} sessions at {args.base_url}")
    print(_headline(summary))
    return 130 if interrupted else 0


def _headline(summary: dict[str, Any]) -> str:
    lines = [f"goodput {_fmt(summary['goodput_per_hour'])}/h ({summary['goodput_window']} window); statuses "
             + ", ".join(f"{k} {v}" for k, v in summary["status_counts"].items())]
    for name, w in summary["windows"].items():
        lines.append(f"  {name:8s} arrived {w['sessions_arrived']:5d}  goodput {_fmt(w['goodput_per_hour'])}/h  "
                     f"hit rate {_fmt(w['hit_rate'])}  TTFT p50 {_fmt(w['ttft_p50_s'])} s "
                     f"p90 {_fmt(w['ttft_p90_s'])} s")
    lines.append(f"  admission wait p50 {_fmt(summary['admission_wait_p50_s'])} s, "
                 f"p90 {_fmt(summary['admission_wait_p90_s'])} s (model time)")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None,
            body: Callable[[argparse.Namespace], int]) -> int:
    """Parse, set up logging, run `body`; bad input (replay, plan, session table, catalog) exits 2 with one line."""
    from basin_loadgen.replay import ReplayPlanError
    from basin_sim.catalog import CatalogError
    from basin_sim.workload.pool import PoolError

    args = parser.parse_args(argv)
    configure_logging(quiet_level(args.quiet), quiet=HTTP_LOGGERS)
    try:
        return body(args)
    except (ReplayError, ReplayPlanError, PoolError, CatalogError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


def main(argv: list[str] | None = None, *, clock: Clock | None = None, drive: Drive = run_as_is) -> int:
    """Entry point; returns the exit status. The replay runs on `clock` (monotonic by default) through `drive`."""
    return run_cli(_parser(), argv, lambda args: _replay(args, clock, drive))


if __name__ == "__main__":
    sys.exit(main())

"""`RedisBackend`: the admission state shared by gateway replicas through a Redis stream.

Rules:
- Every replica keeps its own copy of the replicated state (`replica.py`: the policy core and session
  ownership). A step is never applied where it is made: it is appended to one Redis stream by one Lua
  script (`append.lua`) that stamps it with Redis's clock (TIME, clamped never to run back) and returns
  every entry after the caller's last applied one, its own included; the replica applies them in order
  and answers the step with its own entry's events. The core is deterministic, so every replica holds
  the same state and N replicas admit exactly what one gateway would.
- Steps are sent in batches, one script call in flight per replica (group commit): a step waits at
  most for the batch before it. `step` waits for its answer; `submit` (a call's observe, a revision)
  does not, so a call is forwarded before its observe is in the shared state (it is there one round
  trip later, in the order it was made).
- A tail (XREAD BLOCK) applies the steps other replicas make, so a session queued here is woken as
  soon as another replica's step admits it. Entries are applied exactly once, in order (`replica.py`).
- Start-up and recovery (`resync`): join the epoch (`init.lua`; a new one when Redis holds none), load
  the latest snapshot of the epoch, replay the stream after it, then let the room `reconcile` its
  sessions. A replica whose policy configuration differs from the epoch's refuses to start
  (`StateConfigError`). A new epoch after a state was lost opens a registration window of one lease:
  replicas register their sessions again (adopt) before any `arrive` is sequenced, and the operator's
  reference budget, if one was set, is set again (the hit rate's moves start over from it). The window is
  kept on this replica's injected clock (`basin_runtime.clock`), from the time left that Redis reports.
- Redis out of reach: `step` raises `StateUnavailableError` at once (a new session gets 503); steps
  made with `submit` are kept, up to `max_buffered_steps` (then dropped and counted), and sent when
  Redis is back in the same epoch; if the epoch is gone (Redis restarted empty) they are dropped
  (counted): the room registers its sessions again with their current sizes instead. A batch whose
  answer was lost is sent again with the same step counters, so a step that did apply is skipped.
- A command that meets a closed connection is sent once more on a new one (`redis_client`): after
  Redis restarts, the pool still holds connections to the old server, and each would otherwise fail
  one command and mark the state down for a moment. Sending again is safe: steps carry counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from basin_runtime.clock import Clock, MonotonicClock
from basin_runtime.policy import Event, Policy, PolicyConfig
from basin_runtime.state.backend import Listener, StateHooks, StateUnavailableError
from basin_runtime.state.replica import Entry, ReplicatedState, StreamGapError
from basin_runtime.state.steps import SEQUENCER_CLOCK, Step, encode_step

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "basin-state-snapshot"
DEFAULT_PREFIX = "{basin}"  # one hash slot: a Redis Cluster keeps every key of the state on one node
PAGE_ENTRIES = 1000


class StateConfigError(ValueError):
    """This replica's policy configuration differs from the one the shared state runs with."""


def _script(name: str) -> str:
    return resources.files("basin_runtime.state").joinpath(name).read_text(encoding="utf-8")


def new_replica_id() -> str:
    """A replica id unique to this process run: host, pid and a random part."""
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def config_json(config: PolicyConfig) -> str:
    """The policy configuration as the canonical JSON every replica of one deployment must share."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Keys:
    """The Redis keys of one shared state."""

    prefix: str = DEFAULT_PREFIX

    @property
    def stream(self) -> str:
        return f"{self.prefix}:stream"

    @property
    def meta(self) -> str:
        return f"{self.prefix}:meta"

    @property
    def snapshot(self) -> str:
        return f"{self.prefix}:snapshot"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def heartbeats(self) -> str:
        return f"{self.prefix}:heartbeats"

    def signals(self, replica: str) -> str:
        return f"{self.prefix}:signals:{replica}"


@dataclass
class _Pending:
    step: Step
    future: asyncio.Future[list[Event]] | None
    counter: int = 0  # given when first sent, kept when sent again
    payload: str = ""


@dataclass
class _Window:
    """The registration window after a new epoch, on this replica's clock."""

    clock: Clock
    until_s: float = 0.0

    def open_for(self, seconds: float) -> None:
        self.until_s = self.clock.now() + seconds

    def is_open(self) -> bool:
        return self.clock.now() < self.until_s

    def left_s(self) -> float:
        return self.until_s - self.clock.now()


class RedisBackend:
    """The shared state: this replica's copy, kept in step through a Redis stream."""

    is_shared = True

    def __init__(self, url: str, config: PolicyConfig, *, replica_id: str | None = None, prefix: str = DEFAULT_PREFIX,
                 lease_s: float = 5.0, step_time: Literal["sequencer", "caller"] = "sequencer",
                 max_buffered_steps: int = 10_000, max_batch_steps: int = 256, tail_block_ms: int = 250,
                 retry_after_s: float = 1.0, hooks: StateHooks | None = None, clock: Clock | None = None) -> None:
        self.url = url
        self.config = config
        self.replica_id = replica_id or new_replica_id()
        self.keys = Keys(prefix)
        self.lease_s = lease_s
        self.step_time = step_time  # whose clock a step runs at: Redis's (TIME) or the caller's `Step.now`
        self.clock = clock or MonotonicClock()  # where the registration window is kept
        self.max_buffered_steps = max_buffered_steps
        self.max_batch_steps = max_batch_steps
        self.tail_block_ms = tail_block_ms
        self.retry_after_s = retry_after_s
        self.hooks = hooks or StateHooks()
        self.replicated = ReplicatedState(Policy(config))
        self.epoch: str | None = None
        self.is_up = False
        self.is_leader = False  # set by the `Coordinator`
        self.down_reason = "the shared state has not been reached yet"
        self.num_dropped_steps = 0
        self._listener: Listener | None = None
        self._on_reset: Callable[[bool], None] | None = None
        self._queue: deque[_Pending] = deque()
        self._waiting: dict[int, asyncio.Future[list[Event]]] = {}
        self._counter = 0
        self._window = _Window(self.clock)
        self._client: aioredis.Redis | None = None
        self._tail_client: aioredis.Redis | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._wakeup = asyncio.Event()
        self._up_event = asyncio.Event()
        self._recovering: asyncio.Task[None] | None = None
        self._scripts: dict[str, Any] = {}
        self._is_closing = False
        self._tail_id: int | None = None  # the tail connection's CLIENT ID (to unblock its read at close)

    # --- the StateBackend seam -----------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        """This replica's copy of the shared policy core."""
        return self.replicated.policy

    @property
    def num_pending(self) -> int:
        """Steps made here and not yet sent (kept while Redis is out of reach)."""
        return len(self._queue)

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client for commands (not the tail's)."""
        assert self._client is not None, "start() the backend first"
        return self._client

    def bind(self, listener: Listener, on_reset: Callable[[bool], None] | None = None) -> None:
        """Hear of every step applied (in order), and of every reload of the state (`True`: the store had lost it)."""
        self._listener = listener
        self._on_reset = on_reset

    async def step(self, step: Step) -> list[Event]:
        """Sequence `step` and return its events; `StateUnavailableError` at once while Redis is out of reach."""
        if not self.is_up:
            raise StateUnavailableError(self.down_reason, self.retry_after_s)
        future: asyncio.Future[list[Event]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(self._sequenced(step), future))
        self._wakeup.set()
        return await future

    def submit(self, step: Step) -> None:
        """Sequence `step` without waiting (kept while Redis is out of reach, up to `max_buffered_steps`)."""
        if len(self._queue) >= self.max_buffered_steps:
            self._drop(1, f"{len(self._queue)} steps are waiting for the shared state")
            return
        self._queue.append(_Pending(self._sequenced(step), None))
        self._wakeup.set()

    def _sequenced(self, step: Step) -> Step:
        return dataclasses.replace(step, now=SEQUENCER_CLOCK) if self.step_time == "sequencer" else step

    # --- life cycle ------------------------------------------------------------------------------

    async def start(self, *, require: bool = False) -> None:
        """Connect and catch up; with `require`, `StateUnavailableError` if Redis cannot be reached now (else the
        backend keeps trying in the background). `StateConfigError` if the deployment runs another configuration."""
        self._client = redis_client(self.url, socket_timeout=max(2.0, self.lease_s),
                                    socket_connect_timeout=max(1.0, self.lease_s / 2))
        self._tail_client = redis_client(self.url, socket_timeout=self.tail_block_ms / 1000 + 5,
                                         socket_connect_timeout=max(1.0, self.lease_s / 2))
        self._scripts = {name: self._client.register_script(_script(f"{name}.lua"))
                         for name in ("append", "init", "beat", "snapshot")}
        try:
            await self._resync()
        except RedisError as exc:
            if require:
                raise StateUnavailableError(f"Redis at {self.url} cannot be reached: {exc}") from exc
            logger.warning("the shared state at %s cannot be reached (%s); new sessions get 503 until it can",
                           self.url, exc)
            self.mark_down(exc)
        self._spawn(self._send_loop())
        self._spawn(self._tail_loop())

    async def aclose(self) -> None:
        """Stop the background work and close the connections. The loops end on their own (a blocked XREAD is
        not cancelled: redis-py 8 can swallow the cancellation of a blocked read), within one tail block."""
        self._is_closing = True
        self._wakeup.set()
        self._up_event.set()
        if self._tail_id is not None and self.is_up:
            with contextlib.suppress(RedisError):  # best effort: else the read ends within its block
                await self.client.client_unblock(self._tail_id)
        tasks = [*self._tasks, *([self._recovering] if self._recovering else [])]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.tail_block_ms / 1000 + 2)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for client in (self._client, self._tail_client):
            if client is not None:
                await client.aclose()

    def script(self, name: str) -> Any:
        """One of the state's Lua scripts, registered on the command client."""
        return self._scripts[name]

    def request_resync(self, why: str) -> None:
        """Reload the state (the epoch changed under this replica, or entries were trimmed past it)."""
        logger.warning("reloading the shared state: %s", why)
        self.mark_down(None, why)

    # --- sending -------------------------------------------------------------------------------

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_loop(self) -> None:
        while not self._is_closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue and self.is_up and not self._is_closing:
                batch = self._take_batch()
                if not batch:  # only arrivals left, held while registration runs
                    await self.clock.sleep(max(0.001, self._window.left_s()))
                    continue
                await self._send(batch)

    def _take_batch(self) -> list[_Pending]:
        """Up to `max_batch_steps` steps in order; while the registration window is open, arrivals (and what
        follows them for the same session) stay behind."""
        batch: list[_Pending] = []
        if not self._window.is_open():
            while self._queue and len(batch) < self.max_batch_steps:
                batch.append(self._queue.popleft())
        else:
            held: deque[_Pending] = deque()
            blocked: set[str | None] = set()
            while self._queue and len(batch) < self.max_batch_steps:
                pending = self._queue.popleft()
                if pending.step.kind == "arrive" or pending.step.session_id in blocked:
                    blocked.add(pending.step.session_id)
                    held.append(pending)
                else:
                    batch.append(pending)
            self._queue.extendleft(reversed(held))
        for pending in batch:
            if not pending.counter:
                self._counter += 1
                pending.counter = self._counter
                pending.payload = encode_step(pending.step, pending.counter)
            if pending.future is not None:
                self._waiting[pending.counter] = pending.future
        return batch

    async def _send(self, batch: list[_Pending]) -> None:
        has_arrive = any(p.step.kind == "arrive" for p in batch)
        args = [self.epoch or "", self.replicated.entry_id, self.replica_id, "1" if has_arrive else "0"]
        started = self.clock.now()
        try:
            reply = await self.script("append")(keys=[self.keys.stream, self.keys.meta],
                                                args=[*args, *(p.payload for p in batch)])
        except ResponseError:
            raise  # a bug in the script or its arguments: not an outage
        except RedisError as exc:
            self.mark_down(exc)  # first: the steps failed below answer with this outage's reason
            self._requeue(batch)
            return
        self.hooks.on_step_latency(self.clock.now() - started)
        if not self.is_up:  # a reload began meanwhile: it replays these entries; steps sent again are skipped
            self._requeue(batch)
            return
        status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if status == "ok":
            try:
                self._ingest(reply[1])
            except StreamGapError as exc:
                self.request_resync(str(exc))
            # a step missing from the answer (the state was reloaded meanwhile) cannot be answered
            self._fail([p for p in batch if p.counter in self._waiting], "the shared state was reloaded; retry")
        elif status == "registering":
            self._window.open_for(int(reply[1]) / 1e6)
            self._requeue(batch)
        else:  # the epoch is gone (Redis restarted empty) or changed: what was made for the old one is void
            self._fail(batch, "the shared state was reset; retry")
            unanswered = sum(p.future is None for p in batch)
            if unanswered:
                self._drop(unanswered, "they were made for a shared state that is gone")
            self.request_resync(f"the epoch changed under this replica ({status})")

    def _requeue(self, batch: list[_Pending]) -> None:
        """Put a batch back in front (same counters), but fail the steps someone waits for: they answer 503."""
        self._fail([p for p in batch if p.future is not None], self.down_reason)
        self._queue.extendleft(reversed([p for p in batch if p.future is None]))

    def _fail(self, batch: list[_Pending], reason: str) -> None:
        for pending in batch:
            self._waiting.pop(pending.counter, None)
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(StateUnavailableError(reason, self.retry_after_s))

    def _drop(self, count: int, why: str) -> None:
        self.num_dropped_steps += count
        self.hooks.on_dropped(count)
        logger.warning("%d step(s) for the shared state dropped: %s", count, why)

    # --- applying ------------------------------------------------------------------------------

    def _ingest(self, raw: list[Any], *, quiet: bool = False) -> None:
        """Apply stream entries in order (each once); `quiet` (a reload) tells no listener."""
        for entry_id, raw_fields in raw:
            fields = raw_fields if isinstance(raw_fields, dict) else dict(zip(raw_fields[::2], raw_fields[1::2],
                                                                             strict=True))  # a script's answer
            n = int(fields[b"n"])
            if n <= self.replicated.n:
                continue
            entry = Entry(entry_id.decode(), n, int(fields[b"t"]), fields[b"r"].decode(), fields[b"s"].decode())
            applied = self.replicated.apply(entry)  # StreamGapError: the caller reloads
            if quiet:
                continue
            if entry.replica != self.replica_id:  # how stale this copy is: the wake-up delay across replicas
                self.hooks.on_apply_lag(max(0.0, self.clock.wall() - entry.clock_us / 1e6))
            if self._listener is not None:
                try:
                    self._listener(applied)
                except Exception:  # the state moved on; one bad translation must not stop the replica
                    logger.exception("the waiting room failed on entry %s (%s)", entry.entry_id, applied.step.kind)
            if applied.replica == self.replica_id and not applied.is_duplicate:
                self._answer(applied.counter, applied.events, applied.error, applied.step)

    def _answer(self, counter: int, events: tuple[Event, ...], error: Exception | None, step: Step) -> None:
        future = self._waiting.pop(counter, None)
        if future is not None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(list(events))
        elif error is not None:
            self.hooks.on_error("step_refused")
            logger.info("step %s of session %s refused by the policy: %s", step.kind, step.session_id, error)

    async def _tail_loop(self) -> None:
        while not self._is_closing:
            await self._up_event.wait()
            if self._is_closing:
                return
            assert self._tail_client is not None
            try:
                if self._tail_id is None:
                    self._tail_id = int(await self._tail_client.client_id())
                reply = await self._tail_client.xread({self.keys.stream: self.replicated.entry_id}, count=PAGE_ENTRIES,
                                                      block=self.tail_block_ms)
            except RedisError as exc:  # (redis-py may turn a cancelled read into one)
                if self._is_closing:
                    return
                self._tail_id = None  # a new connection next time
                self.mark_down(exc)
                continue
            if not self.is_up:
                continue
            try:
                for _stream, entries in cast(list[Any], reply or []):
                    self._ingest(entries)
            except StreamGapError as exc:
                self.request_resync(str(exc))

    # --- down, resync, up ------------------------------------------------------------------------

    def mark_down(self, exc: Exception | None, why: str | None = None) -> None:
        """Redis is out of reach (`exc`) or the state must be reloaded (`why`): fail waiting steps, keep submitted
        ones, and recover in the background."""
        if exc is not None:
            self.hooks.on_error(type(exc).__name__)
            why = f"the shared state (Redis at {self.url}) cannot be reached: {exc}"
        if self._is_closing:
            return
        was_up = self.is_up
        self.is_up = False
        self._up_event.clear()
        self.is_leader = False
        self.down_reason = why or self.down_reason
        self._fail([p for p in self._queue if p.future is not None], self.down_reason)
        self._queue = deque(p for p in self._queue if p.future is None)
        if was_up:
            logger.error("shared state down: %s", self.down_reason)
            self.hooks.on_up(False)
        if self._recovering is None or self._recovering.done():
            self._recovering = asyncio.create_task(self._recover())

    async def _recover(self) -> None:
        delay_s = 0.05
        while not self._is_closing:
            try:
                await self._resync()
                return
            except RedisError as exc:
                self.down_reason = f"the shared state (Redis at {self.url}) cannot be reached: {exc}"
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 1.0)
            except StateConfigError as exc:
                logger.error("%s", exc)
                self.down_reason = str(exc)
                await asyncio.sleep(self.lease_s)

    async def _resync(self) -> None:
        """Join the epoch, load its latest snapshot, replay the stream after it, and come up."""
        knew_sessions = bool(self.replicated.policy.snapshot().live or self.replicated.owners)
        window_us = int(self.lease_s * 1e6) if knew_sessions else 0
        ours = config_json(self.config)
        epoch, theirs, until_us, now_us, _opened = (
            v.decode() if isinstance(v, bytes) else str(v) for v in await self.script("init")(
                keys=[self.keys.meta, self.keys.stream, self.keys.snapshot], args=[uuid.uuid4().hex, window_us, ours]))
        if theirs != ours:
            raise StateConfigError(_config_difference(ours, theirs))
        self._window.open_for(max(0, int(until_us) - int(now_us)) / 1e6)
        is_lost = self.epoch is not None and epoch != self.epoch
        reference_tokens = self.replicated.policy.snapshot().reference_budget_tokens
        if epoch != self.epoch:
            if self._queue:
                self._drop(len(self._queue), "they were made for a shared state that is gone")
                self._queue.clear()
            self.epoch = epoch
            self.replicated = await self._load_snapshot()
        try:
            await self._catch_up()
        except StreamGapError:
            self.replicated = await self._load_snapshot()
            await self._catch_up()
        if is_lost and self.policy.snapshot().reference_budget_tokens != reference_tokens:
            # an operator's budget (PUT /basin/budget) was lost with the store: every replica that knew it says it
            self.submit(Step("set_reference_budget", None, (reference_tokens,), None))
        if self._on_reset is not None:
            self._on_reset(is_lost)
        self.is_up = True
        self._up_event.set()
        self._wakeup.set()
        self.hooks.on_up(True)
        logger.info("shared state up: epoch %s, entry %d, %d live and %d queued sessions", epoch, self.replicated.n,
                    len(self.policy.snapshot().live), len(self.policy.snapshot().queued))

    async def _load_snapshot(self) -> ReplicatedState:
        raw = await self.client.get(self.keys.snapshot)
        if raw is None:
            return ReplicatedState(Policy(self.config))
        data = json.loads(raw)
        if data.get("format") != SNAPSHOT_FORMAT or data.get("epoch") != self.epoch:
            return ReplicatedState(Policy(self.config))
        return ReplicatedState.from_state(data["state"])

    async def _catch_up(self) -> None:
        while True:
            page = await self.client.xrange(self.keys.stream, min=f"({self.replicated.entry_id}", max="+",
                                            count=PAGE_ENTRIES)
            if not page:
                return
            self._ingest(page, quiet=True)

    def snapshot_json(self) -> str:
        """This replica's state as the snapshot the leader keeps."""
        return json.dumps({"format": SNAPSHOT_FORMAT, "epoch": self.epoch, "state": self.replicated.to_state()},
                          separators=(",", ":"))


def check_config(url: str, config: PolicyConfig, prefix: str = DEFAULT_PREFIX) -> bool:
    """Before serving: `StateConfigError` if the shared state runs another policy configuration; False if Redis
    cannot be reached now (the gateway then starts and keeps trying), True if it matches or none is set yet."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        theirs = client.hget(Keys(prefix).meta, "config")
    except RedisError as exc:
        logger.warning("the shared state at %s cannot be reached at start-up (%s)", url, exc)
        return False
    finally:
        client.close()
    ours = config_json(config)
    if theirs is not None and _text(theirs) != ours:
        raise StateConfigError(_config_difference(ours, _text(theirs)))
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _config_difference(ours: str, theirs: str) -> str:
    mine, other = json.loads(ours), json.loads(theirs or "{}")  # (both canonical JSON text)
    fields = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
    shown = ", ".join(f"{k}: here {mine.get(k)!r}, shared {other.get(k)!r}" for k in fields)
    return (f"this replica's policy configuration differs from the one the shared state runs with ({shown}); "
            "every replica must run the same one: fix this one's options, or start the deployment on a fresh "
            "state (another Redis database)")


def redis_client(url: str, *, socket_timeout: float, socket_connect_timeout: float) -> aioredis.Redis:
    """A client whose command, meeting a closed connection, is sent once more on a new one (see the rules)."""
    return aioredis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_connect_timeout,
                                   retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError])

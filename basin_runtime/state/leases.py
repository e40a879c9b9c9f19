"""`Coordinator`: heartbeats, the leader lease, and the leader's periodic work.

Rules:
- Every replica beats every `interval_s` (at most an eighth of its lease): one script (`beat.lua`) stamps
  its heartbeat with Redis's clock in one hash, takes or renews the leader lease, and returns every
  heartbeat and the epoch; its signal report (`signals.py`) is written beside it. A replica whose last
  heartbeat is older than `lease_s` is dead. The replica also checks that the shared state's epoch is
  still its own (else it reloads: Redis restarted or was emptied).
- One replica at a time holds the leader lease (SET NX PX `lease_s`, renewed by its holder). Only the
  leader ticks the shared policy (budget moves, admissions on time, shedding; the waiting room asks
  `backend.is_leader`), with the deployment's hit rate and first-token latency combined from every live
  replica's report; and only the leader reaps and keeps snapshots.
- Reaping: the leader sends one `reap` step naming the dead (`replica.py`): their live sessions'
  reservations return to the budget at once and the sessions are kept as orphans for
  `orphan_window_s`, which any replica adopts on their next call; queued ones keep their place. A live
  session held by nobody (admitted after its replica died) is reaped the same way, and orphans past
  the window are forgotten. Heartbeats carry Redis's time, so any leader, even one that took over
  from a dead leader a moment ago, sees how long a replica has been silent: reservations are back
  within the lease plus two beats of a death. A replica holding sessions without any heartbeat (the
  hash was lost with an emptied Redis) is only reaped after the leader has led for a lease in that
  epoch (live replicas beat within it).
- Snapshots: every `snapshot_interval_s`, if the state moved, the leader keeps its copy of the state
  (`snapshot.lua`) and trims the stream before it; a replica (re)starting loads it and replays the rest.
- A graceful shutdown removes the replica's heartbeat and gives up the leader lease at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from basin_runtime.state.backend import StateUnavailableError
from basin_runtime.state.redis_backend import RedisBackend
from basin_runtime.state.signals import SignalReport, combine
from basin_runtime.state.steps import Step

logger = logging.getLogger(__name__)


class Coordinator:
    """Beats this replica's heartbeat, competes for the leader lease, and leads when it holds it."""

    def __init__(self, backend: RedisBackend, report: Callable[[], SignalReport], *, orphan_window_s: float,
                 tick_interval_s: float = 1.0, min_prompt_tokens: int = 1000, min_calls: int = 5,
                 snapshot_interval_s: float = 10.0) -> None:
        self.backend = backend
        self.report = report
        self.orphan_window_s = orphan_window_s
        self.interval_s = min(backend.lease_s / 8, tick_interval_s, 0.25)
        self.min_prompt_tokens = min_prompt_tokens
        self.min_calls = min_calls
        self.snapshot_interval_s = snapshot_interval_s
        self.hit_rate: float | None = None  # the deployment's, as the leader last combined it
        self.ttft_s: float | None = None
        self.replicas_alive: tuple[str, ...] = ()
        self._last_snapshot_s = time.monotonic()
        self._snapshot_n = 0
        self._is_closing = False
        self._task: asyncio.Task[None] | None = None
        self._leading_since: tuple[str | None, float] | None = None  # (epoch, when) this replica began to lead

    def start(self) -> None:
        """Beat in the background until `stop`."""
        self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        """Beat every `interval_s` until stopped; an unreachable Redis marks the backend down."""
        while not self._is_closing:
            try:
                await self.beat()
            except RedisError as exc:
                self.backend.mark_down(exc)
            except StateUnavailableError:
                pass  # went down mid-beat: the backend is recovering
            except Exception:  # a beat must outlive one bad turn; the traceback goes to the log
                logger.exception("shared-state heartbeat failed")
            await asyncio.sleep(self.interval_s)

    async def beat(self) -> None:
        """Stamp the heartbeat, write the report, check the epoch, take or renew the leader lease, lead if held."""
        b = self.backend
        if not b.is_up:
            b.is_leader = False
            return
        me, keys = b.replica_id, b.keys
        lease_ms = max(1, int(b.lease_s * 1000))
        await b.client.set(keys.signals(me), self.report().to_json(), px=lease_ms)
        epoch, now_us, leads, flat = await b.script("beat")(keys=[keys.heartbeats, keys.meta, keys.leader],
                                                            args=[me, lease_ms])
        if _text(epoch) != b.epoch:
            b.request_resync("the shared state's epoch changed (Redis restarted or was emptied)")
            return
        b.is_leader = bool(leads)
        if not b.is_leader:
            self._leading_since = None
            return
        if self._leading_since is None or self._leading_since[0] != b.epoch:
            self._leading_since = (b.epoch, time.monotonic())
        beats = {_text(flat[k]): int(flat[k + 1]) for k in range(0, len(flat), 2)}
        await self._lead(int(now_us), beats, has_led_a_lease=time.monotonic() - self._leading_since[1] >= b.lease_s)

    async def stop(self) -> None:
        """A graceful exit: stop beating, remove the heartbeat and give up the leader lease at once."""
        self._is_closing = True
        if self._task is not None:
            await self._task  # ends within one interval (no Redis read is cancelled: see `RedisBackend.aclose`)
        b = self.backend
        b.is_leader = False
        if not b.is_up:
            return
        try:
            pipe = b.client.pipeline(transaction=False)
            pipe.hdel(b.keys.heartbeats, b.replica_id)
            pipe.delete(b.keys.signals(b.replica_id))
            await pipe.execute()
            if (await b.client.get(b.keys.leader)) == b.replica_id.encode():
                await b.client.delete(b.keys.leader)
        except RedisError as exc:
            logger.warning("could not give up the leases at shutdown (%s); they lapse in %.1f s", exc, b.lease_s)

    async def _lead(self, now_us: int, beats: dict[str, int], has_led_a_lease: bool) -> None:
        b = self.backend
        lease_us = int(b.lease_s * 1e6)
        alive = {r for r, at in beats.items() if now_us - at <= lease_us} | {b.replica_id}
        silent = {r for r, at in beats.items() if now_us - at > lease_us}
        unheard = b.replicated.replicas() - set(beats) - {b.replica_id}  # holding sessions, never beat this epoch
        dead = sorted(silent | (unheard if has_led_a_lease else set()))
        self.replicas_alive = tuple(sorted(alive))
        ids = sorted(alive)
        reports = await b.client.mget([b.keys.signals(r) for r in ids])
        self.hit_rate, self.ttft_s = combine(_reports(ids, reports), self.min_prompt_tokens, self.min_calls)
        if dead or self._has_ownerless_live() or self._has_expired_orphans():
            await b.step(Step("reap", None, (dead, self.orphan_window_s)))
            if dead:
                logger.warning("replica(s) %s missed their lease: their sessions were let go", ", ".join(dead))
                await b.client.hdel(b.keys.heartbeats, *dead)
        if time.monotonic() - self._last_snapshot_s >= self.snapshot_interval_s:
            await self.keep_snapshot()

    async def keep_snapshot(self) -> bool:
        """Keep this replica's copy of the state as the snapshot and trim the stream before it; True if kept."""
        b = self.backend
        self._last_snapshot_s = time.monotonic()
        state = b.replicated
        if state.n <= self._snapshot_n:
            return False
        kept = await b.script("snapshot")(keys=[b.keys.meta, b.keys.snapshot, b.keys.stream],
                                          args=[b.epoch or "", b.snapshot_json(), state.entry_id, state.n])
        self._snapshot_n = state.n
        return bool(kept)

    def _has_ownerless_live(self) -> bool:
        state = self.backend.replicated
        return any(state.owner_of(sid) is None for sid in state.policy.live_ids())

    def _has_expired_orphans(self) -> bool:
        state = self.backend.replicated
        now = state.policy.now_s
        return now is not None and any(now - o.since_s > self.orphan_window_s for o in state.orphans.values())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _reports(ids: list[str], raw: list[bytes | str | None]) -> list[SignalReport]:
    reports = []
    for replica, text in zip(ids, raw, strict=True):
        if text is None:
            continue
        try:
            reports.append(SignalReport.from_json(text))
        except ValueError as exc:
            logger.warning("replica %s's signal report is unreadable (%s); left out", replica, exc)
    return reports

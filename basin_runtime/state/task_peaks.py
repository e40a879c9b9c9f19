"""`RedisTaskPeaks`: the memory of finished tasks shared by gateway replicas through the state's Redis.

Rules:
- Keys, under the state's prefix (one hash slot, as the state's own keys): `<prefix>:task-memory:<fingerprint>`,
  a list of the task's newest MAX_PEAKS_PER_TASK finished sessions (JSON: session id, peak tokens, wall end
  time), and `<prefix>:task-memory`, a sorted set of fingerprints scored by their last record; past
  MAX_TASKS fingerprints the least recently recorded are deleted with their lists (the bounds of
  `basin_runtime.task_memory.TaskMemory`). One Lua script makes a record, its trims and the task bound
  atomic.
- `record` never waits: the script runs in a task of its own (kept until done; `flush` and `aclose` wait for
  them), each after the one recorded before it, so a replica's records reach Redis in the order made.
  `peaks` reads the task's list and keeps the records that ended before `now` (wall seconds, the clock
  every replica shares).
- A Redis error is logged and gives None (a lookup: the caller tells the prediction alone) or drops the
  record, calling its `on_error`: the memory is a hint, never a reason to hold or fail a call. A malformed
  list item is skipped.
- Imported only with `--state` (redis).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from basin_runtime.state.redis_backend import DEFAULT_PREFIX
from basin_runtime.task_memory import MAX_PEAKS_PER_TASK, MAX_TASKS

logger = logging.getLogger(__name__)

_RECORD = """
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[2]), -1)
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if over > 0 then
  local old = redis.call('ZRANGE', KEYS[2], 0, over - 1)
  for _, fingerprint in ipairs(old) do redis.call('DEL', ARGV[6] .. fingerprint) end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, over - 1)
end
return over
"""


class RedisTaskPeaks:
    """The finished peaks in Redis, shared by every replica on the same prefix (see the rules)."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = DEFAULT_PREFIX,
                 max_peaks_per_task: int = MAX_PEAKS_PER_TASK, max_tasks: int = MAX_TASKS) -> None:
        self.client = client
        self.tasks_key = f"{prefix}:task-memory"
        self.max_peaks_per_task = max_peaks_per_task
        self.max_tasks = max_tasks
        self._script = client.register_script(_RECORD)
        self._sending: set[asyncio.Task[None]] = set()
        self._last: asyncio.Task[None] | None = None  # the record sent last: the next one waits for it

    def key(self, fingerprint: str) -> str:
        """The list of one task's finished sessions."""
        return f"{self.tasks_key}:{fingerprint}"

    async def peaks(self, fingerprint: str | None, now: float) -> list[float] | None:
        """The task's peaks that ended before `now` (None if Redis cannot answer)."""
        if fingerprint is None:
            return []
        try:
            items = await self.client.lrange(self.key(fingerprint), 0, -1)
        except RedisError as exc:
            logger.warning("task memory: reading task %s from Redis failed: %s", fingerprint, exc)
            return None
        return [peak for peak, ended in (_parsed(item) for item in items)
                if peak is not None and ended is not None and ended < now]

    def record(self, fingerprint: str, session_id: str, peak_tokens: float, ended_s: float,
               on_error: Callable[[], None]) -> None:
        """Send a finished session's record without waiting (`on_error` called if it fails); records are sent one
        after another, in the order they were made."""
        task = asyncio.get_running_loop().create_task(self._after(self._last, fingerprint, session_id, peak_tokens,
                                                                  ended_s, on_error))
        self._last = task
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _after(self, previous: asyncio.Task[None] | None, fingerprint: str, session_id: str,
                     peak_tokens: float, ended_s: float, on_error: Callable[[], None]) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
        await self._record(fingerprint, session_id, peak_tokens, ended_s, on_error)

    async def _record(self, fingerprint: str, session_id: str, peak_tokens: float, ended_s: float,
                      on_error: Callable[[], None]) -> None:
        item = json.dumps({"session_id": session_id, "peak_tokens": peak_tokens, "ended_s": ended_s})
        try:
            await self._script(keys=[self.key(fingerprint), self.tasks_key],
                               args=[item, self.max_peaks_per_task, ended_s, fingerprint, self.max_tasks,
                                     f"{self.tasks_key}:"])
        except RedisError as exc:
            logger.warning("task memory: recording session %r in Redis failed: %s", session_id, exc)
            on_error()

    async def flush(self) -> None:
        """Wait for the records being sent."""
        if self._sending:
            await asyncio.wait(set(self._sending))

    async def aclose(self) -> None:
        """Wait for the records being sent, then close the client."""
        await self.flush()
        await self.client.aclose()


def _parsed(item: Any) -> tuple[float | None, float | None]:
    """(peak tokens, wall end time) of a list item; (None, None) for one that is not a record."""
    try:
        record = json.loads(item)
        peak, ended = float(record["peak_tokens"]), float(record["ended_s"])
    except (ValueError, TypeError, KeyError):
        return None, None
    if not (math.isfinite(peak) and peak >= 1 and math.isfinite(ended)):
        return None, None
    return peak, ended

"""A `Policy` look-alike whose every step goes through the Redis backend, for the policy suites.

`RedisPolicy` turns each step (`arrive`, `adopt`, `observe`, `revise`, `finish`, `tick`,
`set_reference_budget`) into a `Step` sequenced by a real Redis (`RedisBackend` with the caller's clock,
so the suites' scripted `now` is kept) and returns that step's events, or raises its `PolicyError`, as
this replica's copy of the state applied it. Questions (`snapshot`, `priority_of`, `has_capacity`, ...)
read that copy. The backend runs on an event loop of its own in a thread (`LoopThread`), so the
synchronous suites drive it unchanged.

`check_replicas_agree` then starts another replica on the same stream and asserts it holds exactly the
same state (and that the state survives `to_state` / `from_state`): what makes N gateways admit what one
would.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from basin_runtime.policy import Event, Policy, PolicyConfig
from basin_runtime.state.redis_backend import RedisBackend
from basin_runtime.state.replica import ReplicatedState
from basin_runtime.state.steps import Step

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; `run` blocks on a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class RedisPolicy:
    """Steps through Redis, questions to this replica's copy of the shared policy."""

    def __init__(self, config: PolicyConfig, url: str, loop: LoopThread) -> None:
        self.url = url
        self.prefix = f"test-{uuid.uuid4().hex[:12]}"
        self._loop = loop
        self.backend = loop.run(_started(RedisBackend(url, config, replica_id="r1", prefix=self.prefix,
                                                      step_time="caller", tail_block_ms=50)))

    # --- steps, through Redis ----------------------------------------------------------------

    def arrive(self, session_id: str, now: float, predicted_peak_tokens: float, context_tokens: int,
               reservation_multiplier: float = 1.0) -> list[Event]:
        return self._step("arrive", session_id, (predicted_peak_tokens, context_tokens, reservation_multiplier), now)

    def adopt(self, session_id: str, now: float, predicted_peak_tokens: float, context_tokens: int,
              reservation_multiplier: float = 1.0) -> list[Event]:
        return self._step("adopt", session_id, (predicted_peak_tokens, context_tokens, reservation_multiplier), now)

    def observe(self, session_id: str, now: float, context_tokens: int) -> list[Event]:
        return self._step("observe", session_id, (context_tokens,), now)

    def revise(self, session_id: str, now: float, predicted_peak_tokens: float,
               reservation_multiplier: float = 1.0) -> list[Event]:
        return self._step("revise", session_id, (predicted_peak_tokens, reservation_multiplier), now)

    def finish(self, session_id: str, now: float) -> list[Event]:
        return self._step("finish", session_id, (), now)

    def tick(self, now: float, hit_rate: float | None = None, ttft_s: float | None = None) -> list[Event]:
        return self._step("tick", None, (hit_rate, ttft_s), now)

    def set_reference_budget(self, budget_tokens: int, now: float | None = None) -> list[Event]:
        return self._step("set_reference_budget", None, (budget_tokens,), now)

    def _step(self, kind: Any, session_id: str | None, args: tuple[Any, ...], now: Any) -> list[Event]:
        return self._loop.run(self.backend.step(Step(kind, session_id, args, now)))

    # --- questions, to the copy ----------------------------------------------------------------

    @property
    def copy(self) -> Policy:
        """This replica's copy of the shared policy."""
        return self.backend.policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend.policy, name)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickled, it is its policy copy (the suites compare pickles to prove an illegal step changed nothing,
        and unpickle a twin to try steps on: an in-process policy in the same state)."""
        return pickle.loads, (pickle.dumps(self.backend.policy),)

    # --- replicas ------------------------------------------------------------------------------

    def check_replicas_agree(self) -> None:
        """Another replica, started now on the same stream (and snapshot), holds exactly this state."""
        other = self._loop.run(_started(RedisBackend(self.url, self.backend.config, replica_id="r2",
                                                     prefix=self.prefix, step_time="caller", tail_block_ms=50)))
        try:
            mine = self.backend.replicated.to_state()
            assert other.replicated.to_state() == mine
            assert ReplicatedState.from_state(mine).to_state() == mine
            assert pickle.dumps(Policy.from_state(mine["policy"]).snapshot()) == pickle.dumps(self.copy.snapshot())
        finally:
            self._loop.run(other.aclose())

    def keep_snapshot(self) -> None:
        """Keep this replica's state as the snapshot and trim the stream before it (what the leader does)."""
        backend = self.backend
        state = backend.replicated
        self._loop.run(backend.script("snapshot")(keys=[backend.keys.meta, backend.keys.snapshot, backend.keys.stream],
                                                  args=[backend.epoch, backend.snapshot_json(), state.entry_id,
                                                        state.n]))

    def close(self) -> None:
        """Stop the backend and delete its keys."""
        async def closing() -> None:
            keys = [k async for k in self.backend.client.scan_iter(match=f"{self.prefix}:*")]
            if keys:
                await self.backend.client.delete(*keys)
            await self.backend.aclose()

        self._loop.run(closing())


async def _started(backend: RedisBackend) -> RedisBackend:
    await backend.start(require=True)
    return backend


"""Hypothesis state machines for the policy core and the lending ledger.

`PolicyMachine` drives a `Policy` with random arrivals (with reservation multipliers), observations,
revisions, finishes, withdrawals, ticks, operator budget changes and illegal steps, next to a plain
model (two dicts), and checks:
- while engaged, an admission never takes the reservations over the budget, except a lone head; nor does a
  call that outgrows its session's reservation (re-reserved at its context + the predicted growth, held in
  the queue by its priority when that does not fit), except a session alone;
- admissions follow priority order (the model's queue minimum, every time);
- every arrival ends admitted-then-finished, withdrawn, or shed with a reason: never lost;
- working set, reservations, queue order and engagement (an arrival's own context counted) match the model
  after every step;
- budget moves are single bounded steps (up to the completion ceiling when one is set; from above the knee
  bound a fall off the plateau drops straight to it), at most one per interval; sheds happen exactly when due;
- the state survives `to_state` / `from_state` after every step, and a policy restored from it (a rule)
  goes on exactly as the model expects.
The same machine runs with the policy shared through a real Redis (`RedisPolicyMachine`: every step
sequenced by the Redis stream, snapshots kept and the stream trimmed as the leader would), where another
replica started on the same stream must hold exactly the same state.
`LedgerMachine` checks the lending ledger against a list-based model: the cap per instance, oldest
first eviction and reclaim, never negative, one copy per session, write-back plans.
"""

from __future__ import annotations

import json
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from basin_runtime.policy import (
    Admitted,
    BudgetMoved,
    Event,
    LendingLedger,
    LentEntry,
    Policy,
    PolicyConfig,
    PolicyError,
    Requeued,
    Shed,
    WriteBackPlan,
)
from tests.redis_server import RedisServer
from tests.runtime.redis_policy import LoopThread, RedisPolicy

MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None, database=None)


@dataclass
class ModelSession:
    session_id: str
    seq: int
    arrival_s: float
    peak_tokens: float
    priority: float
    context_tokens: int
    multiplier: float = 1.0
    first_context_tokens: int = 0
    regrown_tokens: int = 0  # re-reserved when a call outgrew its reservation
    queued_s: float = 0.0  # when it last entered the queue
    has_run: bool = False

    @property
    def growth_tokens(self) -> int:
        return max(0, math.ceil(self.peak_tokens * self.multiplier) - self.first_context_tokens)

    @property
    def key(self) -> tuple[float, int]:
        return (self.priority, self.seq)


class PolicyMachine(RuleBasedStateMachine):
    """A `Policy` next to a two-dict model of who is live and who is queued."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: Policy | None = None

    @initialize(
        mode=st.sampled_from(["basin", "prototype"]),
        always_engaged=st.booleans(),
        is_shedding=st.booleans(),
        budget_tokens=st.integers(200, 2000),
        reservation_ratio=st.sampled_from([1.0, 1.0, 1.5, 3.2]),
        latency_gate_s=st.sampled_from([None, None, 1.0]),
        can_outgrow=st.sampled_from([False, False, True]),
        ceiling_share=st.sampled_from([None, None, 0.9, 1.6]),
    )
    def setup(self, mode: str, always_engaged: bool, is_shedding: bool, budget_tokens: int,
              reservation_ratio: float, latency_gate_s: float | None, can_outgrow: bool = False,
              ceiling_share: float | None = None) -> None:
        self.config = PolicyConfig(
            budget_ceiling_tokens=None if ceiling_share is None else round(ceiling_share * budget_tokens),
            can_outgrow_reservation=can_outgrow,
            budget_tokens=budget_tokens,
            always_engaged=always_engaged,
            reservation_ratio=reservation_ratio,
            latency_gate_s=latency_gate_s,
            mode=mode,  # type: ignore[arg-type]
            budget_move_interval_s=5.0,
            peak_completion_rate_per_s=0.05 if is_shedding else None,
            shed_wait_s=20.0,
            arrival_window_s=100.0,
            recovery=False,  # the model below is the core without recovery (tests/runtime/test_policy_recovery.py)
        )
        self.policy = self.new_policy(self.config)
        self.now = 0.0
        self.started_s: float | None = None
        self.num_arrived = 0
        self.live: dict[str, ModelSession] = {}  # insertion order = admission order
        self.queued: dict[str, ModelSession] = {}
        self.arrivals_s: list[float] = []
        self.outcomes: dict[str, str] = {}  # finished / withdrawn / shed
        self.last_move_s: float | None = None
        self.ttft_s: float | None = None  # the last first-token latency a tick reported

    def new_policy(self, config: PolicyConfig) -> Policy:
        return Policy(config)

    # --- model arithmetic ----------------------------------------------------------------------

    def is_engaged(self, budget: int, arriving_context: int = 0) -> bool:
        """The working set (contexts, an arrival's own included) held against the budget over r (reservation units
        to contexts), while the engines are slow when there is a latency gate."""
        ratio, gate = self.config.reservation_ratio, self.config.latency_gate_s
        is_slow = gate is None or (self.ttft_s is not None and self.ttft_s >= gate)
        working_set = self.working_set() + arriving_context
        return self.config.always_engaged or bool(self.queued) or (working_set * ratio > budget and is_slow)

    def reservation(self, session: ModelSession) -> int:
        if self.config.mode == "prototype":
            return session.context_tokens
        return max(math.ceil(session.peak_tokens * session.multiplier), session.context_tokens,
                   session.regrown_tokens)

    def reserved(self) -> int:
        return sum(self.reservation(s) for s in self.live.values())

    def working_set(self) -> int:
        return sum(s.context_tokens for s in self.live.values())

    def head(self) -> ModelSession | None:
        return min(self.queued.values(), key=lambda s: s.key, default=None)

    def head_fits(self, budget_tokens: int) -> bool:
        head = self.head()
        assert head is not None
        return not self.live or self.reserved() + self.reservation(head) <= budget_tokens

    def budget(self) -> int:
        assert self.policy is not None
        return self.policy.snapshot().budget_tokens

    def step_time(self, dt: int) -> float:
        self.now += dt
        if self.started_s is None:
            self.started_s = self.now
        return self.now

    def expect_admissions(self, events: Sequence[Event], budget_tokens: int) -> None:
        """Every event is an `Admitted` of the queue head, which fits unless nobody is live; it carries
        the head's priority, its wait since arrival and its reservation."""
        for event in events:
            assert isinstance(event, Admitted), f"unexpected event {event}"
            session_id = event.session_id
            head = self.head()
            assert head is not None, f"{session_id} admitted from an empty queue"
            assert session_id == head.session_id, f"{session_id} admitted before the head {head.session_id}"
            need = self.reservation(head)
            assert not self.live or self.reserved() + need <= budget_tokens, (
                f"admitting {session_id} takes reservations to {self.reserved() + need} > {budget_tokens}"
            )
            assert event == Admitted(session_id, self.now, head.priority, self.now - head.queued_s, need,
                                     is_resumed=head.has_run)
            self.live[session_id] = self.queued.pop(session_id)
            head.has_run = True

    def pick(self, data: st.DataObject, pool: dict[str, ModelSession]) -> str:
        return data.draw(st.sampled_from(sorted(pool)))

    # --- rules -----------------------------------------------------------------------------------

    @rule(dt=st.integers(0, 20), peak=st.floats(0, 1500), context=st.integers(0, 800),
          multiplier=st.sampled_from([1.0, 1.0, 0.9, 1.7, 3.4]))
    def arrive(self, dt: int, peak: float, context: int, multiplier: float) -> None:
        assert self.policy is not None
        session_id = f"s{self.num_arrived}"
        budget = self.budget()
        was_engaged = self.is_engaged(budget, context)
        now = self.step_time(dt)
        events = self.policy.arrive(session_id, now, peak, context, multiplier)
        priority = now if self.config.mode == "prototype" else now + peak / self.config.tokens_per_s
        session = ModelSession(session_id, self.num_arrived, now, peak, priority, context, multiplier,
                               first_context_tokens=context, queued_s=now)
        self.num_arrived += 1
        self.arrivals_s.append(now)
        if not was_engaged:
            assert events == [Admitted(session_id, now, priority, 0.0, self.reservation(session))], (
                f"{session_id} queued while admission was not engaged: {events}")
            self.live[session_id] = session
            session.has_run = True
            return
        self.queued[session_id] = session
        head = self.head()
        due = head is session and self.head_fits(budget)
        assert len(events) == int(due), f"{session_id}: due={due}, events {events}"
        self.expect_admissions(events, budget)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), dt=st.integers(0, 20))
    def finish_live(self, data: st.DataObject, dt: int) -> None:
        assert self.policy is not None
        session_id = self.pick(data, self.live)
        admitted = self.policy.finish(session_id, self.step_time(dt))
        del self.live[session_id]
        self.outcomes[session_id] = "finished"
        self.expect_admissions(admitted, self.budget())

    @precondition(lambda self: bool(self.queued))
    @rule(data=st.data(), dt=st.integers(0, 20))
    def withdraw_queued(self, data: st.DataObject, dt: int) -> None:
        assert self.policy is not None
        session_id = self.pick(data, self.queued)
        admitted = self.policy.finish(session_id, self.step_time(dt))
        del self.queued[session_id]
        self.outcomes[session_id] = "withdrawn"
        self.expect_admissions(admitted, self.budget())

    @precondition(lambda self: bool(self.live or self.queued))
    @rule(data=st.data(), dt=st.integers(0, 20), context=st.integers(0, 1500))
    def observe(self, data: st.DataObject, dt: int, context: int) -> None:
        self.observe_with(self.pick(data, {**self.live, **self.queued}), dt, context)

    def observe_with(self, session_id: str, dt: int, context: int) -> None:
        assert self.policy is not None
        budget = self.budget()
        session = self.live.get(session_id)
        outgrows = (session is not None and self.config.mode == "basin" and not self.config.can_outgrow_reservation
                    and context > self.reservation(session))
        is_engaged = session is not None and self.is_engaged(budget, context - session.context_tokens)
        events = self.policy.observe(session_id, self.step_time(dt), context)
        if session is None:
            self.queued[session_id].context_tokens = context
        elif outgrows:
            self.outgrow(session, context, is_engaged, events, budget)
            return
        else:
            session.context_tokens = context
        self.expect_admissions(events, budget)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), dt=st.integers(0, 20), extra=st.integers(1, 800))
    def call_past_reservation(self, data: st.DataObject, dt: int, extra: int) -> None:
        """A live session's call carries more than it reserved (a made-up history, a ride on its id)."""
        assert self.policy is not None
        session = self.live[self.pick(data, self.live)]
        self.observe_with(session.session_id, dt, self.reservation(session) + extra)

    def outgrow(self, session: ModelSession, context: int, is_engaged: bool, events: list[Event], budget: int) -> None:
        """A live session's call passed its reservation: re-reserved, and held in the queue if that does not fit."""
        old = self.reservation(session)
        regrown = context + session.growth_tokens
        others = self.reserved() - old
        head = self.head()
        stays = (head is None or session.key < head.key) and (len(self.live) == 1 or others + regrown <= budget)
        session.regrown_tokens = regrown
        session.context_tokens = context
        if not is_engaged or stays:
            assert not events or isinstance(events[0], Admitted), f"{session.session_id} stays live: {events}"
            self.expect_admissions(events, budget)
            if is_engaged:  # the rule's promise: past the budget only alone
                assert len(self.live) == 1 or self.reserved() <= budget, (
                    f"{session.session_id} grew to {regrown}: reserved {self.reserved()} > budget {budget}")
            return
        assert events and isinstance(events[0], Requeued), f"{session.session_id} outgrew, engaged, not held: {events}"
        first = events[0]
        assert (first.session_id, first.context_tokens, first.reservation_tokens, first.reserved_tokens,
                first.budget_tokens, first.priority) == (session.session_id, context, regrown, others, budget,
                                                         session.priority)
        del self.live[session.session_id]
        session.queued_s = self.now
        self.queued[session.session_id] = session
        self.expect_admissions(events[1:], budget)

    @precondition(lambda self: bool(self.live or self.queued))
    @rule(data=st.data(), dt=st.integers(0, 20), peak=st.floats(0, 3000), multiplier=st.floats(0.5, 4.0))
    def revise(self, data: st.DataObject, dt: int, peak: float, multiplier: float) -> None:
        """An online re-estimate, up or down: reservation moves, priority stays, heads may get in."""
        assert self.policy is not None
        session_id = self.pick(data, {**self.live, **self.queued})
        admitted = self.policy.revise(session_id, self.step_time(dt), peak, multiplier)
        session = self.live.get(session_id) or self.queued[session_id]
        session.peak_tokens, session.multiplier = peak, multiplier
        session.regrown_tokens = 0
        self.expect_admissions(admitted, self.budget())

    @rule(dt=st.integers(0, 30), hit_rate=st.none() | st.floats(0, 1),
          ttft_s=st.none() | st.sampled_from([0.2, 0.99, 1.0, 30.0]))
    def tick(self, dt: int, hit_rate: float | None, ttft_s: float | None) -> None:
        assert self.policy is not None
        budget_before, had_queue = self.budget(), bool(self.queued)
        now = self.step_time(dt)
        events = self.policy.tick(now, hit_rate, ttft_s)
        if ttft_s is not None:
            self.ttft_s = ttft_s
        if events and isinstance(events[0], BudgetMoved):
            self.check_budget_move(events.pop(0), now, hit_rate, budget_before, had_queue)
        else:
            assert self.budget() == budget_before
        admitted = [e for e in events if isinstance(e, Admitted)]
        self.expect_admissions(admitted, self.budget())
        rest = events[len(admitted) :]
        assert all(isinstance(e, Shed) for e in rest) and len(rest) <= 1, f"unexpected events {rest}"
        self.check_shedding(rest[0] if rest else None, now)

    @rule(dt=st.integers(0, 10), reference=st.integers(200, 2000))
    def set_reference_budget(self, dt: int, reference: int) -> None:
        assert self.policy is not None
        old = self.budget()
        now = self.step_time(dt)
        events = self.policy.set_reference_budget(reference, now)
        moved = events.pop(0)
        low = max(1, round(reference * 0.85))
        high = max(low, round(reference * 1.10), self.config.budget_ceiling_tokens or 0)  # an operator's B keeps C
        assert isinstance(moved, BudgetMoved)
        assert (moved.old_budget_tokens, moved.new_budget_tokens) == (old, min(high, max(low, old)))
        self.expect_admissions(events, self.budget())

    @rule(data=st.data())
    def illegal_step(self, data: st.DataObject) -> None:
        assert self.policy is not None
        policy = self.policy
        known = sorted({**self.live, **self.queued})
        steps: list[Any] = [
            lambda: policy.finish("ghost", self.now),
            lambda: policy.observe("ghost", self.now, 1),
            lambda: policy.arrive("x", self.now, math.nan, 1),
            lambda: policy.tick(self.now, -0.5),
            lambda: policy.revise("ghost", self.now, 10.0),
        ]
        if self.now > 0:
            steps.append(lambda: policy.tick(self.now - 1))
        if known:
            session_id = data.draw(st.sampled_from(known))
            steps.append(lambda: policy.arrive(session_id, self.now, 1, 1))
            steps.append(lambda: policy.observe(session_id, self.now, -1))
            steps.append(lambda: policy.revise(session_id, self.now, math.inf))
            steps.append(lambda: policy.revise(session_id, self.now, 10.0, 0.0))
            if self.now > 0:
                steps.append(lambda: policy.revise(session_id, self.now - 1, 10.0))
        step = data.draw(st.sampled_from(steps))
        before_snapshot, before_state = policy.snapshot(), pickle.dumps(policy)
        try:
            step()
        except PolicyError:
            pass
        else:
            raise AssertionError("an illegal step did not raise PolicyError")
        assert policy.snapshot() == before_snapshot
        assert pickle.dumps(policy) == before_state

    @rule()
    def restore_from_state(self) -> None:
        """Go on with a policy rebuilt from the state's JSON (what a replica restarting from a snapshot does)."""
        assert self.policy is not None
        state = json.loads(json.dumps(self.policy.to_state()))
        if type(self.policy) is Policy:
            self.policy = Policy.from_state(state)
        assert self.policy.to_state() == state

    # --- event checks ----------------------------------------------------------------------------

    def check_budget_move(
        self, moved: BudgetMoved, now: float, hit_rate: float | None, old: int, had_queue: bool
    ) -> None:
        reference = moved.reference_budget_tokens
        step = max(1, round(reference * self.config.budget_step_fraction))
        knee_high = round(reference * self.config.budget_max_fraction)  # the bound before the completion ceiling
        high = max(knee_high, self.config.budget_ceiling_tokens or 0)
        low = max(1, round(reference * self.config.budget_min_fraction))
        assert hit_rate is not None and moved.hit_rate == hit_rate
        assert moved.old_budget_tokens == old and low <= moved.new_budget_tokens <= high
        if old > knee_high and moved.new_budget_tokens < old:  # off the plateau above the knee bound: straight to it
            assert moved.new_budget_tokens == max(low, min(old - step, knee_high))
        else:
            assert 0 < abs(moved.new_budget_tokens - old) <= step
        on_plateau = hit_rate >= self.config.hit_rate_plateau - self.config.hit_rate_tolerance
        assert (moved.new_budget_tokens > old) == on_plateau
        assert had_queue or not on_plateau, "loosened with nobody queued"
        if self.last_move_s is not None:
            assert now - self.last_move_s >= self.config.budget_move_interval_s
        self.last_move_s = now

    def arrival_rate(self, now: float) -> float | None:
        assert self.started_s is not None
        window = self.config.arrival_window_s
        count = sum(1 for t in self.arrivals_s if t > now - window)
        span = min(window, now - self.started_s)
        return None if span <= 0 else count / span

    def check_shedding(self, shed: Shed | None, now: float) -> None:
        peak_rate = self.config.peak_completion_rate_per_s
        head = self.head()
        rate = self.arrival_rate(now) if head is not None else None
        never_run = [s for s in self.queued.values() if not s.has_run]  # one held for an outgrown call is not shed
        is_due = (
            head is not None
            and bool(never_run)
            and peak_rate is not None
            and rate is not None
            and rate > peak_rate
            and now - head.queued_s >= self.config.shed_wait_s
        )
        assert (shed is not None) == is_due, f"shed={shed} but due={is_due}"
        if shed is None:
            return
        victim = max(never_run, key=lambda s: s.key)
        assert head is not None and shed.session_id == victim.session_id
        assert (shed.arrival_rate_per_s, shed.head_waited_s) == (rate, now - head.queued_s)
        assert "exceeds peak completion rate" in shed.reason
        del self.queued[shed.session_id]
        self.outcomes[shed.session_id] = "shed"

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def snapshot_matches_model(self) -> None:
        if self.policy is None:
            return
        snap = self.policy.snapshot()
        assert snap.live == tuple(self.live)
        assert snap.queued == tuple(s.session_id for s in sorted(self.queued.values(), key=lambda s: s.key))
        assert (snap.reserved_tokens, snap.working_set_tokens) == (self.reserved(), self.working_set())
        assert snap.is_engaged == self.is_engaged(snap.budget_tokens)
        low = max(1, round(snap.reference_budget_tokens * 0.85))
        high = max(round(snap.reference_budget_tokens * 1.10), self.config.budget_ceiling_tokens or 0)
        assert low <= snap.budget_tokens <= high
        for session in {**self.live, **self.queued}.values():
            assert self.policy.priority_of(session.session_id) == session.priority

    @invariant()
    def state_round_trips(self) -> None:
        if self.policy is None:
            return
        state = self.policy.to_state()
        restored = Policy.from_state(json.loads(json.dumps(state)))
        assert restored.to_state() == state and restored.snapshot() == self.policy.snapshot()

    @invariant()
    def queue_is_settled(self) -> None:
        if self.policy is None or not self.queued:
            return
        assert self.live, "sessions queued while nobody is live"
        assert not self.head_fits(self.budget()), "the head fits but was left waiting"

    @invariant()
    def nobody_is_lost(self) -> None:
        if self.policy is None:
            return
        accounted = [*self.live, *self.queued, *self.outcomes]
        assert sorted(accounted) == sorted(f"s{i}" for i in range(self.num_arrived))

    def teardown(self) -> None:
        """Finish everyone live: the queue must drain, and every arrival must have an outcome."""
        if self.policy is None:
            return
        while self.live:
            session_id = next(iter(self.live))
            admitted = self.policy.finish(session_id, self.now)
            del self.live[session_id]
            self.outcomes[session_id] = "finished"
            self.expect_admissions(admitted, self.budget())
        assert not self.queued
        assert self.policy.snapshot().queued == ()
        assert set(self.outcomes.values()) <= {"finished", "withdrawn", "shed"}
        assert len(self.outcomes) == self.num_arrived


TestPolicyMachine = PolicyMachine.TestCase
TestPolicyMachine.settings = MACHINE_SETTINGS


class RedisPolicyMachine(PolicyMachine):
    """The same machine, every step through a real Redis; snapshots and a second replica checked too."""

    url: ClassVar[str] = ""
    loop: ClassVar[LoopThread | None] = None

    def new_policy(self, config: PolicyConfig) -> Policy:
        assert self.loop is not None
        self.shared = RedisPolicy(config, self.url, self.loop)
        return cast(Policy, self.shared)

    @precondition(lambda self: self.policy is not None)
    @rule()
    def keep_snapshot(self) -> None:
        """The leader keeps a snapshot and trims the stream before it; replicas started later load it."""
        self.shared.keep_snapshot()

    def teardown(self) -> None:
        if self.policy is None:
            return
        try:
            super().teardown()
            self.shared.check_replicas_agree()
        finally:
            self.shared.close()


@pytest.mark.integration
def test_the_policy_machine_through_redis(redis_server: RedisServer, redis_loop: LoopThread) -> None:
    RedisPolicyMachine.url, RedisPolicyMachine.loop = redis_server.url, redis_loop
    run_state_machine_as_test(RedisPolicyMachine, settings=MACHINE_SETTINGS)


# --- lending ledger ------------------------------------------------------------------------------

SESSION_IDS = [f"s{i}" for i in range(6)]


class LedgerMachine(RuleBasedStateMachine):
    """A `LendingLedger` next to a list-per-instance model, oldest entry first."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger: LendingLedger | None = None

    @initialize(
        capacities=st.lists(st.integers(1, 300), min_size=1, max_size=3),
        fraction=st.sampled_from([0.5, 0.25, 0.3, 1.0]),
    )
    def setup(self, capacities: list[int], fraction: float) -> None:
        self.ledger = LendingLedger(lend_cap_fraction=fraction)
        self.instances = [f"d{i}" for i in range(len(capacities))]
        self.cap = {i: int(c * fraction) for i, c in zip(self.instances, capacities, strict=True)}
        self.model: dict[str, list[tuple[str, int]]] = {i: [] for i in self.instances}
        for instance_id, capacity in zip(self.instances, capacities, strict=True):
            self.ledger.add_instance(instance_id, capacity)

    def instance(self, index: int) -> str:
        return self.instances[index % len(self.instances)]

    def model_forget(self, session_id: str) -> list[LentEntry]:
        for instance_id, entries in self.model.items():
            for j, (held, tokens) in enumerate(entries):
                if held == session_id:
                    del entries[j]
                    return [LentEntry(held, instance_id, tokens)]
        return []

    def lent(self, instance_id: str) -> int:
        return sum(tokens for _, tokens in self.model[instance_id])

    @rule(session_id=st.sampled_from(SESSION_IDS), index=st.integers(0, 2), tokens=st.integers(0, 200))
    def lend(self, session_id: str, index: int, tokens: int) -> None:
        assert self.ledger is not None
        instance_id = self.instance(index)
        expected = self.model_forget(session_id)
        if tokens > self.cap[instance_id]:
            expected.append(LentEntry(session_id, instance_id, tokens))
        elif tokens > 0:
            while self.lent(instance_id) + tokens > self.cap[instance_id]:
                held, kept = self.model[instance_id].pop(0)
                expected.append(LentEntry(held, instance_id, kept))
            self.model[instance_id].append((session_id, tokens))
        assert self.ledger.lend(session_id, instance_id, tokens) == expected

    @rule(index=st.integers(0, 2), needed=st.integers(0, 250))
    def reclaim(self, index: int, needed: int) -> None:
        assert self.ledger is not None
        instance_id = self.instance(index)
        before = self.ledger.entries(instance_id)
        result = self.ledger.reclaim(instance_id, needed)
        assert result.entries == before[: len(result.entries)], "reclaim is not oldest first"
        assert result.freed_tokens == sum(e.tokens for e in result.entries)
        assert result.freed_tokens >= needed or result.entries == before, "stopped short"
        if result.entries:
            assert result.freed_tokens - result.entries[-1].tokens < needed, "reclaimed more than needed"
        del self.model[instance_id][: len(result.entries)]

    @rule(session_id=st.sampled_from(SESSION_IDS))
    def forget(self, session_id: str) -> None:
        assert self.ledger is not None
        expected = self.model_forget(session_id)
        assert self.ledger.forget(session_id) == (expected[0] if expected else None)

    @rule(session_id=st.sampled_from(SESSION_IDS), cached=st.integers(0, 250))
    def write_back_plan(self, session_id: str, cached: int) -> None:
        assert self.ledger is not None
        plan = self.ledger.write_back_plan(session_id, cached)
        held = [(i, t) for i, entries in self.model.items() for s, t in entries if s == session_id]
        if held and held[0][1] > cached:
            instance_id, tokens = held[0]
            assert plan == WriteBackPlan(session_id, instance_id, tokens, cached, tokens - cached)
        else:
            assert plan is None

    @invariant()
    def ledger_matches_model_and_caps(self) -> None:
        if self.ledger is None:
            return
        holders: list[str] = []
        for instance_id in self.instances:
            lent = self.ledger.lent_tokens(instance_id)
            assert 0 <= lent <= self.ledger.cap_tokens(instance_id) == self.cap[instance_id]
            entries = self.ledger.entries(instance_id)
            assert lent == sum(e.tokens for e in entries)
            assert [(e.session_id, e.tokens) for e in entries] == self.model[instance_id]
            holders += [e.session_id for e in entries]
        assert len(holders) == len(set(holders)), "a session is lent twice"


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = MACHINE_SETTINGS

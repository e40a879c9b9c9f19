"""The router against the scanning version it replaced (`router_v1`, frozen), step by step.

Both get the same seed and the same steps (routes of growing, sometimes rewritten, conversations in a
few groups; finishes; forgets; bad steps), and must agree on every decision and on the whole observable
state after it: loads, dispatch counts, every session's holders, every group's tenants, the balance gate
of every worker. Equal random draws follow (a tie broken differently would change the next decisions).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from basin_sim.router import CacheAwareRouter, RouterError
from tests.sim.router_v1 import CacheAwareRouter as RouterV1
from tests.sim.router_v1 import RouterError as RouterErrorV1

GROUPS = {"g0": 300, "g1": 500, "g2": 700}


class Pair:
    """The router and its reference, driven together."""

    def __init__(self, num_workers: int, seed: int, **thresholds: float) -> None:
        self.new = CacheAwareRouter(num_workers, seed=seed, **thresholds)
        self.old = RouterV1(num_workers, seed=seed, **thresholds)
        self.kinds: Counter[str] = Counter()

    def route(self, session: str, group: str, prompt_tokens: int) -> int | None:
        """Route in both; the worker, or None if both refused the step."""
        try:
            got = self.new.route(session, group, GROUPS[group], prompt_tokens)
        except RouterError as exc:
            with pytest.raises(RouterErrorV1, match=str(exc).replace("(", r"\(").replace(")", r"\)")):
                self.old.route(session, group, GROUPS[group], prompt_tokens)
            return None
        want = self.old.route(session, group, GROUPS[group], prompt_tokens)
        assert (got.worker, got.kind.value, got.matched_tokens) == (want.worker, want.kind.value, want.matched_tokens)
        self.kinds[got.kind.value] += 1
        return got.worker

    def finish(self, worker: int) -> None:
        try:
            self.new.finish(worker)
        except RouterError:
            with pytest.raises(RouterErrorV1):
                self.old.finish(worker)
            return
        self.old.finish(worker)

    def forget(self, session: str) -> None:
        self.new.forget(session)
        self.old.forget(session)

    def check(self, sessions: list[str], is_gate_checked: bool = True) -> None:
        new, old = self.new, self.old
        assert (new.loads, new.num_routed, new.num_conversations) == (old.loads, old.num_routed, old.num_conversations)
        assert all(new.holders(s) == old.holders(s) for s in sessions)
        assert all(new.group_tenants(g) == old.group_tenants(g) for g in GROUPS)
        if is_gate_checked:  # the reference sums every load per worker: O(workers^2)
            assert [new.is_over(w) for w in range(new.num_workers)] == [old.is_over(w) for w in range(old.num_workers)]
        assert new._rng.getstate() == old._rng.getstate()  # the same draws so far


def drive(pair: Pair, rng: random.Random, steps: int, num_sessions: int) -> None:
    """Random traffic: conversations grow call by call, a few are rewritten shorter; requests finish late."""
    sessions = [f"s{k}" for k in range(num_sessions)]
    groups = {s: f"g{k % len(GROUPS)}" for k, s in enumerate(sessions)}
    prompts = {s: GROUPS[groups[s]] for s in sessions}
    in_flight: list[int] = []
    for step in range(steps):
        roll = rng.random()
        session = rng.choice(sessions)
        if roll < 0.55:
            if rng.random() < 0.1:
                prompts[session] = GROUPS[groups[session]] + rng.randrange(0, 200)  # rewritten or fresh
            else:
                prompts[session] += rng.randrange(0, 3_000)
            worker = pair.route(session, groups[session], prompts[session])
            if worker is not None:
                in_flight.append(worker)
        elif roll < 0.93 and in_flight:
            pair.finish(in_flight.pop(rng.randrange(len(in_flight))))
        elif roll < 0.97:
            pair.forget(session)
            prompts[session] = GROUPS[groups[session]]
        else:  # bad steps: a group of the wrong size, a prompt shorter than its group, an idle worker
            pair.finish(rng.randrange(pair.new.num_workers))
            if pair.route(session, groups[session], GROUPS[groups[session]] - 1) is not None:
                in_flight.append(pair.new.loads.index(max(pair.new.loads)))  # not reached: always refused
        pair.check(sessions, is_gate_checked=pair.new.num_workers <= 40 or step % 50 == 0)


@pytest.mark.parametrize(("num_workers", "thresholds"), [
    (1, {}), (3, {}), (8, {}), (13, {"balance_abs_threshold": 2, "balance_rel_threshold": 1.0}),
    (40, {"cache_threshold": 0.0}), (300, {}),
])
def test_random_traffic_gets_the_same_decisions_and_state(num_workers: int, thresholds: dict[str, float]) -> None:
    for seed in range(3 if num_workers <= 40 else 1):  # the reference scans the pool on every route
        pair = Pair(num_workers, seed, **thresholds)
        drive(pair, random.Random(seed), 1_500, num_sessions=3 * num_workers + 5)
        assert pair.kinds["hit"] and pair.kinds["miss"]
        if num_workers > 1:
            assert pair.kinds["hit"] + pair.kinds["spill"] + pair.kinds["miss"] > 500


def test_the_traffic_reaches_spills_and_ties() -> None:
    """The differential runs above would be weak without spills (every holder over the gate)."""
    pair = Pair(13, 0, balance_abs_threshold=2, balance_rel_threshold=1.0)
    drive(pair, random.Random(0), 1_500, num_sessions=44)
    assert pair.kinds["spill"] > 10


class RouterMachine(RuleBasedStateMachine):
    """Hypothesis picks the steps (and shrinks a failure to a short one)."""

    @initialize(num_workers=st.integers(1, 12), seed=st.integers(0, 3), abs_threshold=st.sampled_from([0, 4, 64]),
                rel_threshold=st.sampled_from([1.0, 1.5]))
    def start(self, num_workers: int, seed: int, abs_threshold: int, rel_threshold: float) -> None:
        self.pair = Pair(num_workers, seed, balance_abs_threshold=abs_threshold, balance_rel_threshold=rel_threshold)
        self.sessions = [f"s{k}" for k in range(6)]
        self.in_flight: list[int] = []

    @rule(k=st.integers(0, 5), prompt_tokens=st.integers(250, 9_000))
    def route(self, k: int, prompt_tokens: int) -> None:
        worker = self.pair.route(self.sessions[k], f"g{k % 3}", prompt_tokens)
        if worker is not None:
            self.in_flight.append(worker)

    @precondition(lambda self: self.in_flight)
    @rule(index=st.integers(0, 1_000))
    def finish(self, index: int) -> None:
        self.pair.finish(self.in_flight.pop(index % len(self.in_flight)))

    @rule(worker=st.integers(0, 11))
    def finish_idle_or_unknown(self, worker: int) -> None:
        if worker not in self.in_flight:
            self.pair.finish(worker)  # both refuse (or both accept: never, the worker has nothing in flight)

    @rule(k=st.integers(0, 5))
    def forget(self, k: int) -> None:
        self.pair.forget(self.sessions[k])

    @invariant()
    def same_state(self) -> None:
        if hasattr(self, "pair"):
            self.pair.check(self.sessions)


RouterMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None)
test_router_machine = RouterMachine.TestCase

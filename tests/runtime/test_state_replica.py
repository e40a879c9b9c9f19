"""The replicated state without Redis: steps as data, entries applied once and in order, ownership, reaping.

Each test feeds `ReplicatedState` hand-made stream entries (what the Redis stream would hand every
replica) and compares the whole state (`to_state`) after the steps that matter. Signal reports are
checked against what one replica alone would tick with.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import pytest

from basin_runtime.policy import Admitted, Policy, PolicyConfig, PolicyError, UnknownSessionError
from basin_runtime.policy.latency import LatencyWindow
from basin_runtime.state.replica import Entry, Orphan, ReplicatedState, StreamGapError
from basin_runtime.state.signals import MAX_LATENCIES, SignalReport, combine
from basin_runtime.state.steps import SEQUENCER_CLOCK, Step, decode_step, encode_step


class Stream:
    """Hand-made stream entries for one `ReplicatedState`; each replica numbers its own steps."""

    def __init__(self, state: ReplicatedState) -> None:
        self.state = state
        self.n = 0
        self.counters: dict[str, int] = {}

    def entry(self, replica: str, step: Step, clock_s: float = 0.0, counter: int | None = None) -> Entry:
        if counter is None:
            counter = self.counters.get(replica, 0) + 1
        self.counters[replica] = max(counter, self.counters.get(replica, 0))
        self.n += 1
        return Entry(f"{self.n}-0", self.n, round(clock_s * 1e6), replica, encode_step(step, counter))

    def apply(self, replica: str, kind: Any, session_id: str | None, *args: Any, now: float) -> Any:
        return self.state.apply(self.entry(replica, Step(kind, session_id, args, SEQUENCER_CLOCK), clock_s=now))


def fresh(budget_tokens: int = 1000, **config: Any) -> tuple[ReplicatedState, Stream]:
    state = ReplicatedState(Policy(PolicyConfig(budget_tokens=budget_tokens, **config)))
    return state, Stream(state)


def test_steps_round_trip_as_json_with_the_values_the_core_refuses() -> None:
    for step in (Step("arrive", "s", (10.5, 3, 1.5), 2.0), Step("tick", None, (None, 0.3), SEQUENCER_CLOCK),
                 Step("observe", "s", (math.nan,), math.inf), Step("set_reference_budget", None, (5,), None),
                 Step("reap", None, (["r1"], 600.0), 7.0), Step("claim", "s", (), 1.0)):
        decoded, counter = decode_step(encode_step(step, 7))
        assert counter == 7 and decoded.kind == step.kind and decoded.session_id == step.session_id
        assert json.dumps(decoded.args) == json.dumps(step.args) and decoded.is_stamped == step.is_stamped
    assert decode_step(encode_step(Step("tick", None, (), None), 1))[0].now is None  # an explicit null is kept
    for bad in ('{"k": "nope", "a": [], "q": 1}', '{"k": "finish", "a": [], "q": 1}', '[1]', '{"k": "tick", "a": [],'
                ' "q": 0}', 'not json'):
        with pytest.raises(PolicyError, match=r"malformed step entry|unknown step kind|session id"):
            decode_step(bad)
    with pytest.raises(PolicyError, match="takes 1 arguments, got 2"):
        Step("observe", "s", (1, 2))


def test_entries_apply_in_order_and_a_gap_raises_and_changes_nothing() -> None:
    state, stream = fresh(always_engaged=True)
    applied = stream.apply("r1", "arrive", "a", 900, 100, now=1.0)
    assert applied.events == (Admitted("a", 1.0, 1.0 + 900 / 30, 0.0, 900),) and applied.entered == ("a",)
    before = state.to_state()
    with pytest.raises(StreamGapError, match="number 9; the next to apply is 2"):
        state.apply(Entry("9-0", 9, 0, "r1", encode_step(Step("finish", "a"), 2)))
    assert state.to_state() == before


def test_a_step_sent_twice_applies_once_and_the_clock_never_runs_back() -> None:
    state, stream = fresh(always_engaged=True)
    arrive = Step("arrive", "a", (900, 100), SEQUENCER_CLOCK)
    state.apply(stream.entry("r1", arrive, clock_s=5.0, counter=1))
    again = state.apply(stream.entry("r1", arrive, clock_s=6.0, counter=1))  # the answer was lost: sent again
    assert again.is_duplicate and again.events == () and state.policy.snapshot().live == ("a",)
    late = state.apply(stream.entry("r2", Step("arrive", "b", (50, 5), SEQUENCER_CLOCK), clock_s=4.0))
    assert late.now == 5.0 and late.error is None  # Redis's clock stepped back: the step runs at the last now
    assert state.counters == {"r1": 1, "r2": 1} and state.n == 3


def test_an_illegal_step_is_kept_changes_nothing_and_answers_its_error() -> None:
    state, stream = fresh()
    stream.apply("r1", "arrive", "a", 100, 10, now=1.0)
    before = state.to_state()
    refused = stream.apply("r2", "arrive", "a", 100, 10, now=2.0)
    assert isinstance(refused.error, PolicyError) and "arrived again" in str(refused.error)
    after = state.to_state()
    assert (after["n"], after["counters"]) == (before["n"] + 1, {**before["counters"], "r2": 1})
    assert {k: v for k, v in after.items() if k not in ("n", "entry_id", "counters")} == {
        k: v for k, v in before.items() if k not in ("n", "entry_id", "counters")}


def test_ownership_follows_arrivals_and_claims_and_ends_with_the_session() -> None:
    state, stream = fresh(budget_tokens=100, always_engaged=True)
    stream.apply("r1", "arrive", "a", 90, 10, now=1.0)
    stream.apply("r1", "arrive", "b", 50, 10, now=2.0)  # queued: 90 + 50 > 100
    assert state.owners == {"a": "r1", "b": "r1"} and state.policy.is_queued("b")
    claimed = stream.apply("r2", "claim", "b", now=3.0)  # b's client reconnected to r2: its place is kept
    assert claimed.claimed_from == "r1" and claimed.events == () and state.owner_of("b") == "r2"
    assert state.policy.snapshot().queued == ("b",)
    done = stream.apply("r1", "finish", "a", now=4.0)
    assert [e.session_id for e in done.events] == ["b"] and done.left == ("a",)
    assert state.owners == {"b": "r2"} and state.replicas() == {"r2"}
    missing = stream.apply("r2", "claim", "a", now=5.0)
    assert isinstance(missing.error, UnknownSessionError)


def test_reaping_a_dead_replica_returns_its_reservations_keeps_orphans_and_queued_places() -> None:
    state, stream = fresh(budget_tokens=100, always_engaged=True)
    stream.apply("r1", "arrive", "a", 60, 10, now=1.0)
    stream.apply("r2", "arrive", "b", 30, 5, now=2.0)
    stream.apply("r1", "arrive", "c", 50, 7, now=3.0)  # queued behind: 90 + 50 > 100
    stream.apply("r1", "revise", "a", 70, 1.2, now=3.5)  # 84 reserved for a now
    reaped = stream.apply("r3", "reap", None, ["r1"], 600.0, now=10.0)
    assert reaped.reaped == ("a",) and [e.session_id for e in reaped.events] == ["c"]  # a's 84 back: c fits
    snap = state.policy.snapshot()
    assert snap.live == ("b", "c") and snap.reserved_tokens == 30 + 50
    assert state.orphans == {"a": Orphan(70.0, 1.2, 10, 10.0)}
    assert state.owners == {"b": "r2"}  # c was r1's while queued: admitted now, held by nobody
    again = stream.apply("r3", "reap", None, [], 600.0, now=11.0)  # a live session held by nobody is let go too
    assert again.reaped == ("c",) and set(state.orphans) == {"a", "c"}
    adopted = stream.apply("r2", "adopt", "a", 70.0, 12, 1.2, now=12.0)  # its next call through r2: no queue turn
    assert adopted.events[0] == Admitted("a", 12.0, 12.0 + 70 / 30, 0.0, 84) and "a" not in state.orphans
    stream.apply("r3", "reap", None, [], 0.5, now=13.0)  # orphans past the window are forgotten
    assert state.orphans == {} and state.owners == {"b": "r2", "a": "r2"}


def test_reaping_checks_its_arguments_and_the_clock() -> None:
    state, stream = fresh()
    stream.apply("r1", "arrive", "a", 60, 10, now=5.0)
    before = state.policy.to_state()
    for args, match in ((("r1", 1.0), "must be a list"), ((["r1"], -1.0), "window must be seconds")):
        assert match in str(stream.apply("r2", "reap", None, *args, now=6.0).error)
    late = state.apply(stream.entry("r2", Step("reap", None, (["r1"], 1.0), 4.0)))
    assert "runs backwards" in str(late.error)
    assert state.policy.to_state() == before


def test_the_replicated_state_round_trips_and_refuses_what_does_not_add_up() -> None:
    state, stream = fresh(budget_tokens=100, always_engaged=True)
    stream.apply("r1", "arrive", "a", 60, 10, now=1.0)
    stream.apply("r2", "arrive", "b", 60, 10, now=2.0)
    stream.apply("r3", "reap", None, ["r1"], 600.0, now=3.0)
    data = json.loads(json.dumps(state.to_state()))
    assert ReplicatedState.from_state(data).to_state() == data
    broken = json.loads(json.dumps(data))
    broken["owners"]["ghost"] = "r9"
    with pytest.raises(UnknownSessionError, match="'ghost'"):
        ReplicatedState.from_state(broken)
    broken = json.loads(json.dumps(data))
    broken["policy"]["reserved_tokens"] += 1
    with pytest.raises(PolicyError, match="reserved_tokens is 61 but its live sessions sum to 60"):
        ReplicatedState.from_state(broken)
    with pytest.raises(PolicyError, match="version 2 is not 1"):
        ReplicatedState.from_state({**data, "version": 2})


def test_one_replicas_report_gives_what_that_replica_alone_would_tick_with() -> None:
    window = LatencyWindow(min_calls=5)
    for k, ttft in enumerate([0.3, 0.1, 0.9, 0.4, 0.2, 0.8]):
        window.record(float(k), ttft)
    values = window.values(6.0, [1.5])
    report = SignalReport.of(800, 2000, None, values)
    assert combine([SignalReport.from_json(report.to_json())], 1000, 5) == (0.4, window.median_s(6.0, [1.5]))
    assert combine([SignalReport.of(800, 999, None, [1.0] * 4)], 1000, 5) == (None, None)  # too little evidence


def test_reports_combine_over_the_deployment() -> None:
    a, b = SignalReport.of(900, 1000, None, [0.1, 0.2]), SignalReport.of(100, 1000, None, [5.0, 6.0, 7.0])
    assert combine([a, b], 1000, 5) == (0.5, 5.0)  # the union's median, not the median of medians
    scraped = SignalReport.of(0, 0, 0.7, [])
    assert combine([a, scraped, SignalReport.of(0, 0, 0.9, [])], 1000, 1)[0] == pytest.approx(0.8)
    many = SignalReport.of(0, 0, None, [float(v) for v in range(10 * MAX_LATENCIES)])
    assert len(many.latencies_s) == MAX_LATENCIES and many.num_latencies == 10 * MAX_LATENCIES
    median = combine([many], 1, 1)[1]
    assert median is not None and abs(median - statistics.median(range(10 * MAX_LATENCIES))) <= 10
    with pytest.raises(ValueError, match="more latencies"):
        SignalReport.from_json('{"cached_tokens": 0, "prompt_tokens": 0, "engine_hit_rate": null, '
                               '"latencies_s": [1, 2], "num_latencies": 1}')

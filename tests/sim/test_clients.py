"""Client timeouts, retries, give-ups and the closed population, timed by hand with the tiny profile.

TINY (builders.py): prefill 10 ms per batch + 0.1 ms per computed token (chunks of 4096); transfer
5 ms + 1 us per token; decode 20 ms per step. A request reserves prompt + max(completion, 1000).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import pytest

from basin_runtime.policy.lending import LendingKind
from basin_runtime.session_table import Session
from basin_sim.clients import (
    ClientError,
    ClientPolicy,
    ClosedPopulation,
    client_backoff_s,
    harness_wait_s,
    wait_before_attempt_s,
)
from basin_sim.engine import Engine
from basin_sim.goodput import SessionOutcome, goodput, is_good
from basin_sim.lifecycle import Request, SessionSpec, Stage, Status
from basin_sim.policies import NO_DECISIONS, Decisions, FcfsPolicy
from tests.sim.builders import deployment, session, spec, with_profile


class FixedPins:
    """Hold every answered call's KV for the same TTL (Continuum's pins with a set TTL)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s

    def ttl_after_answer_s(self, session_id: str, now: float, context_tokens: int) -> float:
        return self.ttl_s

    def on_scheduled(self, session_id: str, now: float) -> None:
        pass


class Recording(FcfsPolicy):
    """FCFS that counts what it is told; optionally pins (Continuum). Lending is the deployment's switch."""

    def __init__(self, pin_ttl_s: float | None = None, admits: bool = True, last: str | None = None) -> None:
        super().__init__("recording")
        self.pins = None if pin_ttl_s is None else FixedPins(pin_ttl_s)
        self.admits = admits
        self.last = last  # this session's requests go after everyone else's
        self.ended: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def on_arrival(self, session_id: str, now: float, session: Session) -> Decisions:
        return super().on_arrival(session_id, now, session) if self.admits else NO_DECISIONS

    def on_call(self, session_id: str, now: float, prompt_tokens: int) -> Decisions:
        self.calls[session_id] += 1
        return NO_DECISIONS

    def on_session_end(self, session_id: str, now: float) -> Decisions:
        self.ended[session_id] += 1
        return NO_DECISIONS

    def priority(self, session_id: str, now: float) -> float:
        return 1e9 if session_id == self.last else now


def assert_empty(engine: Engine) -> None:
    """Nothing is held anywhere: no request, reservation, queued job, pin, hold or lent KV."""
    engine.check()
    assert engine.num_live == engine.num_queued == engine.working_set_tokens == 0
    for decode in engine.decode:
        assert (decode.used_tokens(), decode.queued_tokens, decode.lent_tokens, decode.batch_size) == (0, 0, 0, 0)
    for prefill in engine.prefill:
        assert prefill.waiting_tokens == 0 and prefill.batch is None
        assert prefill.cache.pinned_tokens == 0


# --- the arithmetic ------------------------------------------------------------------------------


def test_the_openai_backoff_doubles_from_half_a_second_to_eight_with_a_quarter_of_jitter_off() -> None:
    policy = ClientPolicy()
    assert [client_backoff_s(policy, n, 0.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert client_backoff_s(policy, 1, 0.5) == pytest.approx(1.0 * (1 - 0.25 * 0.5))
    assert client_backoff_s(policy, 10_000, 0.0) == 8.0
    with pytest.raises(ClientError, match="0 <= u < 1"):
        client_backoff_s(policy, 0, 1.0)


def test_the_mini_swe_agent_waits_are_tenacity_exponential_between_4_and_60() -> None:
    policy = ClientPolicy()
    assert [harness_wait_s(policy, h) for h in range(1, 10)] == [4, 4, 4, 8, 16, 32, 60, 60, 60]
    with pytest.raises(ClientError, match="failures >= 1"):
        harness_wait_s(policy, 0)


def test_the_wait_before_each_attempt_nests_client_retries_inside_harness_attempts() -> None:
    policy = ClientPolicy()
    assert policy.attempts_per_call == 30
    waits = [wait_before_attempt_s(policy, k, 0.0) for k in range(31)]
    assert waits[:7] == [0.0, 0.5, 1.0, 4.0, 0.5, 1.0, 4.0]
    assert waits[3::3][:9] == [4, 4, 4, 8, 16, 32, 60, 60, 60]  # each harness attempt starts after its wait
    assert waits[29] == 1.0 and waits[30] is None
    assert wait_before_attempt_s(policy, 1, 0.8) == pytest.approx(0.5 * 0.8)
    bare = ClientPolicy(max_retries=0, harness_attempts=1)
    assert [wait_before_attempt_s(bare, k, 0.0) for k in range(2)] == [0.0, None]


@pytest.mark.parametrize("changes", [{"call_timeout_s": 0.0}, {"max_retries": -1}, {"harness_attempts": 0},
                                     {"backoff_initial_s": 9.0}, {"backoff_jitter": 1.5},
                                     {"harness_wait_min_s": 61.0}, {"session_time_limit_s": 0.0}])
def test_a_client_policy_that_makes_no_sense_is_refused_naming_the_field(changes: dict[str, float]) -> None:
    with pytest.raises(ClientError, match=next(iter(changes)).split("_s")[0]):
        ClientPolicy(**changes)  # type: ignore[arg-type]


# --- one call timed out and retried ----------------------------------------------------------------


def test_a_call_stuck_behind_decode_memory_times_out_and_its_second_attempt_succeeds() -> None:
    # Decode holds 3500: one 3000-token reservation at a time. b1..b4 (3.217 s alone, 3.167 s with the
    # shared prefix cached) go before a (lowest priority): they end at 3.217, 6.384, 9.551, 12.718,
    # each within 10 s of its arrival; a's first attempt (sent at 0.5) waits past 10 s.
    clients = ClientPolicy(call_timeout_s=10.0, backoff_jitter=0.0)
    policy = Recording(last="a")
    engine = Engine(deployment(decode_tokens=3_500), policy, tick_s=None, clients=clients)
    engine.add(spec(session("a", [2_000], completion=10), arrival_s=0.5))
    for k in range(4):
        engine.add(spec(session(f"b{k + 1}", [2_000], completion=150), arrival_s=float(k)))
    engine.run_until(10.7)
    a = engine.runs["a"]
    assert (a.status, a.request, a.timeouts, a.attempt) == (Status.LIVE, None, 1, 1)  # waiting 0.5 s to retry
    assert engine.decode[0].queued_tokens == 0
    engine.check()
    engine.run_until(11.1)
    assert a.request is not None and a.request.attempt == 1 and a.request.stage == Stage.PREALLOC
    engine.run_until(math.inf)
    b4_end = 0.217 + 3.0 + 3 * 3.167
    assert [engine.runs[f"b{k}"].timeouts for k in (1, 2, 3, 4)] == [0] * 4
    assert engine.runs["b4"].ended_s == pytest.approx(b4_end)
    assert a.status == Status.FINISHED and a.ended_s == pytest.approx(b4_end + 0.16 + 0.007 + 10 * 0.02)
    assert (a.timeouts, a.retries, a.attempt) == (1, 1, 0)
    assert policy.calls["a"] == 2 and policy.ended == Counter({"a": 1, "b1": 1, "b2": 1, "b3": 1, "b4": 1})
    # timed from the call's first send (0.5 s), so the timed-out wait counts, as the client sees it
    assert engine.timeline.ttft_s[4] == pytest.approx(b4_end + 0.167 - 0.5)
    counts = {name: engine.timeline.count_series(name) for name in ("timeouts", "retries", "abandoned")}
    assert counts == {"timeouts": [1], "retries": [1], "abandoned": [0]}
    assert_empty(engine)


# One session, 20000 tokens: first attempt prefills in 5 chunks until 2.05, moves its KV until 2.075,
# decodes until 4.075. A retry hits the whole prompt (1 token computed): 0.0101 + 0.025 + 2.0.
RETRY_S = 0.0101 + 0.025 + 2.0


@pytest.mark.parametrize(("timeout_s", "stage"), [(2.04, Stage.PREFILLING), (2.06, Stage.TRANSFER),
                                                  (3.0, Stage.DECODING)])
def test_an_attempt_timed_out_in_any_stage_gives_everything_back_and_the_retry_hits_its_prefix(
        timeout_s: float, stage: Stage) -> None:
    clients = ClientPolicy(call_timeout_s=timeout_s, backoff_jitter=0.0)
    engine = Engine(deployment(), Recording(), tick_s=None, clients=clients)
    engine.add(spec(session("a", [20_000], completion=100)))
    engine.run_until(timeout_s - 1e-6)
    request = engine.runs["a"].request
    assert request is not None and request.stage == stage
    engine.run_until(timeout_s + 0.1)
    run = engine.runs["a"]
    assert run.request is None and run.timeouts == 1 and request.is_aborted
    engine.check()
    assert engine.decode[0].used_tokens() == 0 and engine.prefill[0].cache.pinned_tokens == 0
    engine.run_until(math.inf)
    assert run.status == Status.FINISHED and run.ended_s == pytest.approx(timeout_s + 0.5 + RETRY_S)
    assert engine.timeline.device_hit_tokens == [19_999]  # the retry's hit; the first attempt computed all
    assert_empty(engine)


def test_two_aborted_jobs_of_one_batch_let_go_before_their_queued_retries_are_admitted() -> None:
    # Prefill at 1 ms a token. z's batch runs 0 -> 2.01 (z answered at 2.217); then a and b (1500 each
    # past the shared 500) share one batch, 2.01 -> 5.02. Both time out at 2.5 inside it; their retries
    # (sent at 3.0) wait on the same instance and go in the next batch, each computing 1 token: 0.012 s,
    # then 0.007 of transfer and 10 steps.
    slow = deployment(with_profile(prefill_token_s=1e-3))
    engine = Engine(slow, Recording(), tick_s=None, clients=ClientPolicy(call_timeout_s=2.5, backoff_jitter=0.0))
    for name in "zab":
        engine.add(spec(session(name, [2_000], completion=10)))
    engine.run_until(3.2)
    runs = [engine.runs["a"], engine.runs["b"]]
    assert [r.request.stage if r.request else None for r in runs] == [Stage.PREFILL_WAIT] * 2
    engine.check()
    engine.run_until(math.inf)
    assert [(r.status, r.timeouts) for r in runs] == [(Status.FINISHED, 1)] * 2
    assert [r.ended_s for r in runs] == [pytest.approx(5.02 + 0.012 + 0.007 + 0.2)] * 2
    assert engine.runs["z"].timeouts == 0
    assert_empty(engine)


# --- giving up --------------------------------------------------------------------------------------


def test_when_every_attempt_times_out_the_session_is_abandoned_and_the_policy_told_once() -> None:
    # 2 harness attempts x (1 + 1 retry): sent 0, 1.5, 6.5 (harness wait 4), 8.0; the last times out at 9.
    clients = ClientPolicy(call_timeout_s=1.0, max_retries=1, harness_attempts=2, backoff_jitter=0.0)
    policy = Recording()
    engine = Engine(deployment(), policy, tick_s=None, clients=clients)
    engine.add(spec(session("a", [2_000, 2_500], completion=1_000)))  # 20 s of decode: never in time
    sent: list[float] = []
    for until_s in (0.5, 2.0, 7.0, 8.5):
        engine.run_until(until_s)
        request = engine.runs["a"].request
        assert request is not None
        sent.append(request.sent_s)
        engine.check()
    engine.run_until(math.inf)
    run = engine.runs["a"]
    assert sent == [0.0, 1.5, 6.5, 8.0]
    assert (run.status, run.ended_s, run.timeouts, run.retries, run.next_call) == (Status.ABANDONED, 9.0, 4, 3, 0)
    assert policy.ended == Counter({"a": 1}) and policy.calls["a"] == 4
    series = {name: engine.timeline.count_series(name) for name in ("timeouts", "retries", "abandoned",
                                                                     "arrivals", "completions")}
    assert series == {"timeouts": [4], "retries": [3], "abandoned": [1], "arrivals": [1], "completions": [0]}
    assert_empty(engine)


def test_abandoned_sessions_give_back_pins_holds_and_lent_memory_too() -> None:
    # Continuum holds and Basin lending on: b's first call is answered (held chain, lent KV), its
    # second never is in time; c waits for decode memory behind a and b when everything gives up.
    clients = ClientPolicy(call_timeout_s=3.0, max_retries=0, harness_attempts=1)
    policy = Recording(pin_ttl_s=100.0)
    engine = Engine(deployment(decode_tokens=9_000, lending="decode-memory"), policy, tick_s=1.0, clients=clients)
    engine.add(spec(session("a", [2_000], completion=1_000)))
    engine.add(spec(session("b", [2_000, 2_400], completion=10, gap_s=0.5)))
    engine.add(spec(session("b2", [2_000, 2_400, 2_800], completion=1_000, gap_s=0.5), arrival_s=0.3))
    engine.add(spec(session("c", [3_000], completion=1_000), arrival_s=0.6))
    for until_s in (0.4, 0.8, 1.2, 2.0, 3.1, 4.0, 200.0):  # ticks go on: no run to math.inf
        engine.run_until(until_s)
        engine.check()
    statuses = {name: run.status for name, run in engine.runs.items()}
    assert statuses == {"a": Status.ABANDONED, "b": Status.FINISHED, "b2": Status.ABANDONED, "c": Status.ABANDONED}
    assert policy.ended == Counter({"a": 1, "b": 1, "b2": 1, "c": 1})
    assert engine.ledger is not None and engine.ledger.lent_tokens("0") == 0
    assert not any(engine.prefill[0].cache.is_held(name) for name in engine.runs)
    assert_empty(engine)


def test_a_session_gives_up_at_its_time_limit_wherever_it_is() -> None:
    clients = ClientPolicy(session_time_limit_s=3.0)
    policy = Recording()
    engine = Engine(deployment(), policy, tick_s=None, clients=clients)
    engine.add(spec(session("in-gap", [2_000, 2_600], completion=100, gap_s=1.0)))  # answered at 2.217
    engine.add(spec(session("decoding", [2_000], completion=1_000), arrival_s=0.5))
    engine.add(spec(session("quick", [1_000], completion=10), arrival_s=0.1))
    engine.run_until(math.inf)
    runs = engine.runs
    assert [runs[n].status for n in ("in-gap", "decoding", "quick")] == \
        [Status.ABANDONED, Status.ABANDONED, Status.FINISHED]
    assert (runs["in-gap"].ended_s, runs["decoding"].ended_s) == (3.0, 3.5)
    assert runs["in-gap"].next_call == 1 and runs["in-gap"].timeouts == 0
    assert policy.ended == Counter({"in-gap": 1, "decoding": 1, "quick": 1})
    assert engine.timeline.count_series("abandoned") == [2]
    assert_empty(engine)


def test_a_session_held_at_the_door_is_withdrawn_at_its_time_limit() -> None:
    policy = Recording(admits=False)
    engine = Engine(deployment(), policy, tick_s=None, clients=ClientPolicy(session_time_limit_s=60.0))
    engine.add(spec(session("a", [2_000]), arrival_s=1.0))
    run = engine.runs["a"]
    engine.run_until(60.0)
    assert (run.status, engine.num_queued) == (Status.QUEUED, 1)
    engine.run_until(math.inf)
    assert (run.status, run.ended_s) == (Status.ABANDONED, 61.0)
    assert policy.ended == Counter({"a": 1}) and policy.calls["a"] == 0
    assert_empty(engine)


def test_without_clients_nobody_gives_up() -> None:
    # The blocker holds nearly all decode memory for 700 s (700 steps of 1 s): a waits far beyond any
    # client's timeout, and nobody gives up.
    profile = with_profile(decode_step_fixed_s=1.0)
    engine = Engine(deployment(profile, decode_tokens=39_500), Recording(), tick_s=None)
    engine.add(spec(session("blocker", [37_000], completion=700)))
    engine.add(spec(session("a", [2_000], completion=10)))
    engine.run_until(math.inf)
    a, blocker = engine.runs["a"], engine.runs["blocker"]
    assert a.status == Status.FINISHED and a.timeouts == 0 and a.attempt == 0
    assert blocker.ended_s is not None and blocker.ended_s > 700.0
    assert a.first_token_s is not None and a.first_token_s > blocker.ended_s


def test_a_timer_that_no_longer_applies_does_not_move_the_clock() -> None:
    engine = Engine(deployment(), Recording(), tick_s=None, clients=ClientPolicy(session_time_limit_s=900.0))
    engine.add(spec(session("a", [2_000, 2_600], gap_s=1.0)))
    engine.run_until(math.inf)  # its calls' 600 s timers and its 900 s limit are void once it finished
    assert engine.now == engine.runs["a"].ended_s == pytest.approx(2.217 + 1.0 + 0.07 + 0.0076 + 2.0)
    assert len(engine.timeline.bin_states) == 0 and engine.timeline.count_series("completions") == [1]


def test_an_abandoned_session_is_not_good() -> None:
    outcomes = [SessionOutcome("a", 0.0, 9.0, "abandoned", 10.0, 0.0, 0.0),
                SessionOutcome("b", 0.0, 9.0, "finished", 10.0, 0.0, 0.0)]
    assert [is_good(o) for o in outcomes] == [False, True]
    assert goodput(outcomes, 0.0, 3600.0).good == 1


# --- the closed population ----------------------------------------------------------------------


def pool_specs(think_time_s: float = 0.0, stop_s: float = math.inf,
               seed: int = 7) -> tuple[ClosedPopulation, list[Session]]:
    pool = [session(f"p{k}", [1_000 + 500 * k, 1_500 + 500 * k], completion=50, gap_s=0.5) for k in range(3)]

    def make(session_id: str, base: Session, arrival_s: float) -> SessionSpec:
        return SessionSpec(session_id, base, arrival_s, base.benchmark, 500, (0.5,))

    return ClosedPopulation(2, pool, random.Random(seed), make, think_time_s=think_time_s, stop_s=stop_s), pool


def in_flight(engine: Engine) -> int:
    return sum(not run.is_over for run in engine.runs.values())


def test_a_closed_population_keeps_n_sessions_in_flight_and_starts_each_at_the_previous_end() -> None:
    population, pool = pool_specs()
    engine = Engine(deployment(), Recording(), tick_s=None, on_session_over=population.session_over)
    population.start(engine, at_s=0.0)
    for until_s in range(1, 40):
        engine.run_until(float(until_s))
        assert in_flight(engine) == population.num_in_flight == 2
        engine.check()
    runs = sorted(engine.runs.values(), key=lambda r: r.spec.arrival_s)
    ends = sorted(r.ended_s for r in runs if r.ended_s is not None)
    arrivals = [r.spec.arrival_s for r in runs]
    assert arrivals[:2] == [0.0, 0.0] and arrivals[2:] == pytest.approx(ends[:len(arrivals) - 2])
    assert population.num_started == len(engine.runs) > 20
    assert {r.spec.session.benchmark for r in runs} == {"bench"}
    assert all(r.spec.session_id.split(":")[1] in {p.session_id for p in pool} for r in runs)


def test_a_closed_population_thinks_between_sessions_and_stops_starting_at_stop_s() -> None:
    population, _ = pool_specs(think_time_s=2.0, stop_s=30.0)
    engine = Engine(deployment(), Recording(), tick_s=None, on_session_over=population.session_over)
    population.start(engine, at_s=0.0)
    engine.run_until(math.inf)
    runs = list(engine.runs.values())
    assert all(r.status == Status.FINISHED for r in runs) and all(r.spec.arrival_s < 30.0 for r in runs)
    assert min(r.spec.arrival_s for r in runs) > 0.0 and population.num_in_flight == 0
    again, _ = pool_specs(think_time_s=2.0, stop_s=30.0)
    engine2 = Engine(deployment(), Recording(), tick_s=None, on_session_over=again.session_over)
    again.start(engine2, at_s=0.0)
    engine2.run_until(math.inf)
    assert [r.spec.arrival_s for r in engine2.runs.values()] == [r.spec.arrival_s for r in runs]  # same seed


def test_a_closed_agent_whose_session_is_abandoned_starts_another() -> None:
    population, _ = pool_specs(stop_s=20.0)
    clients = ClientPolicy(call_timeout_s=0.05, max_retries=0, harness_attempts=1)  # nothing answers in 50 ms
    engine = Engine(deployment(), Recording(), tick_s=None, clients=clients, on_session_over=population.session_over)
    population.start(engine, at_s=0.0)
    engine.run_until(10.0)
    assert in_flight(engine) == 2 and population.num_started > 2
    assert {r.status for r in engine.runs.values() if r.is_over} == {Status.ABANDONED}
    engine.run_until(math.inf)
    assert_empty(engine)


# --- overload: timeouts bound the live sessions ------------------------------------------------------


def overloaded(clients: ClientPolicy | None, seed: int = 3) -> Engine:
    """Poisson arrivals of 10-call sessions at ~5x what a 1P1D tiny deployment with 12k of decode serves."""
    rng = random.Random(seed)
    engine = Engine(deployment(decode_tokens=12_000), Recording(), tick_s=10.0, clients=clients, client_seed=seed)
    t, prompts = 0.0, [2_000 + 300 * k for k in range(10)]
    while (t := t + rng.expovariate(1.0)) < 600.0:
        engine.add(spec(session(f"s{len(engine.runs):04d}", prompts, completion=200, gap_s=2.0), arrival_s=t))
    return engine


def test_under_overload_timeouts_bound_the_live_sessions_while_timeouts_and_retries_rise() -> None:
    stages: Counter[Stage] = Counter()
    results = {}
    for name, clients in (("none", None), ("clients", ClientPolicy(call_timeout_s=30.0, max_retries=1,
                                                                   harness_attempts=2))):
        engine = overloaded(clients)
        withdraw = engine.flow.withdraw

        def watched(request: Request, withdraw: Callable[[Request], None] = withdraw) -> None:
            stages[request.stage] += 1
            withdraw(request)

        engine.flow.withdraw = watched  # type: ignore[method-assign]
        for minute in range(1, 11):
            engine.run_until(60.0 * minute)
            engine.check()
        results[name] = engine
    live_none = results["none"].timeline.bin_state_series("live_sessions")
    live = results["clients"].timeline.bin_state_series("live_sessions")
    assert len(live) == len(live_none) == 10
    assert live_none[9] > 1.8 * live_none[4] and live_none[9] > 300  # without timeouts: grows without bound
    assert max(live[4:]) < 1.3 * max(live[:4]) and live[9] < live_none[9] / 3  # with them: levels off
    timeline = results["clients"].timeline
    timeouts, retries = timeline.count_series("timeouts"), timeline.count_series("retries")
    assert sum(timeouts[5:10]) > sum(timeouts[:5]) > 0 and sum(retries[5:10]) > 0
    assert sum(timeline.count_series("abandoned")) > 0
    assert sum(results["none"].timeline.count_series("timeouts")) == 0
    # FCFS serves the oldest first, so attempts time out once granted: while prefilling or decoding.
    assert {Stage.PREFILLING, Stage.DECODING} <= set(stages)
    assert sum(results["clients"].timeline.count_series("completions")) == 0  # bounded, but nothing is good
    queued = {name: engine.timeline.bin_state_series("prealloc_queued")[9] for name, engine in results.items()}
    assert queued["none"] > 500 and queued["clients"] < 200


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_with_clients_keep_every_invariant_and_end_empty(seed: int) -> None:
    """Scripted random runs: small memories, 2P2D, pins and lending on or off, kills, time limits."""
    rng = random.Random(seed)
    policy = Recording(pin_ttl_s=rng.choice([None, 3.0]))
    lending: LendingKind = "decode-memory" if rng.random() < 0.5 else "none"
    clients = ClientPolicy(call_timeout_s=rng.uniform(1.0, 6.0), max_retries=rng.randrange(3),
                           harness_attempts=rng.randrange(1, 3), harness_wait_min_s=1.0, harness_wait_max_s=2.0,
                           session_time_limit_s=rng.choice([None, 40.0]))
    d = deployment(cache_tokens=12_000, decode_tokens=14_000, host_tokens=rng.choice([0, 6_000]),
                   num_prefill=2, num_decode=2, lending=lending)
    engine = Engine(d, policy, tick_s=1.0, clients=clients, client_seed=seed, router_seed=seed)
    t = 0.0
    while (t := t + rng.expovariate(1.5)) < 60.0:
        prompts = sorted(rng.randrange(600, 5_000) for _ in range(rng.randrange(1, 6)))
        engine.add(spec(session(f"s{len(engine.runs):03d}", prompts, completion=rng.randrange(10, 300),
                                gap_s=rng.uniform(0.0, 3.0)), arrival_s=t, is_burst=rng.random() < 0.2))
    engine.kill_at(30.0, [sid for sid, run in engine.runs.items() if run.spec.is_burst])
    for step in range(1, 1_201):
        engine.run_until(step * 0.25)
        engine.check()
    assert all(run.is_over for run in engine.runs.values())
    assert policy.ended == Counter(list(engine.runs))  # every session told once, however it ended
    assert sum(engine.timeline.count_series("timeouts")) > 0
    assert_empty(engine)

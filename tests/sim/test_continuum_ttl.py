"""Continuum's TTL rule (policies/continuum_ttl.py): tau* on hand-made samples, its online terms, and the
policy that measures them in a run (policies/continuum.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.lifecycle import Stage, Status
from basin_sim.policies import ContinuumPolicy, PolicyContext, make_policy
from basin_sim.policies.continuum_ttl import (
    COLD_START_SAMPLES,
    DEFAULT_TTL_S,
    PROGRAM_WINDOW,
    QUEUE_WINDOW,
    EtaWindow,
    GapHull,
    TtlEstimator,
    best_ttl,
    memoryfulness,
    reload_s,
)
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import policy_context
from tests.sim.builders import TINY, deployment, session, spec, until_answered, with_profile

# TINY: a prefill batch costs 10 ms + 0.1 ms per computed token, 4,096 tokens a batch; load-back 1 us a token.
RELOAD_10K_S = 3 * 0.01 + 10_000 * 1e-4  # three chunks: 1.03 s
HOST_10K_S = 10_000 * 1e-6  # 0.01 s


# --- the argmax of Eq. (2) ---------------------------------------------------------------------------

def test_when_every_gap_is_short_next_to_the_reload_the_ttl_covers_them_all() -> None:
    assert best_ttl([1.0, 2.0, 3.0], 10.0) == (3.0, 1.0, pytest.approx(7.0))


def test_gaps_far_longer_than_the_reload_is_worth_get_no_pin() -> None:
    assert best_ttl([60.0, 120.0, 300.0], 1.0) == (0.0, 0.0, 0.0)


def test_a_larger_reload_buys_a_longer_ttl() -> None:
    gaps = [0.1] * 50 + [1.0] * 30 + [10.0] * 20  # U = 0.5B - 0.1, 0.8B - 1, B - 10
    assert [best_ttl(gaps, b)[0] for b in (0.1, 5.0, 100.0)] == [0.0, 1.0, 10.0]


def test_the_cdf_counts_duplicates_zero_gaps_count_at_tau_zero_and_a_tie_keeps_the_shorter_ttl() -> None:
    assert best_ttl([1.0, 1.0, 1.0, 5.0], 2.0) == (1.0, 0.75, pytest.approx(0.5))
    assert best_ttl([0.0, 0.0, 4.0, 9.0], 2.0) == (0.0, 0.5, 1.0)
    assert best_ttl([1.0, 2.0], 2.0)[0] == 0.0  # U(0) = U(1) = U(2) = 0


@pytest.mark.parametrize("gaps", [[], [1.0, -0.5], [math.nan]])
def test_best_ttl_rejects_an_empty_or_bad_sample(gaps: list[float]) -> None:
    with pytest.raises(ValueError):
        best_ttl(gaps, 1.0)


# --- the terms -----------------------------------------------------------------------------------------

def test_the_reload_is_the_context_prefilled_alone_chunk_by_chunk_or_its_load_back() -> None:
    assert reload_s(TINY, 0, False) == 0.0
    assert reload_s(TINY, 4_096, False) == pytest.approx(0.01 + 0.4096)
    assert reload_s(TINY, 10_000, False) == pytest.approx(RELOAD_10K_S)
    assert reload_s(TINY, 10_000, True) == pytest.approx(HOST_10K_S)


def test_the_reload_counts_attention_pairs_of_every_chunk() -> None:
    profile = with_profile(prefill_attention_pair_s=1e-9)
    pairs = 10_000 * 10_000 / 2  # chunk pairs computed * (before + computed / 2) sum to c^2 / 2
    assert reload_s(profile, 10_000, False) == pytest.approx(RELOAD_10K_S + pairs * 1e-9)


def test_memoryfulness_is_minus_the_correlation_of_calls_done_and_calls_left() -> None:
    assert memoryfulness([5, 5, 5]) == pytest.approx(1.0)  # one length: k and N - k move together exactly
    assert 0.0 < memoryfulness([2, 10]) < 1.0
    assert memoryfulness([1, 1]) == 0.0 and memoryfulness([]) == 0.0  # no boundary: undefined


def _correlation_by_hand(lengths: list[int]) -> float:
    ks = [k for n in lengths for k in range(1, n)]
    left = [n - k for n in lengths for k in range(1, n)]
    mk, ml = sum(ks) / len(ks), sum(left) / len(left)
    cov = sum((a - mk) * (b - ml) for a, b in zip(ks, left, strict=True))
    var = (sum((a - mk) ** 2 for a in ks) * sum((b - ml) ** 2 for b in left)) ** 0.5
    return -cov / var


def test_the_eta_window_keeps_running_sums_of_the_last_programs_only() -> None:
    window = EtaWindow(size=3)
    for n in (2, 10, 40, 3, 7):
        window.add(n)
    assert window.eta() == pytest.approx(_correlation_by_hand([40, 3, 7]))  # 2 and 10 slid out
    assert EtaWindow().eta() == 0.0 and PROGRAM_WINDOW == 256
    with pytest.raises(ValueError, match=">= 1 call"):
        window.add(0)


@given(st.lists(st.integers(1, 60), min_size=1, max_size=40))
def test_the_running_eta_is_the_correlation_of_its_programs(lengths: list[int]) -> None:
    pairs = sum(n - 1 for n in lengths)
    distinct = {k for n in lengths for k in range(1, n)}
    want = 0.0 if pairs < 2 or len(distinct) < 2 else _correlation_by_hand(lengths)
    assert memoryfulness(lengths) == pytest.approx(want, abs=1e-9)


# --- the hull: the same argmax as the scan, O(log n) per call --------------------------------------------

gap_values = st.one_of(st.just(0.0), st.floats(0.001, 100.0), st.sampled_from([0.5, 1.0, 2.0]))


@given(st.lists(gap_values, min_size=1, max_size=60), st.floats(-1.0, 500.0))
def test_the_hull_finds_the_scans_argmax(gaps: list[float], benefit: float) -> None:
    tau, share, utility = GapHull(sorted(gaps)).best(benefit)
    want = best_ttl(gaps, benefit)
    assert utility == pytest.approx(want[2], abs=1e-9)
    assert (tau, share) == (want[0], pytest.approx(want[1]))  # the same point: a tie keeps the shorter TTL


def test_a_hull_needs_a_gap() -> None:
    with pytest.raises(ValueError, match="at least one"):
        GapHull([])


# --- the online estimator -------------------------------------------------------------------------------

def test_with_at_most_k_durations_seen_the_ttl_is_t_default() -> None:
    rule = TtlEstimator(TINY, False)
    assert rule.choose(10_000).ttl_s == DEFAULT_TTL_S
    for _ in range(COLD_START_SAMPLES):
        rule.observe_tool(30.0)
    assert (rule.choose(10_000).source, rule.choose(10_000).ttl_s) == ("cold-start", DEFAULT_TTL_S)
    rule.observe_tool(30.0)
    choice = rule.choose(10_000)
    assert (choice.source, choice.ttl_s, choice.num_gaps) == ("global-cdf", 0.0, COLD_START_SAMPLES + 1)


def _warm(rule: TtlEstimator, gaps: list[float]) -> TtlEstimator:
    for gap in gaps:
        rule.observe_tool(gap)
    return rule


def test_each_call_gets_the_ttl_its_own_context_is_worth() -> None:
    rule = _warm(TtlEstimator(TINY, False), [0.2] * 120 + [0.9] * 80)  # U(0.2) = 0.6B - 0.2, U(0.9) = B - 0.9
    small, medium, large = rule.choose(2_000), rule.choose(10_000), rule.choose(30_000)
    assert small.reload_s == pytest.approx(reload_s(TINY, 2_000, False)) and small.ttl_s == 0.0  # B = 0.21 s
    assert medium.reload_s == pytest.approx(RELOAD_10K_S) and medium.ttl_s == 0.2  # B = 1.03 s
    assert large.reload_s == pytest.approx(reload_s(TINY, 30_000, False)) and large.ttl_s == 0.9  # B = 3.08 s
    assert (medium.queue_delay_s, medium.eta, medium.finish_share) == (0.0, 0.0, 0.6)


def test_the_queue_delay_of_evicted_re_entries_times_eta_buys_a_longer_ttl() -> None:
    rule = _warm(TtlEstimator(TINY, False), [0.2] * 120 + [5.0] * 80)
    assert rule.choose(10_000).ttl_s == 0.2  # B = 1.03 s: U(5) = 1.03 - 5 < 0
    for n in (5, 5, 5):
        rule.observe_completed(n)  # one length: eta = 1
    for wait in (19.0, 21.0):
        rule.observe_evicted_wait(wait)
    choice = rule.choose(10_000)
    assert (choice.queue_delay_s, choice.eta) == (pytest.approx(20.0), pytest.approx(1.0))
    assert choice.benefit_s == pytest.approx(20.0 + RELOAD_10K_S) and choice.ttl_s == 5.0  # B - 5 > 0.6 B - 0.2


def test_the_queue_delay_is_a_sliding_mean_of_the_last_window() -> None:
    rule = TtlEstimator(TINY, False)
    for wait in [100.0] * 10 + [1.0] * QUEUE_WINDOW:
        rule.observe_evicted_wait(wait)
    assert rule.queue_delay_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        rule.observe_evicted_wait(-1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        rule.observe_tool(math.inf)


def test_a_cheap_host_reload_turns_the_pin_off_where_a_recompute_keeps_it() -> None:
    gaps = [0.2] * 120 + [30.0] * 80
    assert _warm(TtlEstimator(TINY, False), gaps).choose(10_000).ttl_s == 0.2  # 0.6 x 1.03 s - 0.2 s > 0
    assert _warm(TtlEstimator(TINY, True), gaps).choose(10_000).ttl_s == 0.0  # 0.6 x 0.01 s < 0.2 s


# --- the policy in a run ---------------------------------------------------------------------------------

def _continuum(d: object, fixed: float | None = None) -> ContinuumPolicy:
    policy = make_policy("continuum", PolicyContext(d, pin_ttl_s=fixed))  # type: ignore[arg-type]
    assert isinstance(policy, ContinuumPolicy)
    return policy


def test_cold_start_pins_each_answer_for_t_default_and_the_pin_expires_after_it() -> None:
    d = deployment()
    policy = _continuum(d)
    engine = Engine(d, policy, tick_s=0.05)
    assert engine.pins is policy
    engine.add(spec(session("a", [2_000, 3_000], gap_s=3.0), 0.0))
    cache = engine.prefill[0].cache
    while (request := engine.runs["a"].request) is None or request.stage != Stage.DECODING:
        engine.run_until(engine.now + 0.001)
    assert cache.is_held("a") and cache.held_tokens == 0  # held until the answer: not yet between calls
    t = until_answered(engine, "a", 1)
    engine.run_until(t + DEFAULT_TTL_S - 0.1)
    assert cache.is_held("a") and cache.held_tokens > 0  # answered, within T_default
    engine.run_until(t + DEFAULT_TTL_S + 0.1)
    assert not cache.is_held("a") and cache.pinned_tokens == 0  # the TTL passed, the tool still runs


def test_a_tool_that_outlives_its_pin_is_an_evicted_re_entry_and_its_wait_to_prefill_is_a_sample_of_t() -> None:
    d = deployment()
    policy = _continuum(d)
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=3.0), 0.0))  # 3 s tools > T_default 2 s
    engine.run_until(30.0)
    assert engine.runs["a"].status == Status.FINISHED
    assert policy.evicted_reentries == 2 and policy.estimator.num_gaps == 2
    assert policy.estimator.queue_delay_s == 0.0  # alone: both re-entries were scheduled at once
    report = policy.report().pins
    assert report is not None and policy.report().reservations is None
    assert report.pin_answers == 2 and report.pin_ttl_mean_s == DEFAULT_TTL_S
    assert report.pin_tool_time_share == pytest.approx(DEFAULT_TTL_S / 3.0, rel=0.01)
    assert report.pin_eta == 1.0  # one completed program: its boundaries (1, 2) and (2, 1)


def test_an_evicted_re_entry_behind_another_prefill_measures_its_wait() -> None:
    d = deployment()
    policy = _continuum(d)
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=3.0), 0.0))
    t = until_answered(engine, "a", 1, step=0.001)
    engine.add(spec(session("b", [40_000]), t + 2.9))  # ten 4,096-token chunks (0.42 s each) from a's return
    engine.run_until(60.0)
    assert policy.evicted_reentries == 2
    # the first re-entry waited for the rest of b's chunked prefill (~3.7 s: a chunked request goes on first,
    # as in SGLang), the second for nothing: T is their mean
    assert 1.6 < policy.estimator.queue_delay_s < 2.0


def test_a_completed_program_feeds_eta_and_an_unfinished_one_does_not() -> None:
    d = deployment()
    policy = _continuum(d)
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000, 4_000], gap_s=0.5), 0.0))
    engine.add(spec(session("b", [2_000, 3_000, 4_000, 5_000], gap_s=0.5), 0.0))
    engine.kill_at(1.0, ["b"])
    engine.run_until(30.0)
    assert engine.runs["a"].status == Status.FINISHED and engine.runs["b"].status == Status.KILLED
    assert policy.estimator.eta == pytest.approx(memoryfulness([3]))


def test_a_tool_within_its_pin_is_no_re_entry_and_the_last_answer_is_never_pinned() -> None:
    d = deployment()
    policy = _continuum(d)
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=0.5), 0.0))
    engine.run_until(30.0)
    assert engine.runs["a"].status == Status.FINISHED and policy.evicted_reentries == 0
    assert policy.answers == 1 and (pins := policy.report().pins) is not None
    assert pins.pin_tool_time_share == 1.0
    assert engine.prefill[0].cache.pinned_tokens == 0


def test_an_explicit_pin_ttl_pins_every_answer_for_that_long() -> None:
    d = deployment()
    policy = _continuum(d, 5.0)
    assert policy.fixed_ttl_s == 5.0
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=8.0), 0.0))
    t = until_answered(engine, "a", 1)
    engine.run_until(t + 4.9)
    assert engine.prefill[0].cache.is_held("a")
    engine.run_until(t + 5.1)
    assert not engine.prefill[0].cache.is_held("a")
    with pytest.raises(ValueError, match="pin_ttl_s must be > 0"):
        ContinuumPolicy(d, 0.0)


def test_the_simulator_hands_a_set_ttl_through_and_otherwise_the_online_rule_runs() -> None:
    d = catalog.load_deployment("1p3d-h100").build("gpu")
    run = RunSpec(catalog.load_scenario("steady"), d, "continuum", 1, 0.4)
    online = make_policy("continuum", policy_context(run))
    assert isinstance(online, ContinuumPolicy) and online.fixed_ttl_s is None
    set_ttl = RunSpec(catalog.load_scenario("steady"), d, "continuum", 1, 0.4, pin_ttl_s=7.0)
    fixed = make_policy("continuum", policy_context(set_ttl))
    assert isinstance(fixed, ContinuumPolicy) and fixed.fixed_ttl_s == 7.0

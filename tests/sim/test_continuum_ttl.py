"""Continuum's TTL rule (policies/continuum_ttl.py): tau* on hand-made gap samples, and its use in a run."""

from __future__ import annotations

import math

import pytest

from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.policies import ContinuumPolicy, PolicyContext, make_policy
from basin_sim.policies.continuum_ttl import (
    COLD_START_SAMPLES,
    DEFAULT_TTL_S,
    best_ttl,
    continuum_ttl,
    memoryfulness,
    reload_s,
)
from basin_sim.simulate import RunSpec, policy_context, tool_calls
from tests.sim.builders import TINY, deployment, session, spec, with_profile

# TINY: a prefill batch costs 10 ms + 0.1 ms per computed token, 4,096 tokens a batch; load-back 1 us a token.
RELOAD_10K_S = 3 * 0.01 + 10_000 * 1e-4  # three chunks: 1.03 s
HOST_10K_S = 10_000 * 1e-6  # 0.01 s


def _sample(gaps_s: list[float], prompt_tokens: int = 10_000) -> tuple[tuple[tuple[float, int], ...], ...]:
    """Three-call sessions (two gaps each, in order), every prompt before a gap `prompt_tokens`."""
    return tuple(tuple((g, prompt_tokens) for g in gaps_s[i:i + 2]) for i in range(0, len(gaps_s), 2))


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


def test_the_ttl_of_a_run_uses_the_mean_benefit_of_its_calls_and_the_queue_delay_times_eta() -> None:
    d = deployment()
    gaps = [0.2] * 120 + [0.9] * 80  # U(0.2) = 0.6B - 0.2, U(0.9) = B - 0.9
    choice = continuum_ttl(_sample(gaps), d)
    assert (choice.source, choice.num_gaps, choice.ttl_s) == ("global-cdf", 200, 0.2)
    assert choice.reload_s == pytest.approx(RELOAD_10K_S) and choice.benefit_s == pytest.approx(RELOAD_10K_S)
    assert choice.eta == pytest.approx(1.0) and choice.finish_share == 0.6
    # a queue delay makes the benefit larger (eta = 1 here): B = 2.78 s covers the 0.9 s gaps too
    assert continuum_ttl(_sample(gaps), d, queue_delay_s=1.75).ttl_s == 0.9


def test_a_cheap_host_reload_turns_the_pin_off_where_a_recompute_keeps_it() -> None:
    gaps = [0.2] * 120 + [30.0] * 80
    assert continuum_ttl(_sample(gaps), deployment()).ttl_s == 0.2  # 0.6 x 1.03 s - 0.2 s > 0
    assert continuum_ttl(_sample(gaps), deployment(host_tokens=100_000)).ttl_s == 0.0  # 0.6 x 0.01 s < 0.2 s


def test_with_at_most_k_gaps_seen_the_ttl_is_t_default() -> None:
    d = deployment()
    few = continuum_ttl(_sample([30.0] * COLD_START_SAMPLES), d)
    assert (few.source, few.ttl_s) == ("cold-start", DEFAULT_TTL_S)
    assert continuum_ttl((), d).ttl_s == DEFAULT_TTL_S
    assert continuum_ttl(_sample([30.0] * (COLD_START_SAMPLES + 1)), d).ttl_s == 0.0


# --- the policy and the run ----------------------------------------------------------------------------

def test_the_policy_pins_for_tau_star_in_a_run_and_the_pin_expires_after_it() -> None:
    d = deployment()
    policy = make_policy("continuum", PolicyContext(d, tool_calls=_sample([0.5] * 150)))
    assert isinstance(policy, ContinuumPolicy) and policy.pin_ttl_s == 0.5
    assert policy.ttl_choice is not None and policy.ttl_choice.ttl_s == 0.5
    engine = Engine(d, policy, tick_s=0.05)
    assert engine.pin_ttl_s == 0.5
    engine.add(spec(session("a", [2_000, 3_000], gap_s=3.0), 0.0))
    t = 0.0
    while engine.runs["a"].next_call == 0:
        t += 0.01
        engine.run_until(t)
    cache = engine.prefill[0].cache
    engine.run_until(t + 0.4)
    assert cache.is_held("a")  # answered, within tau*
    engine.run_until(t + 0.7)
    assert not cache.is_held("a") and cache.pinned_tokens == 0  # tau* passed, the tool still runs


def test_tau_star_zero_means_no_pin_at_all() -> None:
    d = deployment()
    policy = make_policy("continuum", PolicyContext(d, tool_calls=_sample([60.0] * 150)))
    assert policy.pin_ttl_s is None
    engine = Engine(d, policy, tick_s=0.05)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=3.0), 0.0))
    engine.run_until(2.8)
    assert engine.runs["a"].next_call == 1 and not engine.prefill[0].cache.is_held("a")


def test_an_explicit_pin_ttl_wins_over_the_rule() -> None:
    d = deployment()
    policy = make_policy("continuum", PolicyContext(d, pin_ttl_s=5.0, tool_calls=_sample([60.0] * 150)))
    assert isinstance(policy, ContinuumPolicy) and policy.pin_ttl_s == 5.0 and policy.ttl_choice is None
    with pytest.raises(ValueError, match="pin_ttl_s must be > 0"):
        ContinuumPolicy(0.0)


def test_the_simulator_hands_the_runs_gaps_and_prompts_to_the_rule_and_a_set_ttl_through() -> None:
    d = catalog.load_deployment("1p3d-h100").build("gpu")
    sessions = [spec(session(f"s{i}", [20_000 + 1_000 * i, 30_000, 40_000], gap_s=0.001 * (i + 1)), float(i))
                for i in range(60)]
    assert tool_calls(sessions[:1]) == (((0.001, 20_000), (0.001, 30_000)),)
    run = RunSpec(catalog.load_scenario("steady"), d, "continuum", 1, 0.4)
    context = policy_context(run, sessions)
    policy = make_policy("continuum", context)
    want = continuum_ttl(tool_calls(sessions), d)
    assert want.source == "global-cdf" and want.ttl_s > 0
    assert policy.pin_ttl_s == want.ttl_s
    set_ttl = RunSpec(catalog.load_scenario("steady"), d, "continuum", 1, 0.4, pin_ttl_s=7.0)
    assert make_policy("continuum", policy_context(set_ttl, sessions)).pin_ttl_s == 7.0

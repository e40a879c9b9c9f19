"""Whole runs on a small deployment: a surge pushes the working set over the cache and the hit rate
falls; the same seed gives the same summary; the run JSON's fields by hand-checkable numbers."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from basin_runtime.session_table import Session, write_sessions
from basin_sim.catalog import load_profile
from basin_sim.engine import Engine
from basin_sim.experiments import cli, run_setup
from basin_sim.policies.fcfs import FcfsPolicy
from basin_sim.profile import Deployment
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import ArrivalFeed, RunResult, run_scenario
from basin_sim.timeline import Timeline
from basin_sim.workload.scenarios import (
    BurstSpec,
    PopulationSpec,
    RateStep,
    Scenario,
    ScenarioError,
    burst_kills,
    generate_sessions,
)
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import deployment, session, spec

POOL = generate_corpus(3, 40)
CACHE_TOKENS = 200_000
SMALL = Deployment("small", load_profile("h100-qwen3.6-35b-a3b"), 1, 1, CACHE_TOKENS, 1_300_000)
WARMUP_S = 600.0


def run(surge_x: float | None, seed: int = 1, policy: str = "sglang") -> RunResult:
    steps = [RateStep(0.0, 1.0)]
    if surge_x:
        steps += [RateStep(600.0, surge_x), RateStep(1_800.0, 1.0)]
    scenario = Scenario("small", duration_s=3_000.0, warmup_s=WARMUP_S, goodput_from_s=1_800.0,
                        goodput_to_s=3_000.0, rate=tuple(steps))
    return run_scenario(RunSpec(scenario, SMALL, policy, seed, 0.03, max_drain_s=600.0), POOL)


def surge_window(result: RunResult) -> tuple[float, int]:
    start, end = WARMUP_S + 600.0, WARMUP_S + 1_800.0
    samples = [s.working_set_tokens for s in result.timeline.samples if start <= s.time_s < end]
    rate = result.timeline.hit_rate(start, end)
    assert rate is not None
    return rate, max(samples)


def test_a_surge_raises_the_working_set_over_the_cache_and_lowers_the_hit_rate() -> None:
    steady, surged = run(None), run(4.0)
    steady_hit, steady_ws = surge_window(steady)
    surge_hit, surge_ws = surge_window(surged)
    assert steady_ws < CACHE_TOKENS and steady_hit > 0.9
    assert surge_ws > 2 * CACHE_TOKENS and surge_hit < steady_hit - 0.3
    assert surged.summary["hit_rate_pre"] > 0.9  # the same before the surge
    assert not steady.summary["is_stuck"]


def test_the_same_seed_gives_the_same_summary() -> None:
    first, again, other = run(4.0, seed=7), run(4.0, seed=7), run(4.0, seed=8)
    assert first.summary == again.summary
    assert first.outcomes == again.outcomes
    assert other.summary != first.summary


def test_the_summary_counts_window_sessions_and_the_timeline_starts_after_warmup() -> None:
    result = run(4.0)
    summary, window = result.summary, (WARMUP_S + 1_800.0, WARMUP_S + 3_000.0)
    arrived = [o for o in result.outcomes if not o.is_burst and window[0] <= o.arrival_s < window[1]]
    assert summary["sessions_arrived"] == len(arrived) > 0
    assert summary["goodput_per_hour"] == pytest.approx(summary["sessions_good"] / (1_200.0 / 3600.0))
    assert summary["base_rate_per_s"] == pytest.approx(0.03)
    timeline = summary["timeline"]
    assert timeline[0]["t_s"] == 0.0 and [e["t_s"] for e in timeline[:3]] == [0.0, 60.0, 120.0]
    assert len(timeline) == int(summary["simulated_s"] // 60)
    after_warmup = [o for o in result.outcomes if WARMUP_S <= o.arrival_s < WARMUP_S + 60.0 * len(timeline)]
    assert sum(e["arrivals"] for e in timeline) == len(after_warmup)  # warm-up arrivals are in no minute
    assert all(e["cache_tokens"] == CACHE_TOKENS for e in timeline)
    assert result.timeline.hit_rate(WARMUP_S, WARMUP_S + 60.0) == timeline[0]["hit_rate"]


def test_the_prefill_busy_fraction_is_batch_time_over_the_window() -> None:
    engine = Engine(deployment(), FcfsPolicy("sglang"), tick_s=None)
    engine.add(spec(session("a", [2_000])))  # one uncached 2,000-token prefill: 10 ms + 2,000 x 0.1 ms
    engine.run_until(100.0)
    (batch,) = engine.prefill[0].busy_intervals
    assert batch == (0.0, pytest.approx(0.21))
    assert engine.prefill[0].busy_s(0.0, 100.0) == pytest.approx(0.21)
    assert engine.prefill[0].busy_s(0.1, 100.0) == pytest.approx(0.11)  # only the overlap counts
    summary = run(4.0).summary
    assert 0 < summary["prefill_busy_fraction"] <= 1


def _tiny_run(scenario: Scenario, dep: Deployment, pool: list, seed: int = 1) -> RunResult:  # type: ignore[type-arg]
    return run_scenario(RunSpec(scenario, dep, "sglang", seed, 0.0, max_drain_s=600.0), pool)


def test_a_closed_population_keeps_its_agents_busy_back_to_back() -> None:
    # One agent, one kind of session (two calls, 100 tokens each answer, a 1 s tool gap): alone on the
    # tiny deployment it takes its unloaded time, so each session starts when the last one ends.
    pool = [session("only", [2_000, 2_300], completion=100, gap_s=1.0)]
    scenario = Scenario("closed", duration_s=600.0, warmup_s=60.0, goodput_from_s=0.0, goodput_to_s=600.0,
                        population=PopulationSpec(agents=1))
    result = _tiny_run(scenario, deployment(), pool)
    runs = sorted(result.outcomes, key=lambda o: o.arrival_s)
    assert all(b.arrival_s == pytest.approx(a.ended_s) for a, b in itertools.pairwise(runs))
    summary = result.summary
    in_window = [o for o in runs if 60.0 <= o.arrival_s < 660.0]
    assert summary["sessions_arrived"] == len(in_window) == summary["sessions_good"]  # alone: all good
    assert summary["goodput_per_hour"] == pytest.approx(len(in_window) / (600.0 / 3600.0))
    assert summary["sessions_shed"] == summary["sessions_abandoned"] == 0
    assert 0 < summary["first_call_wait_p50_s"] <= 0.217  # prefill 0.21 s + transfer 0.007 s at most
    assert all(e["live_sessions"] <= 1 for e in summary["timeline"])


def test_three_prefills_share_the_calls_and_the_json_has_every_field() -> None:
    pool = generate_corpus(3, 20)
    three = deployment(cache_tokens=400_000, decode_tokens=2_000_000, num_prefill=3, num_decode=2)
    scenario = Scenario("steady", duration_s=1_200.0, warmup_s=120.0, goodput_from_s=300.0, goodput_to_s=1_200.0,
                        rate=(RateStep(0.0, 1.0),))
    summary = run_scenario(RunSpec(scenario, three, "sglang", 1, 0.05, max_drain_s=300.0), pool).summary
    shares = summary["prefill_share"]
    assert len(shares) == 3 and sum(shares) == pytest.approx(1.0) and min(shares) > 0.15
    for key in ("goodput_per_hour", "sessions_arrived", "sessions_good", "sessions_shed", "sessions_abandoned",
                "base_rate_per_s", "hit_rate_pre", "hit_rate_post", "first_call_wait_p50_s", "ttft_p50_post_s",
                "prefill_busy_fraction", "recovered_after_s", "backlog_drained_after_s", "is_stuck", "timeline",
                "prefill_share"):
        assert key in summary, key
    entry = summary["timeline"][0]
    assert set(entry) == {"t_s", "hit_rate", "live_sessions", "live_burst_sessions", "held_sessions",
                          "working_set_tokens", "cache_tokens", "ttft_p50_s", "arrivals", "completions", "queued",
                          "timeouts", "retries", "first_call_wait_p50_s"}
    assert entry["cache_tokens"] == 3 * 400_000 and summary["base_rate_per_s"] == pytest.approx(0.05)


# --- absolute rates (`per_min`) -------------------------------------------------------------------

def _surge(steps: tuple[RateStep, ...], bursts: tuple[BurstSpec, ...] = ()) -> Scenario:
    return Scenario("abs", duration_s=3_000.0, warmup_s=600.0, goodput_from_s=1_800.0, goodput_to_s=3_000.0,
                    rate=steps, bursts=bursts)


BURST = (BurstSpec(600.0, 1_200.0, 2.0, max_unloaded_s=1e9),)


def _one_s(_: Session) -> float:
    return 1.0  # every pool session a burst candidate


def test_per_min_segments_draw_the_same_arrivals_as_the_equal_x_overload_rate() -> None:
    # 0.05 sessions/s x {1, 4, 1} is 3, 12, 3 sessions per minute; the burst is x_base x the first rate either way.
    relative = _surge((RateStep(0.0, 1.0), RateStep(600.0, 4.0), RateStep(1_800.0, 1.0)), BURST)
    absolute = _surge((RateStep(0.0, per_min=3.0), RateStep(600.0, per_min=12.0), RateStep(1_800.0, per_min=3.0)),
                      BURST)
    mixed = _surge((RateStep(0.0, per_min=3.0), RateStep(600.0, 4.0), RateStep(1_800.0, per_min=3.0)), BURST)
    assert not absolute.needs_overload_rate and mixed.needs_overload_rate
    expected = generate_sessions(relative, POOL, 0.05, 3, _one_s)
    assert sum(s.is_burst for s in expected) > 0
    assert generate_sessions(absolute, POOL, 0.0, 3, _one_s) == expected
    assert generate_sessions(absolute, POOL, 99.0, 3, _one_s) == expected  # the overload rate is never read
    assert generate_sessions(mixed, POOL, 0.05, 3, _one_s) == expected
    with pytest.raises(ScenarioError, match=r"scenario 'abs' has x_overload segments: overload_rate_per_s must be "
                                            r"> 0, got 0.0"):
        generate_sessions(mixed, POOL, 0.0, 3, _one_s)


def test_a_run_at_per_min_needs_no_overload_rate_and_reports_its_base_rate() -> None:
    scenario = _surge((RateStep(0.0, per_min=1.8),))
    result = run_scenario(RunSpec(scenario, SMALL, "sglang", 1, 0.0, max_drain_s=600.0), POOL)
    assert result.summary["base_rate_per_s"] == pytest.approx(0.03)
    arrived = sum(e["arrivals"] for e in result.summary["timeline"][:50])  # 50 minutes after warm-up at 1.8/min
    assert 50 * 1.8 * 0.7 < arrived < 50 * 1.8 * 1.3


@pytest.mark.parametrize(("step", "message"), [
    (RateStep(0.0), r"rate\[0\] needs exactly one of x_overload .* got x_overload=None, per_min=None"),
    (RateStep(0.0, 1.0, 3.0), r"rate\[0\] needs exactly one of .* got x_overload=1.0, per_min=3.0"),
    (RateStep(0.0, per_min=-3.0), r"rate\[0\]\.per_min must be >= 0, got -3.0"),
    (RateStep(0.0, per_min=float("nan")), r"rate\[0\]\.per_min must be >= 0, got nan"),
])
def test_a_rate_segment_gives_exactly_one_valid_rate(step: RateStep, message: str) -> None:
    with pytest.raises(ScenarioError, match=rf"scenario 'abs': {message}"):
        _surge((step,))
    with pytest.raises(ScenarioError, match=message.replace("0", "1", 1)):
        _surge((RateStep(0.0, per_min=1.0), dataclasses.replace(step, from_s=60.0)))


def test_the_cli_runs_a_per_min_scenario_without_calibrating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def no_calibration(*_: object) -> tuple[float, str]:
        raise AssertionError("an all-per_min scenario asked for an overload rate")

    monkeypatch.setattr(run_setup, "overload_rate_for", no_calibration)
    (tmp_path / "s.yaml").write_text("name: abs\nduration_s: 600\nwarmup_s: 60\nrate:\n  - {from_s: 0, per_min: 2}\n"
                                     "goodput_window: {from_s: 0, to_s: 600}\n")
    write_sessions(tmp_path / "sessions.parquet", generate_corpus(2, 10))
    rates = tmp_path / "rates.json"
    argv = ["run", "--scenario", str(tmp_path / "s.yaml"), "--deployment", "1p1d", "--policy", "sglang", "--json",
            "--quiet", "--sessions", str(tmp_path / "sessions.parquet"), "--rates-file", str(rates)]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["overload_rate_source"] == "no x_overload segment (no overload rate)"
    assert summary["base_rate_per_s"] == pytest.approx(2 / 60) and summary["overload_rate_per_s"] == 0.0
    assert not rates.exists()


def test_feeding_arrivals_a_step_ahead_changes_no_event() -> None:
    # run_scenario adds open arrivals one step ahead of the clock; the same run with every arrival added
    # at the start (as before) must end every session the same way at the same time, kills included.
    scenario = _surge((RateStep(0.0, per_min=1.8), RateStep(600.0, per_min=7.2)),
                      (BurstSpec(600.0, 1_200.0, 3.0, max_unloaded_s=1e9, kill_at_s=900.0),))
    sessions = generate_sessions(scenario, POOL, 0.0, 5, _one_s)
    end_s, kills = scenario.engine_s(scenario.duration_s), burst_kills(scenario, sessions)

    def engine() -> Engine:
        return Engine(SMALL, FcfsPolicy("sglang"), timeline=Timeline(60.0), router_seed=5)

    upfront = engine()
    for spec_ in sessions:
        upfront.add(spec_)
    for at_s, ids in kills:
        upfront.kill_at(at_s, ids)
    upfront.run_until(end_s)
    fed = engine()
    arrivals_s = {s.session_id: s.arrival_s for s in sessions}
    for at_s, ids in kills:
        fed.kill_at(at_s, [sid for sid in ids if arrivals_s[sid] <= at_s])
    feed = ArrivalFeed(fed, sessions)
    most_ahead = 0
    while fed.now < end_s:  # as run_scenario's loop does it
        feed.add_until(min(fed.now + 60.0, end_s))
        most_ahead = max(most_ahead, sum(run.status.value == "arriving" for run in fed.runs.values()))
        fed.run_until(min(fed.now + 60.0, end_s))
    assert feed.is_done and most_ahead < len(sessions) / 10  # the heap held a step of arrivals, not the run's

    def ends(e: Engine) -> list[tuple[str, str, float | None, int, float]]:
        return [(sid, r.status.value, r.ended_s, r.next_call, r.steps) for sid, r in sorted(e.runs.items())]
    assert ends(fed) == ends(upfront) and sum(r.status.value == "killed" for r in fed.runs.values()) > 0
    assert fed.timeline.samples == upfront.timeline.samples and fed.timeline.bin_states == upfront.timeline.bin_states

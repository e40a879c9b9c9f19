"""Part 2 policies: Basin drives the policy core itself; Continuum's pins; lending, a deployment switch."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from basin_runtime.policy import Admitted, Policy, PolicyConfig, Shed, admitted_ids
from basin_runtime.policy.calibrated import Calibration
from basin_runtime.policy.lending import LENDING_KINDS
from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.experiments.ablations import ablation
from basin_sim.kv_tiers import DecodeMemoryLending
from basin_sim.lifecycle import Status
from basin_sim.policies import (
    BasinPolicy,
    MissingPredictionError,
    PolicyContext,
    make_policy,
    policy_names,
    policy_spec,
)
from basin_sim.policies.base import PolicyReport, RecoveryReport, ReservationReport
from basin_sim.policies.basin import config_for
from basin_sim.radix_cache import RadixCache
from tests.sim.builders import deployment, session, spec

PEAKS = {"a": 6_000.0, "b": 2_000.0, "c": 8_000.0, "d": 1_000.0}
FIRST = {"a": 4_000, "b": 3_500, "c": 900, "d": 1_200}


def _sessions() -> dict[str, object]:
    return {sid: session(sid, [FIRST[sid], FIRST[sid] + 500]) for sid in PEAKS}


@pytest.mark.parametrize("mode,name", [("basin", "basin"), ("prototype", "basin-proto")])
def test_the_sim_policy_takes_the_same_decisions_as_the_bare_core(mode: str, name: str) -> None:
    context = PolicyContext(deployment(cache_tokens=10_000), PEAKS, 1.0,
                            calibration=Calibration(8_000.0, 10_000.0, peak_completion_rate_per_s=1e-4))
    config = PolicyConfig(budget_tokens=7_200, mode=mode, peak_completion_rate_per_s=1e-4)  # type: ignore[arg-type]
    bare, sim = Policy(config), make_policy(name, context)
    assert isinstance(sim, BasinPolicy) and sim.core.config == config
    sessions = _sessions()
    got: list[object] = []
    want: list[object] = []
    for t, sid in enumerate(("a", "b", "c", "d")):
        peak = PEAKS[sid] if mode == "basin" else float(FIRST[sid])
        want.append(admitted_ids(bare.arrive(sid, float(t), peak, FIRST[sid])))
        got.append(sim.on_arrival(sid, float(t), sessions[sid]).admit)  # type: ignore[arg-type]
    want.append(admitted_ids(bare.observe("a", 5.0, 5_000)))
    got.append(sim.on_call("a", 5.0, 5_000).admit)
    want.append(admitted_ids(bare.finish("a", 6.0)))
    got.append(sim.on_session_end("a", 6.0).admit)
    events = bare.tick(2_000.0, 0.9)
    want.append((tuple(e.session_id for e in events if isinstance(e, Admitted)),
                 tuple(e.session_id for e in events if isinstance(e, Shed))))
    decisions = sim.on_tick(2_000.0, 0.9)
    got.append((decisions.admit, decisions.shed))
    assert got == want
    assert bare.snapshot() == sim.core.snapshot()
    for sid in bare.snapshot().live + bare.snapshot().queued:
        assert sim.priority(sid, 0.0) == bare.priority_of(sid)
    assert want[:4] != [(sid,) for sid in "abcd"]  # the trace does engage admission


def test_basin_reserves_m_q_x_scale_x_the_prediction_and_counts_who_outgrew_it() -> None:
    """As the gateway: the core gets the bare prediction (priority) and the session's multiplier; the report
    counts admissions and the admitted sessions whose prompt passed ceil(m x peak)."""
    multipliers = {"a": 1.5, "b": 2.0, "c": 1.5, "d": 1.0}
    context = PolicyContext(deployment(cache_tokens=100_000), PEAKS, 1.2, reservation_multipliers=multipliers,
                            calibration=Calibration(80_000.0, 100_000.0))
    sim = make_policy("basin", context)
    bare = Policy(config_for(context, "basin"))  # type: ignore[arg-type]
    assert isinstance(sim, BasinPolicy)
    sessions = _sessions()
    for t, sid in enumerate("abcd"):
        assert sim.on_arrival(sid, float(t), sessions[sid]).admit == admitted_ids(  # type: ignore[arg-type]
            bare.arrive(sid, float(t), PEAKS[sid], FIRST[sid], 1.2 * multipliers[sid]))
    assert sim.core.snapshot() == bare.snapshot()
    assert sim.core.snapshot().reserved_tokens == sum(max(math.ceil(PEAKS[s] * 1.2 * multipliers[s]), FIRST[s])
                                                      for s in "abcd")
    assert sim.priority("c", 0.0) == 2.0 + 8_000 / 30  # the bare prediction's priority
    sim.on_call("a", 5.0, 10_000)  # a reserves ceil(6000 x 1.8) = 10800: not past it
    sim.on_call("b", 5.0, 4_801)  # b reserves 4800: past it
    sim.on_call("b", 6.0, 5_000)  # counted once
    assert sim.report() == PolicyReport(reservations=ReservationReport(sessions_admitted=4, sessions_overflowed=1,
                                                                       revisions=0),
                                        recovery=RecoveryReport(0, 0, 0, 0, 0, 0.0, None))  # nobody held
    with pytest.raises(MissingPredictionError, match="no reservation multiplier for pool session 'x'"):
        make_policy("basin", PolicyContext(deployment(), {"x": 1.0}, reservation_multipliers={"y": 1.0})) \
            .on_arrival("x", 0.0, session("x", [1_000]))


def test_basin_revises_at_the_call_its_re_estimate_names_once_even_when_the_call_is_retried() -> None:
    """`big` reserves 900; at its 3rd call the re-estimate (100 x m 2) frees room and `small` goes in."""
    big, small = session("big", [100, 200, 300, 400]), session("small", [50])
    context = PolicyContext(deployment(cache_tokens=10_000), {"big": 900.0, "small": 200.0},
                            calibration=Calibration(1_000.0 / 0.9, 10_000.0), policy_overrides={"always_engaged": True},
                            revisions={"big": {3: (100.0, 2.0)}, "small": {}})
    sim = make_policy("basin", context)
    assert isinstance(sim, BasinPolicy) and sim.core.snapshot().budget_tokens == 1_000
    assert sim.on_arrival("big", 0.0, big).admit == ("big",)
    assert sim.on_arrival("small", 1.0, small).admit == ()  # 900 + 200 > 1000
    assert sim.on_call("big", 2.0, 100).admit == () and sim.on_call("big", 3.0, 200).admit == ()
    assert sim.on_call("big", 4.0, 300).admit == ("small",)  # call 3: 300 (its context) + 200 fits
    assert sim.core.snapshot().reserved_tokens == 300 + 200
    assert sim.on_call("big", 5.0, 300).admit == ()  # the same call retried: no second revision
    assert (reservations := sim.report().reservations) is not None and reservations.revisions == 1
    assert sim.priority("big", 6.0) == 0.0 + 900 / 30  # fixed at arrival


def budget_for(context: PolicyContext, mode: str = "basin") -> int:
    return config_for(context, mode).budget_tokens  # type: ignore[arg-type]


def test_budget_is_0_9_of_the_knee_capped_by_the_cache_and_0_9_of_the_cache_without_a_knee() -> None:
    d = deployment(cache_tokens=10_000)
    assert budget_for(PolicyContext(d)) == 9_000
    assert budget_for(PolicyContext(d, calibration=Calibration(5_000.0, 10_000.0))) == 4_500
    assert budget_for(PolicyContext(d, calibration=Calibration(50_000.0, 10_000.0))) == 10_000


def test_basin_refuses_to_run_without_predictions() -> None:
    with pytest.raises(MissingPredictionError):
        make_policy("basin", PolicyContext(deployment()))
    policy = make_policy("basin", PolicyContext(deployment(), {"x": 1.0}))
    with pytest.raises(MissingPredictionError):
        policy.on_arrival("a", 0.0, session("a", [1_000]))


def test_basin_priorities_reach_the_engine_queues() -> None:
    engine = Engine(deployment(cache_tokens=10_000), make_policy("basin", PolicyContext(
        deployment(cache_tokens=10_000), {"big": 9_000.0, "small": 600.0})), tick_s=None)
    engine.add(spec(session("big", [1_000]), 0.0))
    engine.add(spec(session("small", [1_000]), 0.0))
    engine.run_until(0.0)
    jobs = [job for _, _, job in engine.prefill[0]._queue]
    assert engine.runs["big"].status == Status.LIVE
    assert {j.priority for j in jobs} <= {0.0 + 9_000 / 30, 0.0 + 600 / 30}


# --- Continuum: holds with a TTL ------------------------------------------------------------------

def test_a_hold_keeps_the_chain_pinned_until_its_ttl_then_it_becomes_evictable() -> None:
    cache = RadixCache(10_000)
    cache.admit("a", "g", 500, 4_000, 0.0)
    cache.release("a", 1.0, hold_until_s=math.inf)
    cache.hold("a", 31.0)
    assert cache.is_held("a") and cache.pinned_tokens == 4_000
    assert cache.admit("b", "g", 500, 9_000, 2.0) is None  # no room: a is held
    assert cache.expire_holds(30.0) == 0
    assert cache.expire_holds(31.0) == 1
    assert not cache.is_held("a") and cache.pinned_tokens == 0
    assert cache.admit("b", "g", 500, 9_000, 32.0) is not None
    cache.check()


def test_the_next_call_takes_the_hold_over_and_a_dropped_hold_unpins() -> None:
    cache = RadixCache(10_000)
    cache.admit("a", "g", 500, 2_000, 0.0)
    cache.release("a", 1.0, hold_until_s=50.0)
    hit = cache.admit("a", "g", 500, 3_000, 5.0)
    assert hit is not None and hit.device_hit_tokens == 2_000 and not cache.is_held("a")
    cache.release("a", 6.0, hold_until_s=60.0)
    cache.drop_hold("a")
    assert cache.pinned_tokens == 0 and cache.expire_holds(100.0) == 0
    cache.check()


def test_continuum_pins_across_the_tool_gap_and_serves_by_session_arrival() -> None:
    d = deployment()
    policy = make_policy("continuum", PolicyContext(d, pin_ttl_s=5.0))
    engine = Engine(d, policy, tick_s=1.0)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=3.0), 0.0))
    engine.run_until(2.5)
    assert engine.prefill[0].cache.is_held("a")  # answered, within the TTL
    assert policy.priority("a", 2.5) == 0.0  # program-level FCFS: the session's arrival
    engine.run_until(60.0)
    assert engine.runs["a"].status == Status.FINISHED and engine.prefill[0].cache.pinned_tokens == 0


def test_a_continuum_pin_expires_when_the_tool_runs_longer_than_the_ttl() -> None:
    d = deployment()
    engine = Engine(d, make_policy("continuum", PolicyContext(d, pin_ttl_s=2.0)), tick_s=1.0)
    engine.add(spec(session("a", [2_000, 3_000], gap_s=30.0), 0.0))
    engine.run_until(10.0)
    cache = engine.prefill[0].cache
    assert not cache.is_held("a") and cache.pinned_tokens == 0 and cache.device_used_tokens > 0


# --- lending ----------------------------------------------------------------------------------------

def _lending_engine(decode_tokens: int) -> Engine:
    d = deployment(decode_tokens=decode_tokens, lending="decode-memory")
    return Engine(d, make_policy("basin-proto", PolicyContext(d)), tick_s=None)


def sync_lent(engine: Engine) -> None:
    """Tell the decode instances what the ledger lends (after lending by hand)."""
    assert isinstance(engine.kv_tier, DecodeMemoryLending)
    engine.kv_tier.sync()


def test_decode_lends_a_finished_calls_kv_and_writes_it_back_on_the_next_call() -> None:
    engine = _lending_engine(100_000)
    engine.add(spec(session("a", [2_000, 3_000], completion=100, gap_s=5.0), 0.0))
    engine.run_until(4.0)
    assert engine.ledger is not None and engine.decode[0].lent_tokens == 2_100
    engine.run_until(math.inf)
    assert engine.decode[0].lent_tokens == 0  # forgotten at the session's end


def test_write_back_replaces_recompute_and_costs_max_of_compute_and_transfer() -> None:
    engine = _lending_engine(100_000)
    prefill = engine.prefill[0]
    assert engine.ledger is not None
    engine.ledger.lend("a", "0", 2_100)
    sync_lent(engine)
    engine.add(spec(session("a", [3_000], completion=10), 0.0))
    engine.run_until(math.inf)
    compute_s = 0.01 + (3_000 - 2_100) * 1e-4  # nothing cached on prefill: 2_100 written back, 900 computed
    write_back_s = 0.005 + 2_100 * 1_000 / 1e9
    assert prefill.written_back_tokens == 2_100
    assert engine.timeline.ttft_s[0] == pytest.approx(max(compute_s, write_back_s) + 0.005 + 3_000 * 1_000 / 1e9)
    assert engine.ledger.holder_of("a") is None and engine.decode[0].lent_tokens == 0


def test_lending_is_capped_at_half_of_decode_memory_oldest_dropped_first() -> None:
    engine = _lending_engine(10_000)
    for k, sid in enumerate(("a", "b", "c")):
        engine.add(spec(session(sid, [2_000, 2_500], completion=100, gap_s=100.0), k * 0.5))
    engine.run_until(20.0)
    assert engine.ledger is not None
    held = [e.session_id for e in engine.ledger.entries("0")]
    assert engine.decode[0].lent_tokens <= 5_000
    assert held == ["b", "c"]  # a, lent first, was dropped to make room
    assert engine.decode[0].lent_tokens == sum(e.tokens for e in engine.ledger.entries("0"))


def test_decode_reclaims_lent_memory_oldest_first_before_a_reservation_waits() -> None:
    engine = _lending_engine(10_000)
    assert engine.ledger is not None
    engine.ledger.lend("old", "0", 2_000)
    engine.ledger.lend("new", "0", 2_000)
    sync_lent(engine)
    engine.add(spec(session("x", [5_500], completion=100), 0.0))  # alone it needs 5500 + 1000: 500 must come back
    engine.run_until(0.0)
    assert [e.session_id for e in engine.ledger.entries("0")] == ["new"]
    assert engine.decode[0].used_tokens() == 5_500 and engine.decode[0].lent_tokens == 2_000
    assert engine.decode[0].used_tokens() + engine.decode[0].lent_tokens <= 10_000


def test_the_reservation_ratio_puts_basin_s_budget_in_reservation_units_but_not_the_prototype_s() -> None:
    d = deployment(cache_tokens=10_000)
    context = PolicyContext(d, calibration=Calibration(5_000.0, 10_000.0, reservation_ratio=1.6))
    assert budget_for(context, "basin") == 7_200  # 1.6 x 0.9 x 5,000
    assert budget_for(context, "prototype") == 4_500
    assert make_policy("basin-proto", context).core.config.budget_tokens == 4_500


@pytest.mark.parametrize("name", policy_names())
def test_lending_is_the_deployments_switch_and_every_policy_runs_under_it(name: str) -> None:
    """Same policy, same sessions: with `lending: decode-memory` decode keeps the first call's KV and writes
    back what prefill lost (its cache is too small to keep both sessions), with `none` nothing is lent.
    (ThunderAgent too: its scheduler's turns stop with the workload, so `run_until(math.inf)` ends.)"""
    written = {}
    for lending in LENDING_KINDS:
        d = deployment(cache_tokens=5_000, host_tokens=2_000 if policy_spec(name).uses_host_tier else 0,
                       lending=lending)
        context = PolicyContext(d, {"a": 4_000.0, "b": 4_000.0}, pin_ttl_s=0.5)
        engine = Engine(d, make_policy(name, context), tick_s=None)
        engine.add(spec(session("a", [3_000, 3_500], completion=100, gap_s=5.0), 0.0))
        engine.add(spec(session("b", [3_000, 3_500], completion=100, gap_s=5.0), 0.5))
        engine.run_until(math.inf)
        engine.check()
        assert (engine.ledger is not None) == (lending == "decode-memory")
        assert all(run.status == Status.FINISHED for run in engine.runs.values())
        written[lending] = sum(p.written_back_tokens for p in engine.prefill)
    assert written["none"] == written["storage-offload"] == 0 and written["decode-memory"] > 0


def test_a_deployment_file_sets_lending_and_refuses_an_unknown_kind(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    base = "profile: h100-qwen3.6-35b-a3b\nnum_prefill: 1\nnum_decode: 1\ncache: gpu\n"
    path.write_text(base)
    spec_ = catalog.load_deployment(str(path))
    assert spec_.build().lending == "none" and spec_.build(lending="decode-memory").lending == "decode-memory"
    path.write_text(base + "lending: decode-memory\n")
    assert catalog.load_deployment(str(path)).build().lending == "decode-memory"
    path.write_text(base + "lending: storage\n")
    with pytest.raises(catalog.CatalogError,
                       match=r"mine\.yaml: lending must be one of \['none', 'decode-memory', 'storage-offload'\]"):
        catalog.load_deployment(str(path))


def test_the_engine_ticks_the_policy_with_the_first_token_latency_and_basin_engages_behind_its_gate() -> None:
    # six sessions with big prompts at once on one prefill instance: later ones wait for their first token
    d = deployment(cache_tokens=10_000_000)
    sessions = {f"s{k}": session(f"s{k}", [60_000, 61_000]) for k in range(6)}
    peaks = {sid: 100_000.0 for sid in sessions}
    gate = Calibration(1_000.0, 10_000_000.0, ttft_plateau_s=0.1, call_cycle_plateau_s=0.2)  # gate at 0.7 s
    policy = make_policy("basin", PolicyContext(d, peaks, calibration=gate, latency_gate=True))
    assert isinstance(policy, BasinPolicy) and policy.core.config.latency_gate_s == pytest.approx(0.7)
    engine = Engine(d, policy, tick_s=1.0)
    for s in sessions.values():
        engine.add(spec(s, 0.0))
    seen: list[float | None] = []
    tick = policy.on_tick

    def recording(now: float, hit_rate: float | None, ttft_s: float | None = None) -> object:
        seen.append(ttft_s)
        return tick(now, hit_rate, ttft_s)

    policy.on_tick = recording  # type: ignore[method-assign]
    engine.run_until(3.0)
    waits = [3.0 - r.sent_s for r in engine.requests.values() if r.stage.value != "decoding"]
    assert len(waits) == 6 and engine.ttft_s() == pytest.approx(statistics.median(waits))
    # the working set is far past B / r (the knee is 1,000 tokens); once the engines read slow, it engages
    assert seen == [1.0, 2.0, 3.0]  # nobody has a first token yet: the median wait grows tick by tick
    assert policy.core.is_pressed and policy.core.is_engaged  # past 0.7 s the working set engages admission


@pytest.mark.parametrize("name,is_held", [("basin", True), ("basin:growth-unchecked", False)])
def test_a_call_past_its_reservation_is_parked_until_it_fits_and_the_ablation_sends_it(name: str,
                                                                                          is_held: bool) -> None:
    """The two-step shape in the engine: `small` is admitted on a 300-token prediction, then its second call
    carries 5,000; with the outgrowth rule (basin) it is parked at the door until `big` finishes."""
    d = deployment(cache_tokens=100_000)
    big, small = session("big", [2_000, 2_500], gap_s=5.0), session("small", [100, 5_000])
    overrides = {"always_engaged": True, **ablation(name).overrides}
    policy = make_policy("basin", PolicyContext(d, {"big": 3_000.0, "small": 300.0},
                                                calibration=Calibration(5_000.0 / 0.9, 100_000.0),
                                                policy_overrides=overrides))
    assert isinstance(policy, BasinPolicy) and policy.core.snapshot().budget_tokens == 5_000
    engine = Engine(d, policy, tick_s=1.0)
    engine.add(spec(big, 0.0, shared_tokens=50))
    engine.add(spec(small, 0.1, shared_tokens=50))
    engine.run_until(4.0)  # small's second call came at ~1 s; big's runs to ~6 s
    if is_held:
        assert policy.core.state_of("small") == "queued" and policy.core.record_of("small").has_run
        assert engine.num_parked == 1 and "small" in engine.sessions.suspended
        assert policy.core.reserved_tokens == 3_000 <= 5_000  # never past the budget while engaged
    else:
        assert policy.core.is_live("small") and policy.core.reserved_tokens == 3_000 + 5_000  # past it
        assert engine.num_parked == 0
    engine.run_until(60.0)
    assert [engine.runs[s].status for s in ("big", "small")] == [Status.FINISHED, Status.FINISHED]
    assert policy.core.reserved_tokens == 0 and (reservations := policy.report().reservations) is not None
    assert reservations.sessions_admitted == 2

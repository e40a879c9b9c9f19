"""Basin's ablations: each changes one part (reservation source, revisions, priority, budget moves, shedding)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from basin_runtime.policy.calibrated import Calibration
from basin_sim.catalog import load_deployment, load_scenario
from basin_sim.experiments.ablations import (
    ABLATIONS,
    AblationError,
    ablation,
    benchmark_constants,
    calibration_tag,
    reservations,
)
from basin_sim.experiments.calibrate.rates import RateCache, rate_key
from basin_sim.experiments.cli import main as cli_main
from basin_sim.policies import BasinPolicy, PolicyContext, make_policy
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.builders import deployment, session
from tests.sim.test_cli import DEPLOYMENT, SCENARIO
from tests.sim.test_compare import MODEL

POOL = [session("a1", [1_000, 4_000], benchmark="a"), session("a2", [1_000, 2_000], benchmark="a"),
        session("a3", [1_000, 9_000], benchmark="a"), session("b1", [500, 700], benchmark="b")]


def test_a_benchmark_constant_is_the_nearest_rank_quantile_of_its_peaks() -> None:
    assert benchmark_constants(POOL, 0.5) == {"a": 4_000.0, "b": 700.0}
    assert benchmark_constants(POOL, 0.9) == {"a": 9_000.0, "b": 700.0}
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\)"):
        benchmark_constants(POOL, 1.0)


def test_each_reservation_kind_reserves_what_it_says_and_is_calibrated_under_its_own_tag() -> None:
    peaks, multipliers = {"a1": 3_000.0, "a2": 1_500.0, "a3": 5_000.0, "b1": 600.0}, {"a1": 1.5}
    assert reservations("predicted", POOL, peaks, multipliers, 0.9) == (peaks, multipliers)
    assert reservations("oracle-peak", POOL, peaks, multipliers, 0.9) == (
        {"a1": 4_000.0, "a2": 2_000.0, "a3": 9_000.0, "b1": 700.0}, {})
    assert reservations("benchmark-constant", POOL, peaks, multipliers, 0.5) == (
        {"a1": 4_000.0, "a2": 4_000.0, "a3": 4_000.0, "b1": 700.0}, {})
    context_peaks, context_only = reservations("current-context", POOL, peaks, multipliers, 0.9)
    assert context_peaks == peaks  # the priority still comes from the prediction
    assert {math.ceil(context_only[sid] * peak) for sid, peak in peaks.items()} == {1}  # reserves 1 token: context
    kinds = ("predicted", "oracle-peak", "benchmark-constant", "current-context")
    assert {calibration_tag(kind, "f" * 64, 0.9) for kind in kinds} == \
        {"f" * 64, "oracle-peak", "benchmark-constant-q0.9", "current-context"}


def test_current_context_reserves_the_context_and_no_admission_admits_everyone() -> None:
    d = deployment(cache_tokens=10_000)
    calibration = Calibration(1_000.0, 10_000.0)  # B = 900 tokens
    peaks = {s.session_id: 5_000.0 for s in POOL}
    _, context_only = reservations("current-context", POOL, peaks, {}, 0.9)
    by_context = make_policy("basin", PolicyContext(d, peaks, calibration=calibration,
                                                    reservation_multipliers=context_only))
    open_door = make_policy("basin", PolicyContext(d, peaks, calibration=calibration,
                                                   policy_overrides=ablation("basin:no-admission").overrides))
    served = make_policy("basin", PolicyContext(d, peaks, calibration=calibration))
    for policy in (by_context, open_door, served):
        assert isinstance(policy, BasinPolicy)
        for k, pooled in enumerate(POOL):
            policy.on_arrival(pooled.session_id, float(k), pooled)
    assert isinstance(by_context, BasinPolicy) and isinstance(open_door, BasinPolicy)
    assert isinstance(served, BasinPolicy)
    # each arrives with a 1,000-token (500 for b1) context: by context the third one no longer fits in 900
    assert by_context.core.snapshot().reserved_tokens == 1_000
    assert served.core.snapshot().live == ("a1",) and len(served.core.snapshot().queued) == 3  # 5,000 each
    assert open_door.core.snapshot().live == tuple(s.session_id for s in POOL) and not open_door.core.snapshot().queued
    assert open_door.core.snapshot().reserved_tokens == 20_000  # it still reserves, it just never holds anyone


def test_the_quantile_sweep_reserves_m_of_each_q_in_the_served_budget() -> None:
    sweep = [ABLATIONS[name] for name in ABLATIONS if name.startswith("basin:q")]
    assert [a.quantile for a in sweep] == [0.5, 0.75, 0.95, 0.99]
    assert all(a.reservation == "predicted" for a in sweep)  # the served calibration: r fixed
    assert not any(a.latency_gate or a.overrides for a in sweep)  # the paper's admission, so q matters


def test_the_latency_gate_is_an_ablation_beyond_the_paper_and_basin_runs_without_it() -> None:
    d = deployment(cache_tokens=10_000)
    calibration = Calibration(8_000.0, 10_000.0, ttft_plateau_s=0.2, call_cycle_plateau_s=4.0)
    assert not ABLATIONS["basin"].latency_gate and ABLATIONS["basin:latency-gate"].latency_gate
    paper = make_policy("basin", PolicyContext(d, {"a1": 9_000.0}, calibration=calibration))
    gated = make_policy("basin", PolicyContext(d, {"a1": 9_000.0}, calibration=calibration, latency_gate=True))
    assert isinstance(paper, BasinPolicy) and isinstance(gated, BasinPolicy)
    assert paper.core.config.latency_gate_s is None
    assert gated.core.config.latency_gate_s == pytest.approx(0.2 + 3 * 4.0)


def test_arrival_order_makes_the_priority_the_arrival_and_fixed_budget_never_moves() -> None:
    d = deployment(cache_tokens=10_000)
    calibration = Calibration(8_000.0, 10_000.0)
    ordered = make_policy("basin", PolicyContext(d, {"a1": 9_000.0}, calibration=calibration,
                                                 policy_overrides=ablation("basin:arrival-order").overrides))
    sized = make_policy("basin", PolicyContext(d, {"a1": 9_000.0}, calibration=calibration))
    for policy in (ordered, sized):
        policy.on_arrival("a1", 5.0, POOL[0])
    assert ordered.priority("a1", 5.0) == pytest.approx(5.0, abs=1e-6)
    assert sized.priority("a1", 5.0) == pytest.approx(5.0 + 9_000 / 30)
    fixed = make_policy("basin", PolicyContext(d, {"a1": 9_000.0}, calibration=calibration,
                                               policy_overrides=ablation("basin:fixed-budget").overrides))
    assert isinstance(fixed, BasinPolicy)
    before = fixed.core.snapshot().budget_tokens
    for k in range(1, 30):  # a hit rate far below the plateau would shrink an adaptive budget every minute
        fixed.on_tick(60.0 * k, 0.1)
    assert fixed.core.snapshot().budget_tokens == before
    with pytest.raises(AblationError, match="unknown ablation 'basin:x'; known: basin, basin:oracle-peak"):
        ablation("basin:x")


@pytest.mark.integration
def test_compare_runs_ablations_as_rows_each_reservation_kind_on_its_own_knee(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    (tmp_path / "d.yaml").write_text(DEPLOYMENT)
    scenario = load_scenario(str(tmp_path / "s.yaml"))
    pool = workload_pool(generate_corpus(7, 300), scenario.workload)
    rates = RateCache(tmp_path / "rates.json")
    rates.put(rate_key(load_deployment(str(tmp_path / "d.yaml")).build("gpu"), scenario.workload, scenario.clients,
                       pool), 0.1, {"command": "seeded by the test"})
    out, knees = tmp_path / "compare.json", tmp_path / "calibrations.json"
    assert cli_main(["compare", "--scenarios", str(tmp_path / "s.yaml"), "--deployments", str(tmp_path / "d.yaml"),
                     "--policies", "basin", "--ablations", "basin:oracle-peak", "basin:arrival-order", "basin:q0.5",
                     "--seeds", "1", "--jobs", "1", "--model", str(MODEL), "--predictions", "in-sample",
                     "--synthetic", "--sessions", str(tmp_path / "absent.parquet"), "--rates-file", str(rates.path),
                     "--calibrations-file", str(knees), "--out", str(out), "--plot-dir", str(tmp_path / "plots")]) == 0
    png = tmp_path / "plots" / "compare-tiny-surge.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    table = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[3] for line in table[2:]] == ["basin", "basin:oracle-peak", "basin:arrival-order",
                                                            "basin:q0.5"]
    entries = json.loads(knees.read_text())
    assert len(entries) == 2 and any('"predictor_sha256": "oracle-peak"' in key for key in entries)  # own knee
    assert sorted(e["predictor_sha256"] for e in entries.values()) == sorted([MODEL_SHA, "none"])  # q0.5: served r
    runs = json.loads(out.read_text())["runs"]
    assert {r["policy"] for r in runs} == {"basin", "basin:oracle-peak", "basin:arrival-order", "basin:q0.5"}


MODEL_SHA = __import__("hashlib").sha256(MODEL.read_bytes()).hexdigest()

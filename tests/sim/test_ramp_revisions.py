"""The knee ramp's reservations follow Basin's revisions (issue 49 part 1): r is measured for the reservations
the run will hold, not the first call's alone."""

from __future__ import annotations

from basin_sim.experiments.calibrate.knee_cache import knee_key
from basin_sim.experiments.calibrate.ramp import held_reservation, run_ramp
from basin_sim.experiments.compare import _knee_kind
from basin_sim.experiments.predictions import revised_reservations, revised_tag
from basin_sim.lifecycle import SessionRun, SessionSpec
from basin_sim.workload.scenarios import RateStep, Scenario
from tests.sim.builders import deployment, session

POOL = [session(f"s{k}", [2_000 + 1_000 * i for i in range(8)], completion=50, gap_s=5.0) for k in range(20)]
RATES = [0.05, 0.1, 0.2]


def test_a_run_holds_its_latest_revision_at_a_call_it_has_sent() -> None:
    spec = SessionSpec("r", POOL[0], 0.0, "bench", 0, (5.0,) * 7)
    run = SessionRun(spec)
    revised = {2: 9_000.0, 5: 4_000.0}
    assert held_reservation(7_000.0, revised, run) == 7_000.0  # nothing sent
    run.next_call = 1  # call 1 answered, call 2 not yet sent
    assert held_reservation(7_000.0, revised, run) == 7_000.0
    run.next_call = 4  # calls 1-4 answered: the revision at call 2
    assert held_reservation(7_000.0, revised, run) == 9_000.0
    run.next_call = 5
    assert held_reservation(7_000.0, {}, run) == 7_000.0 and held_reservation(7_000.0, revised, run) == 4_000.0


def test_the_ramps_reservation_ratio_follows_the_revisions() -> None:
    d = deployment(cache_tokens=5_000_000, decode_tokens=5_000_000)
    first = {s.session_id: 3_000.0 for s in POOL}
    revisions = {s.session_id: {2: (30_000.0, 1.0)} for s in POOL}  # revised ten times up at call 2
    revised = revised_reservations(revisions)
    plain = run_ramp(d, POOL, RATES, step_s=240.0, reservations=first)
    up = run_ramp(d, POOL, RATES, step_s=240.0, reservations=first, revised=revised)
    assert [s.load for s in plain] == [s.load for s in up]  # the same engine run
    assert all(u.reservation_ratio is not None and p.reservation_ratio is not None
               and u.reservation_ratio > 2 * p.reservation_ratio for u, p in zip(up, plain, strict=True))


def test_basin_and_its_no_revisions_ablation_have_knees_of_their_own_keys() -> None:
    assert _knee_kind("basin") == ("predicted", True) and _knee_kind("basin+session-cache") == ("predicted", True)
    assert _knee_kind("basin:no-revisions") == ("predicted", False)
    assert _knee_kind("basin-proto")[1] is False and _knee_kind("basin:oracle-peak") == ("oracle-peak", False)
    revised = revised_reservations({"s0": {2: (30_000.0, 1.5)}, "s1": {}})
    assert revised == {"s0": {2: 45_000.0}} and revised_tag({}) == "" and revised_tag(revised).startswith("revised ")
    scenario, d = Scenario("x", 600.0, 0.0, 0.0, 600.0, rate=(RateStep(0.0, 1.0),)), deployment()
    keys = {knee_key(d, POOL, scenario, "sha", 0.9, revised=tag) for tag in ("", revised_tag(revised))}
    assert len(keys) == 2 and '"revised"' not in knee_key(d, POOL, scenario, "sha", 0.9)

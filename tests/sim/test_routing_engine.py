"""The engine routes with smg's cache_aware: sessions spread over prefills, calls stay, loads return to zero."""

from __future__ import annotations

import math

from basin_sim.engine import Engine
from basin_sim.lifecycle import Stage, Status
from basin_sim.policies import FcfsPolicy
from tests.sim.builders import deployment, session, spec


def three_prefill_run(router_seed: int = 0) -> Engine:
    """Six sessions at once on 3P1D; the shared 500 tokens are 25% of a first prompt (<= 0.3: a miss)."""
    engine = Engine(deployment(num_prefill=3), FcfsPolicy("sglang"), tick_s=None, router_seed=router_seed)
    for k in range(6):
        engine.add(spec(session(f"s{k}", [2_000, 3_000, 4_000], completion=50, gap_s=1.0), shared_tokens=500))
    engine.run_until(math.inf)
    return engine


def placement(engine: Engine) -> dict[str, list[int]]:
    """Each session's prefill instances, read from their caches: those holding more of it than the group."""
    return {sid: [p.index for p in engine.prefill if p.cache.lookup(sid, "bench").tokens > 500] for sid in engine.runs}


def test_sessions_spread_over_the_prefills_and_each_stays_on_its_own() -> None:
    engine = three_prefill_run()
    assert all(run.status == Status.FINISHED for run in engine.runs.values())
    assert engine.prefill_router.num_routed == (6, 6, 6)  # join-shortest-queue: two sessions each, 3 calls
    shares = [n / sum(engine.prefill_router.num_routed) for n in engine.prefill_router.num_routed]
    assert all(share > 0.2 for share in shares)
    assert all(len(where) == 1 for where in placement(engine).values())  # every call on one prefill
    hits = sum(engine.timeline.device_hit_tokens)
    assert hits >= 6 * (2_000 + 3_000)  # calls 2 and 3 hit the whole previous prompt
    assert engine.prefill_router.loads == (0, 0, 0) and engine.decode_router.loads == (0,)
    assert engine.prefill_router.num_conversations == 0 and engine.decode_router.num_conversations == 0


def test_the_router_seed_breaks_ties_and_nothing_else_varies() -> None:
    first = placement(three_prefill_run(router_seed=0))
    assert placement(three_prefill_run(router_seed=0)) == first
    assert any(placement(three_prefill_run(router_seed=seed)) != first for seed in range(1, 6))


def in_flight(engine: Engine, pool: str) -> tuple[int, ...]:
    """Requests of each worker whose client still waits (not answered, not cancelled)."""
    workers = engine.prefill if pool == "prefill" else engine.decode
    counts = [0] * len(workers)
    for run in engine.runs.values():
        if run.request is not None:
            counts[(run.request.prefill if pool == "prefill" else run.request.decode).index] += 1
    return tuple(counts)


def assert_loads_match(engine: Engine) -> None:
    assert engine.prefill_router.loads == in_flight(engine, "prefill")
    assert engine.decode_router.loads == in_flight(engine, "decode")


def test_loads_follow_requests_through_answers_and_kills_in_every_stage_and_return_to_zero() -> None:
    engine = Engine(deployment(num_prefill=3, num_decode=2, decode_tokens=12_000), FcfsPolicy("sglang"),
                    tick_s=None)
    for k in range(12):
        engine.add(spec(session(f"s{k}", [2_000 + 300 * k, 6_000 + 300 * k], completion=200), arrival_s=0.02 * k))
    by_stage: dict[Stage, str] = {}
    while len(by_stage) < len(Stage):  # step until a request sits in every stage
        engine.run_until(engine.now + 0.001)
        assert_loads_match(engine)
        by_stage = {run.request.stage: sid for sid, run in sorted(engine.runs.items()) if run.request is not None}
    assert sum(engine.prefill_router.loads) > len(by_stage)  # others stay in flight through the kill
    engine.kill_at(engine.now, by_stage.values())
    while engine.now < 30.0:
        engine.run_until(engine.now + 0.01)
        assert_loads_match(engine)
    engine.run_until(math.inf)
    killed = set(by_stage.values())
    assert {sid for sid, run in engine.runs.items() if run.status == Status.KILLED} == killed
    assert all(run.status == Status.FINISHED for sid, run in engine.runs.items() if sid not in killed)
    assert engine.prefill_router.loads == (0, 0, 0) and engine.decode_router.loads == (0, 0)
    assert engine.prefill_router.num_conversations == 0 and engine.decode_router.num_conversations == 0

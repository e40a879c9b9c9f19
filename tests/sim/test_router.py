"""smg's cache_aware routing: the gate's arithmetic, hit/miss/spill step by step, and the load ledger."""

from __future__ import annotations

import random

import pytest

from basin_sim.router import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CACHE_THRESHOLD,
    CacheAwareRouter,
    Route,
    RouteKind,
    RouterError,
    balance_margin,
    is_over,
)


def state(router: CacheAwareRouter, sessions: list[str], group: str = "g") -> dict[str, object]:
    """Everything the router knows, for whole-state comparisons."""
    return {"loads": router.loads, "routed": router.num_routed, "group": router.group_tenants(group),
            "holders": {s: router.holders(s) for s in sessions}, "conversations": router.num_conversations}


def test_the_defaults_are_smgs() -> None:
    assert (CACHE_THRESHOLD, BALANCE_ABS_THRESHOLD, BALANCE_REL_THRESHOLD) == (0.3, 64, 1.5)


@pytest.mark.parametrize(("avg_load", "margin"), [
    (0.0, 4.0),  # ceil(0) = 0: the floor of 4
    (3.0, 4.0),  # ceil(2 * 1.73) = 4
    (5.0, 5.0),  # ceil(2 * 2.24) = 5
    (9.0, 6.0),  # 2 * 3
    (2_000.0, 64.0),  # ceil(2 * 44.7) = 90, capped at balance_abs_threshold
])
def test_the_gate_margin_is_twice_the_root_of_the_mean_between_4_and_the_abs_threshold(
        avg_load: float, margin: float) -> None:
    assert balance_margin(avg_load) == margin


@pytest.mark.parametrize(("load", "avg_load", "over"), [
    (7, 7 / 3, True),  # 7 > 3.5 and 7 > 2.33 + 4
    (6, 2.0, False),  # 6 > 3, but 6 > 2 + 4 is not strict
    (20, 9.0, True),  # 20 > 13.5 and 20 > 9 + 6
    (15, 9.0, False),  # 15 > 13.5, but not > 15
    (100, 70.0, False),  # 100 > 70 + 17, but not > 105: the relative bound holds it
    (3_001, 2_000.0, True),  # > 3000 and > 2064
    (3_000, 2_000.0, False),
    (0, 0.0, False),
])
def test_over_the_gate_takes_both_the_relative_and_the_absolute_bound(load: int, avg_load: float,
                                                                        over: bool) -> None:
    assert is_over(load, avg_load) is over


def test_a_miss_goes_to_the_least_loaded_worker() -> None:
    router = CacheAwareRouter(3)
    first = router.route("a", "g", 500, 2_000)
    assert first == Route(first.worker, RouteKind.MISS, 0)  # empty tree: any of the three idle workers
    second = router.route("b", "g", 500, 2_000)  # the group is held, but 500 / 2000 <= 0.3
    assert second.kind == RouteKind.MISS and second.matched_tokens == 500 and second.worker != first.worker
    third = router.route("c", "g", 500, 2_000)
    idle = ({0, 1, 2} - {first.worker, second.worker}).pop()
    assert third == Route(idle, RouteKind.MISS, 500)  # the only idle worker left
    assert state(router, ["a", "b", "c"]) == {
        "loads": (1, 1, 1), "routed": (1, 1, 1), "group": frozenset({0, 1, 2}),
        "holders": {"a": {first.worker: 2_000}, "b": {second.worker: 2_000}, "c": {idle: 2_000}},
        "conversations": 3}
    router.finish(second.worker)
    assert router.route("d", "g", 500, 2_000) == Route(second.worker, RouteKind.MISS, 500)


def test_the_threshold_is_strict() -> None:
    router = CacheAwareRouter(2)
    holder = router.route("a", "g", 300, 1_000).worker
    assert router.route("b", "g", 300, 1_000) == Route(1 - holder, RouteKind.MISS, 300)  # 0.3 is not > 0.3
    router = CacheAwareRouter(2, cache_threshold=0.29)
    holder = router.route("a", "g", 300, 1_000).worker
    assert router.route("b", "g", 300, 1_000) == Route(holder, RouteKind.HIT, 300)


def test_a_hit_goes_to_the_holder_even_when_it_is_the_busiest_under_the_gate() -> None:
    router = CacheAwareRouter(3)
    holder = router.route("a", "g", 500, 2_000).worker
    # 2000 / 3000 > 0.3; the holder has 1 in flight, the others none: 1 > 1.5 x 0.33 but not > 0.33 + 4
    assert router.route("a", "g", 500, 3_000) == Route(holder, RouteKind.HIT, 2_000)
    loads = [0, 0, 0]
    loads[holder] = 2
    assert state(router, ["a"]) == {"loads": tuple(loads), "routed": tuple(loads), "group": frozenset({holder}),
                                    "holders": {"a": {holder: 3_000}}, "conversations": 1}


def test_a_new_session_whose_system_prompt_dominates_goes_to_a_holder_of_that_prompt() -> None:
    router = CacheAwareRouter(3)
    holder = router.route("a", "g", 1_500, 2_000).worker
    assert router.route("b", "g", 1_500, 2_000) == Route(holder, RouteKind.HIT, 1_500)


def test_spill_when_every_holder_is_over_the_gate_and_the_spill_target_gets_the_text() -> None:
    router = CacheAwareRouter(3)
    holder = router.route("hot", "g", 500, 1_000).worker
    for k in range(6):  # the shared prompt is half of each: they all hit the holder, up to 7 in flight
        assert router.route(f"s{k}", "g", 500, 1_000) == Route(holder, RouteKind.HIT, 500)
    assert router.is_over(holder)  # 7 > 1.5 x 2.33 and 7 > 2.33 + 4
    spill = router.route("hot", "g", 500, 2_000)  # its own prompt matches 1000 / 2000, on the holder only
    assert spill.kind == RouteKind.SPILL and spill.worker != holder and spill.matched_tokens == 1_000
    loads = [0, 0, 0]
    loads[holder], loads[spill.worker] = 7, 1
    sessions = ["hot"] + [f"s{k}" for k in range(6)]
    assert state(router, sessions) == {
        "loads": tuple(loads), "routed": tuple(loads), "group": frozenset({holder, spill.worker}),
        "holders": {"hot": {holder: 1_000, spill.worker: 2_000}} | {f"s{k}": {holder: 1_000} for k in range(6)},
        "conversations": 7}
    router.finish(spill.worker)
    assert router.route("hot", "g", 500, 2_500) == Route(spill.worker, RouteKind.HIT, 2_000)  # affinity moved
    new = router.route("new", "g", 500, 1_000)  # both hold the group; the first is still over the gate
    assert new == Route(spill.worker, RouteKind.HIT, 500)


def test_a_rewritten_conversation_matches_only_the_group_and_drops_the_old_text() -> None:
    router = CacheAwareRouter(2)
    holder = router.route("a", "g", 500, 3_000).worker
    router.finish(holder)
    router.route("b", "g", 500, 1_000)  # a hit on the group: the holder
    assert router.match("a", "g", 500, 2_500) == (500, (holder,))  # 3000 held is not a prefix of 2500
    route = router.route("a", "g", 500, 1_200)  # 500 / 1200 > 0.3: the group's holder, now the busiest
    assert route == Route(holder, RouteKind.HIT, 500) and router.holders("a") == {holder: 1_200}


def test_an_illegal_step_raises_and_changes_nothing() -> None:
    router = CacheAwareRouter(3)
    worker = router.route("a", "g", 500, 2_000).worker
    before = state(router, ["a", "b"])
    with pytest.raises(RouterError, match="group tokens <= prompt tokens"):
        router.route("b", "g", 500, 400)
    with pytest.raises(RouterError, match="has 500 shared tokens, not 600"):
        router.route("b", "g", 600, 2_000)
    with pytest.raises(RouterError, match="is in group 'g', not 'h'"):
        router.route("a", "h", 500, 3_000)
    with pytest.raises(RouterError, match="no request in flight"):
        router.finish((worker + 1) % 3)
    with pytest.raises(RouterError, match="not in a pool of 3"):
        router.finish(3)
    assert state(router, ["a", "b"]) == before
    with pytest.raises(RouterError):
        CacheAwareRouter(0)
    with pytest.raises(RouterError):
        CacheAwareRouter(2, balance_rel_threshold=0.9)


def test_forget_drops_an_ended_sessions_text_but_not_its_groups_tenants() -> None:
    router = CacheAwareRouter(2)
    worker = router.route("a", "g", 500, 2_000).worker
    router.finish(worker)
    router.forget("a")
    assert state(router, ["a"]) == {"loads": (0, 0), "routed": router.num_routed, "group": frozenset({worker}),
                                    "holders": {"a": {}}, "conversations": 0}


def scripted_routes(seed: int, script_seed: int = 7, steps: int = 400) -> list[Route]:
    """A random mix of new sessions, next calls and finishes, the same for every router seed."""
    script = random.Random(script_seed)
    router = CacheAwareRouter(4, seed=seed)
    prompts: dict[str, int] = {}
    in_flight: list[int] = []
    routes: list[Route] = []
    for step in range(steps):
        if in_flight and script.random() < 0.3:
            router.finish(in_flight.pop(script.randrange(len(in_flight))))
            continue
        session = script.choice(sorted(prompts)) if prompts and script.random() < 0.6 else f"s{step}"
        prompts[session] = prompts.get(session, 800) + script.choice([50, 100, 400, 3_000])
        route = router.route(session, "g", 700, prompts[session])
        routes.append(route)
        in_flight.append(route.worker)
    for worker in in_flight:
        router.finish(worker)
    assert router.loads == (0, 0, 0, 0)  # every dispatch finished: the ledger is back at zero
    return routes


def test_routing_is_deterministic_per_seed_and_ties_depend_on_it() -> None:
    routes = scripted_routes(seed=1)
    assert routes == scripted_routes(seed=1)
    assert {r.kind for r in routes} == {RouteKind.HIT, RouteKind.MISS, RouteKind.SPILL}
    assert any(scripted_routes(seed=s) != routes for s in range(2, 6))


def test_ties_are_broken_uniformly() -> None:
    firsts = [CacheAwareRouter(4, seed=s).route("a", "g", 100, 1_000).worker for s in range(400)]
    assert all(70 <= firsts.count(w) <= 130 for w in range(4))  # 100 expected each

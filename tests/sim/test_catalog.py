"""The shipped files load; unknown names and broken files give errors that say what and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from basin_sim import catalog
from basin_sim.policies import PolicyContext, UnknownPolicyError, make_policy, policy_names, policy_spec
from tests.sim.builders import deployment


def test_every_shipped_scenario_deployment_and_profile_loads() -> None:
    scenarios = catalog.names(catalog.SCENARIOS_DIR)
    assert {"steady", "surge-33", "surge-100", "kill-burst", "kill-burst-keep"} <= set(scenarios)
    for name in scenarios:
        assert catalog.load_scenario(name).name == name
    for name in ("1p1d", "1p3d"):
        spec = catalog.load_deployment(name)
        assert spec.build("gpu").host_cache_tokens == 0 and spec.build("host").host_cache_tokens > 0
        for cache in ("gpu", "host"):
            for workload in catalog.WORKLOADS:
                assert spec.overload_rate(cache, workload) > 0  # every shipped rate is calibrated
    surge = catalog.load_scenario("surge-100")
    steady = catalog.load_scenario("steady")
    assert (surge.window_start_s, surge.duration_s) == (steady.window_start_s, steady.duration_s)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(catalog.CatalogError, match=r"unknown scenario 'surge-1000'; known scenarios: .*surge-100"):
        catalog.load_scenario("surge-1000")
    with pytest.raises(catalog.CatalogError, match="known deployments: 1p1d, 1p3d"):
        catalog.load_deployment("2p2d")


def test_a_broken_file_names_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ndescription: x\nduration_s: 100\nwarmup_s: 0\nwindow_start_s: 50\nsurgee: 1\n")
    with pytest.raises(catalog.CatalogError, match=r"bad\.yaml: missing keys \[\], unknown keys \['surgee'\]"):
        catalog.load_scenario(str(path))
    path.write_text("name: bad\ndescription: x\nduration_s: 100\nwarmup_s: 0\nwindow_start_s: 50\n"
                    "burst: {start_s: 10, end_s: 20, rate_factor: 2, max_calls: 3, kill: 'yes'}\n")
    with pytest.raises(catalog.CatalogError, match=r"bad\.yaml: burst\.kill must be a bool, got 'yes'"):
        catalog.load_scenario(str(path))
    path.write_text("name: bad\ndescription: x\nduration_s: 100\nwarmup_s: 60\nwindow_start_s: 50\n")
    with pytest.raises(catalog.CatalogError, match=r"bad\.yaml: .*warmup_s"):
        catalog.load_scenario(str(path))


def test_the_registry_builds_known_policies_and_refuses_unknown_ones() -> None:
    assert policy_names()[:2] == ("sglang", "hicache")
    assert policy_spec("hicache").uses_host_tier and not policy_spec("sglang").uses_host_tier
    policy = make_policy("sglang", PolicyContext(deployment()))
    assert policy.name == "sglang" and policy.priority("a", 3.0) == 3.0
    with pytest.raises(UnknownPolicyError, match="unknown policy 'basin-x'; known policies: sglang, hicache"):
        make_policy("basin-x", PolicyContext(deployment()))

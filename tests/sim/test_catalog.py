"""The shipped files load; user files are checked key by key; errors say what and where."""

from __future__ import annotations

from pathlib import Path

import pytest

from basin_sim import catalog
from basin_sim.policies import PolicyContext, UnknownPolicyError, make_policy, policy_names, policy_spec
from basin_sim.workload.scenarios import BurstSpec, RateStep, WorkloadSpec
from tests.sim.builders import deployment

GOOD = """name: my-surge
duration_s: 5400
warmup_s: 1200
workload: {benchmarks: [terminal-bench], tool_time_scale: 1.0}
rate:
  - {from_s: 0, x_overload: 0.5}
  - {from_s: 900, x_overload: 1.0}
  - {from_s: 1500, per_min: 3.3}
bursts:
  - {from_s: 900, to_s: 1500, x_base: 4.0, max_unloaded_s: 300, kill_at_s: 1500}
goodput_window: {from_s: 1500, to_s: 5100}
"""


def test_every_shipped_scenario_deployment_and_profile_loads() -> None:
    scenarios = catalog.names(catalog.SCENARIOS_DIR)
    assert {"steady", "surge-33", "surge-100", "kill-burst", "kill-burst-keep", "closed-agents"} <= set(scenarios)
    for name in scenarios:
        assert catalog.load_scenario(name).name == name
    for name in catalog.names(catalog.DEPLOYMENTS_DIR):
        spec = catalog.load_deployment(name)
        assert spec.build("gpu").host_cache_tokens == 0 and spec.build("host").host_cache_tokens > 0
        assert spec.build().cache_kind == spec.cache
    surge, steady = catalog.load_scenario("surge-100"), catalog.load_scenario("steady")
    assert (surge.goodput_from_s, surge.goodput_to_s) == (steady.goodput_from_s, steady.goodput_to_s)
    assert surge.rate[1] == RateStep(900.0, 1.0) and surge.rate[2].from_s - surge.rate[1].from_s == 600.0  # 10 min


def test_the_readme_example_file_loads_as_written(tmp_path: Path) -> None:
    path = tmp_path / "my-surge.yaml"
    path.write_text(GOOD)
    scenario = catalog.load_scenario(str(path))
    assert scenario.workload == WorkloadSpec(benchmarks=("terminal-bench",), tool_time_scale=1.0)
    assert scenario.bursts == (BurstSpec(900.0, 1500.0, 4.0, 300.0, kill_at_s=1500.0),)
    assert (scenario.pre_end_s, scenario.last_change_s) == (900.0, 1500.0)
    assert scenario.rate[2] == RateStep(1500.0, per_min=3.3) and scenario.needs_overload_rate


def test_a_scenario_of_per_min_segments_needs_no_overload_rate(tmp_path: Path) -> None:
    path = tmp_path / "absolute.yaml"
    path.write_text(GOOD.replace("x_overload: 0.5}", "per_min: 30}").replace("x_overload: 1.0}", "per_min: 60}"))
    scenario = catalog.load_scenario(str(path))
    assert [(s.x_overload, s.per_min) for s in scenario.rate] == [(None, 30.0), (None, 60.0), (None, 3.3)]
    assert not scenario.needs_overload_rate
    assert scenario.base_rate_per_s(0.0) == 0.5  # 30 per minute; bursts multiply it
    assert scenario.segments(0.0) == [(-1200.0, 0.0, 0.5), (0.0, 900.0, 0.5), (900.0, 1500.0, 1.0),
                                      (1500.0, 5400.0, 3.3 / 60)]


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(catalog.CatalogError, match=r"unknown scenario 'surge-1000'; known scenarios: .*surge-100"):
        catalog.load_scenario("surge-1000")
    with pytest.raises(catalog.CatalogError, match="known deployments: 100p300d, 1p1d, 1p3d, 1p3d-h100"):
        catalog.load_deployment("2p2d")


@pytest.mark.parametrize(("old", "new", "message"), [
    ("warmup_s: 1200\n", "warmup_s: 1200\nsurgee: 1\n", r"unknown key 'surgee' \(known: bursts, clients"),
    ("warmup_s: 1200\n", "warmup: 1200\n",
     r"missing key 'warmup_s'; unknown key 'warmup' \(did you mean 'warmup_s'\?\)"),
    ("x_base: 4.0,", "x_base: 4.0, kill: yes,", r"bursts\[0\]: unknown key 'kill' \(did you mean 'kill_at_s'\?\)"),
    ("max_unloaded_s: 300", "max_unloaded_s: '300'", r"bursts\[0\]\.max_unloaded_s must be a float, got '300'"),
    ("{from_s: 900, x_overload: 1.0}", "{from_s: 900}",
     r"rate\[1\] needs exactly one of x_overload .* and per_min .*, got x_overload=None, per_min=None"),
    ("{from_s: 900, x_overload: 1.0}", "{from_s: 900, x_overload: 1.0, per_min: 6}",
     r"rate\[1\] needs exactly one of .*, got x_overload=1.0, per_min=6.0"),
    ("per_min: 3.3}", "per_min: -3.3}", r"rate\[2\]\.per_min must be >= 0, got -3.3"),
    ("per_min: 3.3}", "per_min: '3.3'}", r"rate\[2\]\.per_min must be a float, got '3.3'"),
    ("per_min: 3.3}", "per_s: 3.3}", r"rate\[2\]: unknown key 'per_s' \(did you mean 'per_min'\?\)"),
    ("tool_time_scale: 1.0}", "tool_timing: 1.0}",
     r"workload: unknown key 'tool_timing' \(did you mean 'tool_time(_scale)?'\?\)"),
    ("to_s: 5100}", "to_s: 9999}", "goodput_window needs 0 <= from_s < to_s <= duration_s"),
    ("duration_s: 5400\n", "", r"missing key 'duration_s'"),
])
def test_a_broken_scenario_names_the_file_and_the_key(tmp_path: Path, old: str, new: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    assert old in GOOD
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(catalog.CatalogError, match=rf"bad\.yaml: .*{message}"):
        catalog.load_scenario(str(path))


def test_every_typo_in_a_scenario_file_is_named_in_one_message(tmp_path: Path) -> None:
    # Issue 45: typos were reported one nesting level at a time.
    path = tmp_path / "typos.yaml"
    path.write_text(GOOD.replace("warmup_s:", "warmup:").replace("tool_time_scale:", "tool_time_scal:")
                    .replace("kill_at_s:", "kill_at:"))
    with pytest.raises(catalog.CatalogError) as caught:
        catalog.load_scenario(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: missing key 'warmup_s'; unknown key 'warmup' (did you mean 'warmup_s'?)")
    assert "workload: unknown key 'tool_time_scal' (did you mean 'tool_time_scale'?)" in message
    assert "bursts[0]: unknown key 'kill_at' (did you mean 'kill_at_s'?)" in message
    assert "\n" not in message


def test_a_deployment_file_names_its_profile_cache_and_memories(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("profile: h100-qwen3.6-35b-a3b\nnum_prefill: 2\nnum_decode: 2\ncache: host\n"
                    "prefill_cache_tokens: 500000\n")
    spec = catalog.load_deployment(str(path))
    built = spec.build()
    assert (spec.name, built.num_prefill, built.prefill_cache_tokens, built.cache_kind) == ("mine", 2, 500_000, "host")
    path.write_text("profile: h100-qwen3.6-35b-a3b\nnum_prefill: 2\nnum_decode: 2\ncache: ssd\n")
    with pytest.raises(catalog.CatalogError, match=r"mine\.yaml: cache must be one of \['gpu', 'host'\]"):
        catalog.load_deployment(str(path))
    path.write_text("profile: h100-qwen3.6-35b-a3b\nnum_prefill: 0\nnum_decode: 2\ncache: gpu\n")
    with pytest.raises(catalog.CatalogError, match=r"mine\.yaml: .*num_prefill must be a whole number > 0"):
        catalog.load_deployment(str(path))


def test_a_deployment_file_may_set_sglang_s_decode_settings_and_defaults_them_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    base = "profile: h100-qwen3.6-35b-a3b\nnum_prefill: 1\nnum_decode: 1\ncache: gpu\n"
    path.write_text(base)
    built = catalog.load_deployment(str(path)).build()
    assert (built.decode_reserved_tokens, built.decode_clip_max_new_tokens, built.retraction_policy) == \
        (512, 4096, "length")
    path.write_text(base + "decode_reserved_tokens: 256\ndecode_clip_max_new_tokens: 8192\n"
                    "retraction_policy: priority\n")
    built = catalog.load_deployment(str(path)).build()
    assert (built.decode_reserved_tokens, built.decode_clip_max_new_tokens, built.retraction_policy) == \
        (256, 8192, "priority")
    path.write_text(base + "retraction_policy: oldest\n")
    with pytest.raises(catalog.CatalogError, match=r"mine\.yaml: .*retraction_policy must be length or priority"):
        catalog.load_deployment(str(path))
    path.write_text(base + "decode_reserved_tokens: lots\n")
    with pytest.raises(catalog.CatalogError, match=r"mine\.yaml: decode_reserved_tokens must be a whole number"):
        catalog.load_deployment(str(path))


def test_the_registry_builds_known_policies_and_refuses_unknown_ones() -> None:
    assert policy_names()[:2] == ("sglang", "hicache")
    assert policy_spec("hicache").uses_host_tier and not policy_spec("sglang").uses_host_tier
    policy = make_policy("sglang", PolicyContext(deployment()))
    assert policy.name == "sglang" and policy.priority("a", 3.0) == 3.0
    with pytest.raises(UnknownPolicyError, match="unknown policy 'basin-x'; known policies: sglang, hicache"):
        make_policy("basin-x", PolicyContext(deployment()))

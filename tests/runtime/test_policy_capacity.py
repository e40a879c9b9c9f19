"""The one home of a deployment's cache capacity (`basin_runtime/policy/capacity.py`) and its simulated users."""

from __future__ import annotations

from basin_runtime.policy.capacity import pooled_tokens, uniform_pooled_tokens
from basin_sim.catalog import load_deployment


def test_pooled_tokens_sums_the_pools_in_order_and_keeps_whole_tokens_whole() -> None:
    assert pooled_tokens([300_000, 250_000]) == 550_000 and isinstance(pooled_tokens([1, 2]), int)
    assert pooled_tokens([0.1, 0.2, 0.3]) == (0.1 + 0.2) + 0.3
    assert pooled_tokens([]) == 0


def test_uniform_pools_are_the_product() -> None:
    assert uniform_pooled_tokens(325_000, 3) == 975_000
    assert uniform_pooled_tokens(7, 0) == 0


def test_a_deployment_s_capacities_are_its_pools_times_its_instances() -> None:
    deployment = load_deployment("100p300d").build("host")
    assert deployment.cache_capacity_tokens == deployment.prefill_cache_tokens * deployment.num_prefill
    assert deployment.decode_capacity_tokens == deployment.decode_kv_tokens * deployment.num_decode
    assert deployment.host_capacity_tokens == deployment.host_cache_tokens * deployment.num_prefill > 0

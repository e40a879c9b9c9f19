"""The policy registry: session policies by name (`make_policy('sglang', context)`; `policy_names()` lists them)."""

from __future__ import annotations

from basin_sim.policies.base import (
    NO_DECISIONS,
    CacheController,
    Decisions,
    PolicyContext,
    PolicySpec,
    SessionPolicy,
    UnknownPolicyError,
)
from basin_sim.policies.basin import BASIN, BASIN_PROTO, BasinPolicy, MissingPredictionError
from basin_sim.policies.budgeter import BUDGETER, BudgeterPolicy
from basin_sim.policies.concur import CONCUR, ConcurPolicy
from basin_sim.policies.continuum import CONTINUUM, ContinuumPolicy
from basin_sim.policies.continuum_fixed import CONTINUUM_FIXED_TTL, ContinuumFixedTtlPolicy
from basin_sim.policies.fcfs import HICACHE, SGLANG, FcfsPolicy
from basin_sim.policies.thunderagent import THUNDERAGENT, ThunderAgentPolicy

_REGISTRY: dict[str, PolicySpec] = {spec.name: spec
                                    for spec in (SGLANG, HICACHE, CONTINUUM, CONTINUUM_FIXED_TTL, BUDGETER,
                                                   BASIN_PROTO, BASIN,
                                                   THUNDERAGENT, CONCUR)}


def policy_names() -> tuple[str, ...]:
    """Registered policy names, in registration order."""
    return tuple(_REGISTRY)


def policy_spec(name: str) -> PolicySpec:
    """The registered policy `name`; an unknown name raises `UnknownPolicyError` listing the known ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise UnknownPolicyError(f"unknown policy {name!r}; known policies: {', '.join(policy_names())}")
    return spec


def make_policy(name: str, context: PolicyContext) -> SessionPolicy:
    """A fresh policy instance for one run."""
    return policy_spec(name).factory(context)


__all__ = [
    "NO_DECISIONS",
    "BasinPolicy",
    "BudgeterPolicy",
    "CacheController",
    "ConcurPolicy",
    "ContinuumFixedTtlPolicy",
    "ContinuumPolicy",
    "Decisions",
    "FcfsPolicy",
    "MissingPredictionError",
    "PolicyContext",
    "PolicySpec",
    "SessionPolicy",
    "ThunderAgentPolicy",
    "UnknownPolicyError",
    "make_policy",
    "policy_names",
    "policy_spec",
]

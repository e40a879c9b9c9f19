"""A deployment's cache capacity: what its budget, its knee and its calibration are measured against.

Rules:
- A deployment's prefix-cache capacity is the sum of its prefill instances' KV pools, in tokens (SGLang's
  `max_total_num_tokens` of each prefill engine); decode memory is the same sum over its decode
  instances. The gateway reads the pools from the engines, the live ramp from their metrics, the
  simulator from its deployment files; all of them add them up here.
- Whole tokens stay whole: pools given as ints sum to an int, in the order given.
- Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

Tokens = TypeVar("Tokens", int, float)


def pooled_tokens(pool_tokens: Iterable[Tokens]) -> Tokens:
    """The tokens a group of instances holds together: the sum of their KV pools (0 for none)."""
    total: Tokens = sum(pool_tokens)
    return total


def uniform_pooled_tokens(pool_tokens: int, num_instances: int) -> int:
    """`pooled_tokens` of `num_instances` instances whose pools are all `pool_tokens` (a simulated deployment)."""
    return pooled_tokens([pool_tokens] * num_instances)

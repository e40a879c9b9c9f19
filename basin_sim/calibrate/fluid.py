# The fluid model of a deployment and the paper's risk test.
#
# Rules:
# - N = live sessions; X(N) = completed calls per second at N live sessions, measured (simulator or
#   live ramp) at a few N and interpolated linearly; K = calls per session. Sessions leave at X(N)/K,
#   so dN/dt = lambda - X(N)/K.
# - Fixed points are where X(N)/K = lambda. One where X/K crosses lambda upwards (X rising in N) is
#   stable: a small excess of sessions drains. One where it crosses downwards (X falling in N, past
#   the cache knee, as misses slow prefill) is unstable: past it N grows on its own. A surge that
#   carries N past the unstable point leaves the deployment collapsed at the old lambda: the
#   metastable failure.
# - Risk test: both limits as a number of live sessions. Cache: knee tokens / mean context of a live
#   session. Decode: decode KV tokens / (mean context x share of a session's life spent decoding).
#   Whichever is smaller binds first: "cache first" deployments are the ones Basin protects.
"""dN/dt = lambda - X(N)/K: fixed points, stability, and the cache-first / decode-first test."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class FixedPoint:
    live_sessions: float
    is_stable: bool


def _check(ns: Sequence[float], xs: Sequence[float]) -> None:
    if len(ns) != len(xs) or len(ns) < 2:
        raise ValueError(f"X(N) needs at least 2 (N, X) pairs of equal length, got {len(ns)} and {len(xs)}")
    if any(b <= a for a, b in pairwise(ns)):
        raise ValueError("N values of X(N) must be strictly increasing")


def drift(ns: Sequence[float], xs: Sequence[float], arrival_rate_per_s: float, calls_per_session: float,
          n: float) -> float:
    """dN/dt at N (X interpolated linearly, held flat beyond the measured range)."""
    _check(ns, xs)
    if n <= ns[0]:
        x = xs[0]
    elif n >= ns[-1]:
        x = xs[-1]
    else:
        i = next(k for k in range(1, len(ns)) if ns[k] >= n)
        share = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
        x = xs[i - 1] + share * (xs[i] - xs[i - 1])
    return arrival_rate_per_s - x / calls_per_session


def fixed_points(ns: Sequence[float], xs: Sequence[float], arrival_rate_per_s: float,
                 calls_per_session: float) -> list[FixedPoint]:
    """Where dN/dt = 0 on the measured range, in increasing N, each stable or not."""
    _check(ns, xs)
    f = [arrival_rate_per_s - x / calls_per_session for x in xs]
    points: list[FixedPoint] = []
    for i in range(1, len(ns)):
        a, b = f[i - 1], f[i]
        if a == 0 and (i == 1 or f[i - 2] != 0):
            points.append(FixedPoint(ns[i - 1], is_stable=b < 0 or (i >= 2 and f[i - 2] > 0)))
        if a * b < 0:
            n = ns[i - 1] + a / (a - b) * (ns[i] - ns[i - 1])
            points.append(FixedPoint(n, is_stable=a > 0))  # drift + then -: N is pushed back
    return points


@dataclass(frozen=True)
class RiskVerdict:
    cache_limit_sessions: float
    decode_limit_sessions: float
    verdict: str  # "cache first" or "decode first"

    def describe(self) -> str:
        return (f"cache knee reached at {self.cache_limit_sessions:.0f} live sessions, decode memory at "
                f"{self.decode_limit_sessions:.0f}: {self.verdict}")


def risk_test(knee_tokens: float, mean_context_tokens: float, decode_capacity_tokens: float,
              decode_busy_share: float) -> RiskVerdict:
    """The paper's test: which limit a growing number of live sessions meets first."""
    if min(knee_tokens, mean_context_tokens, decode_capacity_tokens) <= 0 or not 0 < decode_busy_share <= 1:
        raise ValueError("risk test needs positive token sizes and a decode busy share in (0, 1]")
    cache = knee_tokens / mean_context_tokens
    decode = decode_capacity_tokens / (mean_context_tokens * decode_busy_share)
    return RiskVerdict(cache, decode, "cache first" if cache < decode else "decode first")

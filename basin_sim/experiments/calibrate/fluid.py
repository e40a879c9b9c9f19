"""The fluid model dN/dt = lambda - X(N)/K of a deployment: fixed points, stability, and the paper's risk test.

Rules:
- N = live sessions; X(N) = completed calls per second at N live sessions, measured (simulator or
  live ramp) at a few N and interpolated linearly; K = calls per session. Sessions leave at X(N)/K,
  so dN/dt = lambda - X(N)/K.
- Fixed points are where X(N)/K = lambda. One where X/K crosses lambda upwards (X rising in N) is
  stable: a small excess of sessions drains. One where it crosses downwards (X falling in N, past
  the cache knee, as misses slow prefill) is unstable: past it N grows on its own. A surge that
  carries N past the unstable point leaves the deployment collapsed at the old lambda: the
  metastable failure.
- Risk test: both limits as a number of live sessions. Cache: knee tokens / mean context of a live
  session. Decode: decode KV tokens of all decode instances / what one live session holds on decode
  on average: (mean context + SGLang's `--num-reserved-decode-tokens` headroom, 512) x the share of
  its life it has a request holding decode memory (pre-allocated and waiting for or under prefill,
  transferring, or decoding; not while its tool runs or while it waits in the pre-allocation
  queue). SGLang PD's decode (sglang/srt/disaggregation/decode.py) keeps 512 tokens free per active
  request (`_active_reserved_tokens`) beyond the KV it holds, so memory is spent at that rate.
  Whichever limit is smaller binds first: "cache-first" deployments are the ones Basin protects;
  equal limits count as "decode-first" (cache-first must be shown, not assumed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from basin_sim.decode import NUM_RESERVED_DECODE_TOKENS


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


SGLANG_RESERVED_DECODE_TOKENS = NUM_RESERVED_DECODE_TOKENS  # the decode model's default (basin_sim/decode.py)
VERDICTS = ("cache-first", "decode-first")


@dataclass(frozen=True)
class RiskVerdict:
    """Both limits in live sessions and which binds first."""

    cache_limit_sessions: float
    decode_limit_sessions: float
    decode_tokens_per_session: float  # what one live session holds on decode, on average
    verdict: str  # one of VERDICTS

    def describe(self) -> str:
        """One line for people."""
        return (f"cache knee reached at {self.cache_limit_sessions:.0f} live sessions, decode memory at "
                f"{self.decode_limit_sessions:.0f}: {self.verdict}")


def risk_test(knee_tokens: float, mean_context_tokens: float, decode_capacity_tokens: float,
              decode_holding_share: float, headroom_tokens: float = SGLANG_RESERVED_DECODE_TOKENS) -> RiskVerdict:
    """The paper's test: which limit a growing number of live sessions meets first (rules above)."""
    sizes = {"knee_tokens": knee_tokens, "mean_context_tokens": mean_context_tokens,
             "decode_capacity_tokens": decode_capacity_tokens}
    bad = {name: value for name, value in sizes.items() if not value > 0}
    if bad:
        raise ValueError(f"risk test needs positive token sizes, got {bad}")
    if not 0 < decode_holding_share <= 1:
        raise ValueError(f"risk test needs a decode holding share in (0, 1], got {decode_holding_share!r}")
    if not headroom_tokens >= 0:
        raise ValueError(f"risk test needs headroom_tokens >= 0, got {headroom_tokens!r}")
    cache = knee_tokens / mean_context_tokens
    held = (mean_context_tokens + headroom_tokens) * decode_holding_share
    decode = decode_capacity_tokens / held
    return RiskVerdict(cache, decode, held, VERDICTS[0] if cache < decode else VERDICTS[1])

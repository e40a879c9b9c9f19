"""Continuum's TTL rule (the argmax of its Eq. 2 utility), every term measured online, one choice per call.

As published: Li et al., "Continuum" (later "CacheTTL"), arXiv 2511.02230 v2+, §4.1-4.2. The utility
of pinning the answered request r for tau seconds after its answer (Eq. 1's memory share drops out
for one request):
    U(tau) = P(tool duration <= tau | f) * (T * eta + PrefillReload(r)) - tau,   tau* = argmax U,
over tau in {0} and the observed durations (the empirical CDF jumps only there; a tie takes the shorter).

Rules (every term measured from what the serving engine has seen so far):
- P: the empirical CDF of every tool duration observed so far (answer -> the program's next call).
  Sessions carry no tool names, so there is no per-tool CDF: the whole sample is the paper's global stage.
- T: the sliding mean (last QUEUE_WINDOW) of the queueing delay evicted requests paid to re-enter: a
  program whose pin had expired (or was never set) when its next call came is "evicted"; that call's
  wait from its arrival until it is scheduled (its prefill starts) is one sample. Requests of new
  programs, and of programs still pinned, train nothing. 0 before any sample.
- eta = -Corr(k, N - k) over the call boundaries k = 1..N-1 of the last PROGRAM_WINDOW programs that
  completed (all N calls answered); 0 when undefined.
- PrefillReload(r): r's context (prompt + answer) prefilled alone on the profile, chunk by chunk
  (`Profile.prefill_batch_s`); with a host tier, its load-back (`Profile.load_back_s`).
- Cold start (v6 §4.2, K = 100): with at most K durations seen, T_default (2 s: the authors' preview
  code's fixed pin; design.md lists the reconstructions this module follows).
- Cost: U is linear in the point (tau, P(tau)), so the best point is a vertex of the CDF's upper
  convex hull (the first whose next hull slope is <= 1 / benefit), O(log n) per call; the hull is
  rebuilt whenever the sample has grown by HULL_GROWTH since the last build, so a choice reads the CDF
  of at least 1 / HULL_GROWTH of the durations seen. `best_ttl` is the plain scan the hull must agree
  with (tests compare them).
- No I/O.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from basin_sim.profile import Profile

COLD_START_SAMPLES = 100  # K of §4.2: with at most this many tool durations seen, T_default
DEFAULT_TTL_S = 2.0  # T_default: the preview code's FIXED_THRESHOLD_CONTINUUM
QUEUE_WINDOW = 256  # evicted re-entries whose mean is T (the reconstruction's queue_window)
PROGRAM_WINDOW = 256  # completed programs eta is measured over (its program_window)
HULL_GROWTH = 1.05  # rebuild the CDF's hull once the sample is this much larger than at the last build


@dataclass(frozen=True)
class TtlChoice:
    """tau* for one answered call and the terms it came from; `ttl_s` 0 means: do not pin."""

    ttl_s: float
    source: str  # "cold-start" (T_default) or "global-cdf"
    num_gaps: int  # tool durations seen
    benefit_s: float  # T * eta + PrefillReload
    reload_s: float
    queue_delay_s: float  # T
    eta: float
    finish_share: float  # P(tool duration <= ttl_s) (nan at cold start)
    utility_s: float  # U(ttl_s) (nan at cold start)


def reload_s(profile: Profile, context_tokens: int, has_host_tier: bool) -> float:
    """PrefillReload: `context_tokens` loaded back from the host tier, else prefilled alone, chunk by chunk."""
    if context_tokens < 0:
        raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
    if has_host_tier:
        return profile.load_back_s(context_tokens)
    total, done, chunk = 0.0, 0, profile.chunked_prefill_tokens
    while done < context_tokens:
        computed = min(chunk, context_tokens - done)
        total += profile.prefill_batch_s(computed, computed * (done + computed / 2), 0)
        done += computed
    return total


def memoryfulness(calls_per_session: Sequence[int]) -> float:
    """eta = -Corr(k, N - k) over every call boundary k = 1..N-1 of every session (0 when undefined)."""
    window = EtaWindow(max(1, len(calls_per_session)))
    for n in calls_per_session:
        window.add(n)
    return window.eta()


def best_ttl(gaps_s: Sequence[float], benefit_s: float) -> tuple[float, float, float]:
    """(tau*, P(gap <= tau*), U(tau*)) maximizing P(gap <= tau) * benefit_s - tau over {0} and the gaps (a scan)."""
    if not gaps_s:
        raise ValueError("best_ttl needs at least one tool gap")
    _check_gaps(gaps_s)
    gaps = sorted(gaps_s)
    n = len(gaps)
    share = bisect.bisect_right(gaps, 0.0) / n
    best = (0.0, share, share * benefit_s)
    for i, tau in enumerate(gaps):
        if i + 1 < n and gaps[i + 1] == tau:
            continue  # the CDF's value at tau counts every duplicate: take the last one
        share = (i + 1) / n
        utility = share * benefit_s - tau
        if utility > best[2]:  # strict: a tie keeps the shorter TTL
            best = (tau, share, utility)
    return best


def _check_gaps(gaps_s: Sequence[float]) -> None:
    if any(not math.isfinite(g) or g < 0 for g in gaps_s):
        raise ValueError(f"tool gaps must be finite and >= 0, got {min(gaps_s)!r}..{max(gaps_s)!r}")


class GapHull:
    """The upper convex hull of an empirical CDF's points (tau, P(gap <= tau)), tau = 0 and every gap."""

    def __init__(self, sorted_gaps_s: Sequence[float]) -> None:
        if not sorted_gaps_s:
            raise ValueError("GapHull needs at least one tool gap")
        n = len(sorted_gaps_s)
        points = [(0.0, bisect.bisect_right(sorted_gaps_s, 0.0) / n)]
        for i, tau in enumerate(sorted_gaps_s):
            if tau > 0 and (i + 1 == n or sorted_gaps_s[i + 1] != tau):
                points.append((tau, (i + 1) / n))
        hull: list[tuple[float, float]] = []
        for point in points:  # x increasing: keep only right turns (strictly concave)
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) >= 0:
                hull.pop()
            hull.append(point)
        self.num_gaps = n
        self._taus = [p[0] for p in hull]
        self._shares = [p[1] for p in hull]
        # slope of each hull edge, decreasing; negated so bisect sees an increasing list
        self._neg_slopes = [-(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(hull)]

    def best(self, benefit_s: float) -> tuple[float, float, float]:
        """(tau*, P(gap <= tau*), U(tau*)) as `best_ttl` gives them: the first vertex whose next slope <= 1/B."""
        # move right along the edges whose slope > 1 / benefit (each raises U)
        j = 0 if benefit_s <= 0 else bisect.bisect_left(self._neg_slopes, -1.0 / benefit_s)
        tau, share = self._taus[j], self._shares[j]
        return tau, share, share * benefit_s - tau


def _cross(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


class EtaWindow:
    """-Corr(k, N - k) over the boundaries of the last `size` completed programs, kept as running sums."""

    def __init__(self, size: int = PROGRAM_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self._programs: collections.deque[int] = collections.deque()
        self._size = size
        self._sums = [0.0] * 4  # boundaries, sum k, sum k^2, sum k(N - k) (sum N-k and sum (N-k)^2 equal the k sums)

    def add(self, num_calls: int) -> None:
        """A program completed with `num_calls` calls (it has num_calls - 1 boundaries)."""
        if num_calls < 1:
            raise ValueError(f"a completed program has >= 1 call, got {num_calls}")
        self._programs.append(num_calls)
        self._move(num_calls, +1)
        if len(self._programs) > self._size:
            self._move(self._programs.popleft(), -1)

    def _move(self, n: int, sign: int) -> None:
        pairs = n - 1
        sum_k = n * (n - 1) / 2
        sum_k2 = (n - 1) * n * (2 * n - 1) / 6
        for i, value in enumerate((pairs, sum_k, sum_k2, n * sum_k - sum_k2)):
            self._sums[i] += sign * value

    def eta(self) -> float:
        """eta; 0 when the correlation is undefined (fewer than 2 boundaries or no spread)."""
        pairs, sum_k, sum_k2, sum_kl = self._sums
        if pairs < 2:
            return 0.0
        # x = k and y = N - k have the same sums over a program's boundaries (k and N - k run over the same set)
        var = sum_k2 - sum_k * sum_k / pairs
        cov = sum_kl - sum_k * sum_k / pairs
        if var <= 1e-9 * max(1.0, sum_k2):
            return 0.0
        return max(-1.0, min(1.0, -cov / var))


class TtlEstimator:
    """Continuum's online TTL rule for one deployment: observe tool durations, evicted waits and completed
    programs; `choose` tau* for an answered call's context."""

    def __init__(self, profile: Profile, has_host_tier: bool) -> None:
        self._profile = profile
        self._has_host_tier = has_host_tier
        self._gaps: list[float] = []  # sorted
        self._hull: GapHull | None = None
        self._queue_delays: collections.deque[float] = collections.deque()
        self._queue_sum = 0.0
        self._eta = EtaWindow()

    @property
    def num_gaps(self) -> int:
        """Tool durations seen so far."""
        return len(self._gaps)

    @property
    def queue_delay_s(self) -> float:
        """T: the mean of the last QUEUE_WINDOW evicted re-entries' waits (0 before any)."""
        return self._queue_sum / len(self._queue_delays) if self._queue_delays else 0.0

    @property
    def eta(self) -> float:
        """eta over the completed programs of the window (0 when undefined)."""
        return self._eta.eta()

    def observe_tool(self, duration_s: float) -> None:
        """A program's next call came `duration_s` after its last answer."""
        _check_gaps([duration_s])
        bisect.insort(self._gaps, duration_s)

    def observe_evicted_wait(self, wait_s: float) -> None:
        """An evicted program's call waited `wait_s` from its arrival until it was scheduled."""
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise ValueError(f"an evicted wait must be finite and >= 0, got {wait_s!r}")
        self._queue_delays.append(wait_s)
        self._queue_sum += wait_s
        if len(self._queue_delays) > QUEUE_WINDOW:
            self._queue_sum -= self._queue_delays.popleft()

    def observe_completed(self, num_calls: int) -> None:
        """A program completed with all its `num_calls` calls answered."""
        self._eta.add(num_calls)

    def choose(self, context_tokens: int) -> TtlChoice:
        """tau* for pinning a call's `context_tokens` after its answer (T_default at cold start)."""
        reload = reload_s(self._profile, context_tokens, self._has_host_tier)
        queue_delay, eta = self.queue_delay_s, self.eta
        benefit = queue_delay * eta + reload
        n = len(self._gaps)
        if n <= COLD_START_SAMPLES:
            return TtlChoice(DEFAULT_TTL_S, "cold-start", n, benefit, reload, queue_delay, eta, math.nan, math.nan)
        if self._hull is None or n >= HULL_GROWTH * self._hull.num_gaps:
            self._hull = GapHull(self._gaps)
        ttl, share, utility = self._hull.best(benefit)
        return TtlChoice(ttl, "global-cdf", n, benefit, reload, queue_delay, eta, share, utility)


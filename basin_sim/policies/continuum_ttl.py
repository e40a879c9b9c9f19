# Continuum's TTL as published: Li et al., "Continuum" (later "CacheTTL"), arXiv 2511.02230 v2+, §4.1-4.2.
# The paper's Eq. (1) scales benefit and cost by the pin's memory share MemUsage(r)/M; for one request
# that factor is common to both and drops out, leaving Eq. (2), the utility of pinning r for tau seconds:
#     U(tau) = P(tool duration <= tau | f) * (T * eta + PrefillReload(r)) - tau,   tau* = argmax U,
# over tau in {0} and the observed durations (the empirical CDF jumps only there; a tie takes the shorter).
# T: sliding mean of the queueing delay evicted requests paid to re-enter (starts at 0); eta = -Corr(k, N-k)
# over completed programs (k calls done, N-k left); PrefillReload(r): the profiled time to rebuild r's
# context, recomputed (quadratic prefill fit) or, with offloading, reloaded (KV bytes / bandwidth).
# Cold start (v6 §4.2, K = 100): at most K durations seen -> T_default; at most K of tool f -> the global
# CDF; else f's own CDF. The abstract names these terms; the equations are as three independent
# reconstructions of the paper's estimator quote and implement them, all agreeing on Eq. (2):
# burninglhw/vllm-continuum vllm/v1/core/continuum_policy.py `choose_ttl` (and its
# docs/continuum-paper.md), YEYVHAIOU/vllm-continuum vllm/v1/core/dynamic_ttl_estimator.py and
# michiLXY03/vllm-continuum-plugin src/continuum_vllm/policy.py `PaperTTLPolicy`. The authors' preview
# code (Hanchenli/vllm-continuum, read in its forks Whrlicht/ and Weili-0234/vllm-continuum:
# vllm/v1/core/estimate_with_func.py `ToolCallEstimator.set_up_pin`) ships no estimator: it pins 2 s
# (FIXED_THRESHOLD_CONTINUUM) when the tool's mean duration is <= 2 s, else 0; that 2 s is the
# T_default used here (one reconstruction reads §4.2 as an Exp(1 s) prior instead).
#
# In this model (all pure; `continuum_ttl` takes what `PolicyContext` carries):
# - P: the empirical CDF of the run's tool gaps. Sessions carry no tool names, so there is no per-tool
#   CDF: the whole sample is the paper's global stage.
# - PrefillReload(r): r's prompt (what the prefill cache keeps of a call) prefilled alone on the profile,
#   chunk by chunk (`Profile.prefill_batch_s`); with a host tier, its load-back (`Profile.load_back_s`).
# - T * eta: the caller's `queue_delay_s` (the policy passes 0, see continuum.py); eta from the sample.
# - One TTL per run (the engine reads `pin_ttl_s` once): U is linear in the benefit and P is the same
#   for every call, so the sum of the per-call utilities is N * (P(tau) * mean benefit - tau); tau* of
#   the mean benefit maximizes the run's total.
"""Continuum's TTL rule (argmax of its Eq. 2 utility) on the profile's cost model and a run's tool gaps."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from basin_sim.profile import Deployment, Profile

COLD_START_SAMPLES = 100  # K of §4.2: with at most this many tool durations seen, T_default
DEFAULT_TTL_S = 2.0  # T_default: the preview code's FIXED_THRESHOLD_CONTINUUM

# per session: (tool gap in seconds, prompt tokens of the call before it) for each gap, in call order
ToolCalls = Sequence[Sequence[tuple[float, int]]]


@dataclass(frozen=True)
class TtlChoice:
    """tau* and the terms it came from; `ttl_s` 0 means: do not pin."""

    ttl_s: float
    source: str  # "cold-start" (T_default) or "global-cdf"
    num_gaps: int
    benefit_s: float  # mean over calls of T * eta + PrefillReload (nan at cold start with no calls)
    reload_s: float  # mean PrefillReload over calls
    eta: float
    finish_share: float  # P(tool duration <= ttl_s)
    utility_s: float  # U(ttl_s)


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
    ks = [float(k) for n in calls_per_session for k in range(1, n)]
    left = [float(n - k) for n in calls_per_session for k in range(1, n)]
    if len(ks) < 2 or len(set(ks)) < 2 or len(set(left)) < 2:
        return 0.0
    return -statistics.correlation(ks, left)


def best_ttl(gaps_s: Sequence[float], benefit_s: float) -> tuple[float, float, float]:
    """(tau*, P(gap <= tau*), U(tau*)) maximizing P(gap <= tau) * benefit_s - tau over {0} and the gaps."""
    if not gaps_s:
        raise ValueError("best_ttl needs at least one tool gap")
    if any(not math.isfinite(g) or g < 0 for g in gaps_s):
        raise ValueError(f"tool gaps must be finite and >= 0, got {min(gaps_s)!r}..{max(gaps_s)!r}")
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


def continuum_ttl(tool_calls: ToolCalls, deployment: Deployment, queue_delay_s: float = 0.0) -> TtlChoice:
    """tau* for a run: Eq. (2) on the gap CDF and the mean benefit of its calls (cold start: T_default)."""
    if not (math.isfinite(queue_delay_s) and queue_delay_s >= 0):
        raise ValueError(f"queue_delay_s must be finite and >= 0, got {queue_delay_s!r}")
    gaps = [gap for calls in tool_calls for gap, _ in calls]
    eta = memoryfulness([len(calls) + 1 for calls in tool_calls])
    reloads = [reload_s(deployment.profile, tokens, deployment.has_host_tier) for calls in tool_calls
               for _, tokens in calls]
    reload_mean = statistics.fmean(reloads) if reloads else math.nan
    benefit = queue_delay_s * eta + reload_mean
    if len(gaps) <= COLD_START_SAMPLES:
        return TtlChoice(DEFAULT_TTL_S, "cold-start", len(gaps), benefit, reload_mean, eta, math.nan, math.nan)
    ttl, share, utility = best_ttl(gaps, benefit)
    return TtlChoice(ttl, "global-cdf", len(gaps), benefit, reload_mean, eta, share, utility)

# Predicted peaks for a session pool, made once per run set with the shipped ONNX predictor.
#
# Rules: the predictor sees only what the gateway sees at a session's first call (`task_text`, the
# first prompt's size); the whole pool goes through `predict_batch` in one call. The reservation
# quantile q: each session reserves m(q) x its prediction, m read from the predictor file for the
# session's benchmark (`PeakPredictor.multiplier`), exactly as the gateway reads it; q None: m = 1.
"""Batch-predict a pool's peaks; their reservation multipliers from the predictor file."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from basin_runtime.session_table import Session

DEFAULT_MODEL = Path("models/peak_predictor.onnx")
DEFAULT_RESERVATION_QUANTILE = 0.9  # the gateway's default (`GatewayConfig.reservation_quantile`)


class BatchPredictor(Protocol):
    """What `basin_runtime.predictor.PeakPredictor` offers the simulator."""

    def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> Sequence[float]:
        """Predicted peak tokens of many sessions."""
        ...


class ReservingPredictor(BatchPredictor, Protocol):
    """A batch predictor that also carries its reservation multipliers (`PeakPredictor`)."""

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        """m(q) for this benchmark's sessions."""
        ...


def load_predictor(path: Path) -> ReservingPredictor:
    """The ONNX peak predictor at `path` (onnxruntime; checked by `PeakPredictor.load`)."""
    from basin_runtime.predictor import PeakPredictor

    return PeakPredictor.load(path)  # type: ignore[return-value]


def predict_pool(predictor: BatchPredictor, pool: Sequence[Session]) -> dict[str, float]:
    """Pool session id -> predicted peak tokens, from task text and first prompt size only."""
    peaks = predictor.predict_batch([s.task_text for s in pool], [s.first_prompt_tokens for s in pool])
    return {s.session_id: float(p) for s, p in zip(pool, peaks, strict=True)}


def reservation_multipliers(predictor: ReservingPredictor, pool: Sequence[Session],
                            q: float | None) -> dict[str, float]:
    """Pool session id -> m(q) of the predictor file for its benchmark; empty when q is None (bare predictions).
    Raises `basin_runtime.predictor.PredictorError` for a file without multipliers or a q off their grid."""
    if q is None:
        return {}
    by_benchmark = {b: predictor.multiplier(q, b) for b in {s.benchmark for s in pool}}
    return {s.session_id: by_benchmark[s.benchmark] for s in pool}


def reserved_peaks(peaks: Mapping[str, float], multipliers: Mapping[str, float],
                   scale: float = 1.0) -> dict[str, float]:
    """Pool session id -> what it reserves at arrival: scale x m(q) x predicted peak (m = 1 without multipliers)."""
    return {sid: scale * multipliers.get(sid, 1.0) * peak for sid, peak in peaks.items()}


def add_reservation_quantile(parser: argparse.ArgumentParser, with_revisions: bool = True) -> None:
    """The --reservation-quantile and (`with_revisions`) --revise-at-calls options, as the gateway's (default
    0.9; 3 and 5)."""
    if with_revisions:
        parser.add_argument("--revise-at-calls", type=int, nargs="*", default=list(DEFAULT_REVISE_AT_CALLS),
                            metavar="K",
                            help="basin: re-estimate a session's peak at these calls with the online model beside "
                            "the model file (default 3 5, as the gateway; none given: never)")
    from basin_runtime.predictor import reservation_quantile_arg

    parser.add_argument("--reservation-quantile", type=reservation_quantile_arg, default=DEFAULT_RESERVATION_QUANTILE,
                        metavar="Q", help="basin: reserve m(Q) x each predicted peak, m from the model file for the "
                        f"session's benchmark (default {DEFAULT_RESERVATION_QUANTILE}, as the gateway; 'none': the "
                        "bare prediction)")


Revisions = dict[str, dict[int, tuple[float, float]]]
DEFAULT_REVISE_AT_CALLS = (3, 5)  # the gateway's default (`GatewayConfig.revise_at_calls`)


def online_revisions(predictor: ReservingPredictor, pool: Sequence[Session], peaks: Mapping[str, float],
                     q: float | None, calls: Sequence[int] = DEFAULT_REVISE_AT_CALLS) -> Revisions:
    """Pool session id -> call k -> (re-estimated peak, m_k(q)) at each revision call the session reaches,
    from the predictor file's online model (`PeakPredictor.online`) as the gateway computes them; empty
    without an online model or calls."""
    online = getattr(predictor, "online", None)
    if online is None or not calls:
        return {}
    out: Revisions = {s.session_id: {} for s in pool}
    for k in calls:
        reached = [s for s in pool if len(s.calls) >= k]
        if not reached:
            continue
        estimates = online.predict_batch([peaks[s.session_id] for s in reached],
                                         [[c.prompt_tokens for c in s.calls[:k]] for s in reached],
                                         [[c.completion_tokens for c in s.calls[:k - 1]] for s in reached])
        m = 1.0 if q is None else online.multiplier(q, k)
        for session, estimate in zip(reached, estimates, strict=True):
            out[session.session_id][k] = (float(estimate), m)
    return out

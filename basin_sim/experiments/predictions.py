"""Predicted peaks for a session pool, made once per run set, and their reservation multipliers.

Rules:
- The predictor sees only what the gateway sees at a session's first call (`task_text`, the first
  prompt's size); the whole pool goes through `predict_batch` in one call.
- Sources (`--predictions`): `out-of-fold` (the default) takes each session's prediction from the
  nested stage's table (data/nested/oof_predictions.parquet, pooled model: a model whose tuning and
  fit never saw any run of that session's task); a pool session the table does not hold (a preset's
  or a gateway log's, never in the training table) is predicted by the shipped model, and the run
  counts both. The online re-estimates come from the same source (revisions.py: out of fold from
  the online stage's table). `in-sample` predicts every session with the shipped model, trained on
  these very sessions: a near-oracle, kept as a named ablation.
- The reservation quantile q: each session reserves m(q) x its prediction, m read from the predictor
  file for the session's benchmark (`PeakPredictor.multiplier`), exactly as the gateway reads it;
  q None: m = 1.
- onnxruntime is imported only inside the functions that load a predictor or hash its file: the
  event model takes predictions as numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from basin_runtime.session_table import Session

DEFAULT_MODEL = Path("models/peak_predictor.onnx")
DEFAULT_OUT_OF_FOLD = Path("data/nested/oof_predictions.parquet")
PREDICTION_SOURCES = ("out-of-fold", "in-sample")
OUT_OF_FOLD_COLUMN = "pooled_predicted"  # the shipped models/peak_predictor.onnx is the pooled model (served.py: which)


class PredictionsError(ValueError):
    """An out-of-fold table that is missing or unreadable; the message names it and the command that builds it."""
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
    """Pool session id -> predicted peak tokens, from task text and first prompt size only (by the file serving the
    session's benchmark when the predictor has one per benchmark: `served.ServedByBenchmark.for_benchmark`)."""
    route = getattr(predictor, "for_benchmark", None)
    if route is not None:
        out: dict[str, float] = {}
        for bench in sorted({s.benchmark for s in pool}):
            out |= predict_pool(route(bench), [s for s in pool if s.benchmark == bench])
        return out
    peaks = predictor.predict_batch([s.task_text for s in pool], [s.first_prompt_tokens for s in pool])
    return {s.session_id: float(p) for s, p in zip(pool, peaks, strict=True)}


def load_out_of_fold(path: Path, column: str = OUT_OF_FOLD_COLUMN) -> dict[str, float]:
    """Session id -> its out-of-fold predicted peak (`column`), from the nested stage's table."""
    import pyarrow.parquet as pq

    if not path.exists():
        raise PredictionsError(f"no out-of-fold predictions at {path}: build them with `make repro` (stage nested), "
                               "or pass --predictions in-sample (the shipped model on the sessions it was trained on)")
    try:
        table = pq.read_table(path, columns=["session_id", column]).to_pydict()
    except Exception as exc:  # pyarrow raises several kinds for a bad file
        raise PredictionsError(f"{path}: not an out-of-fold table with session_id and {column} ({exc}); a table "
                               "written before issue 49 has no selected_predicted: re-run the nested stage "
                               "(`make repro`) or pass --first-call pooled") from exc
    return {str(sid): float(p) for sid, p in zip(table["session_id"], table[column], strict=True)
            if p is not None}


Peaks = tuple[dict[str, float], dict[str, int]]  # pool session id -> predicted peak; how many came from where


def pool_peaks(predictor: BatchPredictor, pool: Sequence[Session], source: str,
               out_of_fold: Path = DEFAULT_OUT_OF_FOLD, token_scale: float = 1.0,
               column: str = OUT_OF_FOLD_COLUMN) -> Peaks:
    """(pool session id -> predicted peak, how many came from where) for a prediction source (see the rules).

    A pool scaled by `token_scale` (workload.median_peak_tokens) is predicted as recorded and the prediction
    scaled: the recipe's ridge on log peak with a log first-prompt feature, refitted on sessions all scaled
    by one factor, keeps its coefficients and moves its intercept by log(scale)."""
    recorded = pool if token_scale == 1.0 else [_unscaled(s, token_scale) for s in pool]
    peaks, sources = _pool_peaks(predictor, recorded, source, out_of_fold, column)
    return {sid: peak * token_scale for sid, peak in peaks.items()}, sources


def _unscaled(session: Session, token_scale: float) -> Session:
    """What the predictor reads of a scaled session as recorded: its first prompt's size divided back."""
    first = max(1, round(session.first_prompt_tokens / token_scale))
    return dataclasses.replace(session, calls=(dataclasses.replace(session.calls[0], prompt_tokens=first),))


def _pool_peaks(predictor: BatchPredictor, pool: Sequence[Session], source: str, out_of_fold: Path,
                column: str = OUT_OF_FOLD_COLUMN) -> Peaks:
    if source == "in-sample":
        return predict_pool(predictor, pool), {"in-sample": len(pool)}
    if source != "out-of-fold":
        raise PredictionsError(f"unknown prediction source {source!r}; known: {', '.join(PREDICTION_SOURCES)}")
    table = load_out_of_fold(out_of_fold, column)
    held = [s for s in pool if s.session_id in table]
    others = [s for s in pool if s.session_id not in table]
    peaks = {s.session_id: table[s.session_id] for s in held}
    if others:
        peaks.update(predict_pool(predictor, others))
    return peaks, {"out-of-fold": len(held), "shipped model, session not in the training table": len(others)}


def peaks_tag(source: str, out_of_fold: Path = DEFAULT_OUT_OF_FOLD, served: str = "") -> str:
    """What a knee calibration's peaks depend on beyond the model file: '' in-sample, else the table's digest
    (called once `pool_peaks` has read the table, so the file is known to be there); `served` (served.py's
    `served_tag`: the per-benchmark files with selection on, '' off) is appended when set."""
    suffix = f":{served}" if served else ""
    if source == "in-sample":
        return served
    from basin_runtime.model_files import file_sha256

    return f"out-of-fold:{file_sha256(out_of_fold)}{suffix}"


def model_sha256(path: Path) -> str:
    """The predictor file's SHA-256, as the gateway checks a calibration against it."""
    from basin_runtime.model_files import file_sha256

    return file_sha256(path)


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


Revised = dict[str, dict[int, float]]  # pool session id -> call k -> what it reserves from that call on


def revised_reservations(revisions: Mapping[str, Mapping[int, tuple[float, float]]], scale: float = 1.0) -> Revised:
    """Pool session id -> call k -> what it reserves from call k on: scale x m_k(q) x the re-estimate (the core's
    revision, before its max with the context)."""
    return {sid: {k: scale * m * peak for k, (peak, m) in by_call.items()} for sid, by_call in revisions.items()
            if by_call}


def revised_tag(revised: Mapping[str, Mapping[int, float]]) -> str:
    """A digest of revised reservations (for a calibration's cache key); "" when there are none."""
    if not any(revised.values()):
        return ""
    import hashlib
    import json

    canonical = json.dumps({sid: {str(k): round(v, 3) for k, v in sorted(by_call.items())}
                            for sid, by_call in sorted(revised.items()) if by_call}, sort_keys=True)
    return "revised " + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def reservation_quantile_arg(text: str) -> float | None:
    """argparse type of --reservation-quantile (`basin_runtime.predictor`'s, imported when a flag is read)."""
    from basin_runtime.predictor import reservation_quantile_arg as parse

    return parse(text)


Revisions = dict[str, dict[int, tuple[float, float]]]
DEFAULT_REVISE_AT_CALLS: tuple[int, ...] = ()  # no calls given: no revisions (the run chooses them, revisions.py)


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

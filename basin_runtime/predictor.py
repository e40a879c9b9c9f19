"""Load an exported peak predictor (ONNX) and predict a session's peak context at its first call.

Uses onnxruntime only. `PeakPredictor.load` checks the file's metadata and inputs and refuses an
incompatible one with a clear error, then warms the session up so the first prediction costs what
the rest do. Predictions are clamped to [max(1, first_prompt_tokens), MAX_PEAK_TOKENS]: a peak is
never below the prompt already seen, and a non-finite output becomes the upper bound (the cautious
reservation), so callers never see a non-positive or non-finite number.

Reservation multipliers: a file exported by this version carries `basin.reservation_multipliers`,
m(q) = the q-quantile of true/predicted peak over the model's task-grouped out-of-fold predictions
(`basin_pipeline.reservations`), per benchmark and over all its rows, on a grid of q. `multiplier(q,
benchmark)` reads it: the benchmark's row when the file has one, else the all-rows row (a
single-benchmark file answers for its benchmark either way); between grid points m is interpolated
linearly; a q outside the grid, or a file without the table, is a `PredictorError`. Reserving
`multiplier(q) x predict(...)` covers about a share q of sessions' peaks on new tasks.

Online re-estimates (`basin_runtime/online.py`): when `<stem>.online.onnx` sits beside the file and
was trained with this first-call model (same training-data hash and params), `load` loads it and
`predict_online(task_text, first_prompt_tokens, prompt_tokens, completion_tokens)` re-estimates the
peak at call k = len(prompt_tokens) (k = 1, with no completions, is `predict`);
`online_multiplier(q, k)` is its m_k(q). An online file of another first-call model is refused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from basin_runtime.model_files import multiplier_at, open_session
from basin_runtime.online import OnlineError, OnlineModel, check_history, clamp_peak, online_file_name

SCHEMA_VERSION = "1"
INPUTS = {"task_text": "tensor(string)", "task_chars": "tensor(float)", "first_prompt_tokens": "tensor(float)"}
OUTPUT = "peak_tokens"
MAX_PEAK_TOKENS = 16_777_216.0
DEFAULT_MODEL_STEM = "peak_predictor"


class PredictorError(ValueError):
    """A predictor file that cannot be loaded or honoured."""


def reservation_quantile_arg(text: str) -> float | None:
    """argparse type of a reservation quantile: a number in (0, 1), or `none` (reserve the bare prediction)."""
    if text.strip().lower() in ("none", "null"):
        return None
    try:
        q = float(text)
    except ValueError:
        q = float("nan")
    if not 0 < q < 1:
        raise argparse.ArgumentTypeError(f"expected a quantile in (0, 1) or 'none', got {text!r}")
    return q


def model_file_name(benchmark: str | None = None) -> str:
    """`peak_predictor.onnx` (pooled default) or `peak_predictor-<benchmark>.onnx`."""
    return f"{DEFAULT_MODEL_STEM}.onnx" if benchmark is None else f"{DEFAULT_MODEL_STEM}-{benchmark}.onnx"


@dataclass(frozen=True)
class PredictorInfo:
    """What the file says about itself."""

    path: str
    model_name: str
    tokenizer: str
    benchmarks: tuple[str, ...]
    training_data_sha256: str
    synthetic: bool
    params: dict[str, Any]
    metrics: dict[str, Any]
    reservation_multipliers: dict[str, Any] | None = None  # see the module docstring; None in older files


def _metadata(session: ort.InferenceSession, path: Path) -> dict[str, str]:
    props: dict[str, str] = dict(session.get_modelmeta().custom_metadata_map)
    version = props.get("basin.schema_version")
    if version != SCHEMA_VERSION:
        raise PredictorError(f"{path}: predictor schema version {version!r}; this runtime reads {SCHEMA_VERSION!r} "
                             "(re-export the model with this version of Basin)")
    return props


def _check_signature(session: ort.InferenceSession, path: Path) -> None:
    found = {i.name: i.type for i in session.get_inputs()}
    if found != INPUTS:
        raise PredictorError(f"{path}: inputs {found} do not match the expected {INPUTS}")
    outputs = [o.name for o in session.get_outputs()]
    if outputs != [OUTPUT]:
        raise PredictorError(f"{path}: outputs {outputs}, expected [{OUTPUT!r}]")


def _multipliers(raw: str | None, path: Path) -> dict[str, Any] | None:
    """The multipliers table, checked: ascending quantiles in (0, 1), rows as long, values >= 0 and non-decreasing."""
    if raw is None:
        return None
    try:
        table = json.loads(raw)
        grid = [float(q) for q in table["quantiles"]]
        rows = {"all": table["all"], **{f"by_benchmark.{b}": r for b, r in table["by_benchmark"].items()}}
        ok = bool(grid) and all(0 < a < b < 1 for a, b in itertools.pairwise(grid)) and 0 < grid[0] < 1 and all(
            len(r) == len(grid) and all(float(m) >= 0 for m in r) and list(r) == sorted(r) for r in rows.values())
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PredictorError(f"{path}: basin.reservation_multipliers is malformed: {exc}") from exc
    if not ok:
        raise PredictorError(f"{path}: basin.reservation_multipliers must hold ascending quantiles in (0, 1) and, per "
                             f"row, as many non-negative non-decreasing multipliers: {raw[:200]}")
    return {"quantiles": grid, "all": [float(m) for m in table["all"]],
            "by_benchmark": {str(b): [float(m) for m in r] for b, r in table["by_benchmark"].items()}}


def _online_for(path: Path, info: PredictorInfo) -> OnlineModel | None:
    """The online model beside `path`, if there is one and it was trained with this first-call model."""
    online_path = online_file_name(path)
    if not online_path.exists():
        return None
    try:
        online = OnlineModel.load(online_path)
    except OnlineError as exc:
        raise PredictorError(str(exc)) from exc
    if (online.first_call_training_data_sha256, online.first_call_params) != (info.training_data_sha256, info.params):
        raise PredictorError(f"{online_path}: trained with another first-call model than {path} (training data or "
                             "params differ); re-export both")
    return online


class PeakPredictor:
    """Predicted peak prompt tokens of a session from its task text and first prompt size."""

    def __init__(self, session: ort.InferenceSession, info: PredictorInfo, online: OnlineModel | None = None) -> None:
        self._session = session
        self.info = info
        self.online = online

    @classmethod
    def load(cls, path: str | Path, expected_tokenizer: str | None = None) -> PeakPredictor:
        """Load and check a predictor file; raises `PredictorError` naming the file and the problem."""
        path = Path(path)
        if not path.is_file():
            raise PredictorError(f"{path}: no such predictor file")
        session = open_session(path, PredictorError)
        props = _metadata(session, path)
        _check_signature(session, path)
        tokenizer = props.get("basin.tokenizer", "?")
        if expected_tokenizer is not None and tokenizer != expected_tokenizer:
            raise PredictorError(f"{path}: trained on {tokenizer!r} token counts, but this gateway counts with "
                                 f"{expected_tokenizer!r}")
        info = PredictorInfo(
            path=str(path), model_name=props.get("basin.model_name", "?"), tokenizer=tokenizer,
            benchmarks=tuple(json.loads(props.get("basin.benchmarks", "[]"))),
            training_data_sha256=props.get("basin.training_data_sha256", ""),
            synthetic=json.loads(props.get("basin.synthetic", "false")),
            params=json.loads(props.get("basin.params", "{}")), metrics=json.loads(props.get("basin.metrics", "{}")),
            reservation_multipliers=_multipliers(props.get("basin.reservation_multipliers"), path),
        )
        predictor = cls(session, info, _online_for(path, info))
        predictor.predict("warm up the session", 1000)
        if predictor.online is not None:
            predictor.predict_online("warm up the session", 1000, [1000, 1500], [100])
        return predictor

    def predict_online(self, task_text: str, first_prompt_tokens: int, prompt_tokens: Sequence[int],
                       completion_tokens: Sequence[int]) -> float:
        """Peak re-estimated at call k = len(prompt_tokens), from calls 1..k's prompts and 1..k-1's completions."""
        try:
            check_history(prompt_tokens, completion_tokens)
        except OnlineError as exc:
            raise PredictorError(f"{self.info.path}: {exc}") from exc
        first = self.predict(task_text, first_prompt_tokens)
        if len(prompt_tokens) == 1:
            return first
        return self._online().predict(first, prompt_tokens, completion_tokens)

    def _online(self) -> OnlineModel:
        if self.online is None:
            raise PredictorError(f"{self.info.path}: no online model beside it "
                                 f"({online_file_name(self.info.path).name})")
        return self.online

    def online_multiplier(self, q: float, k: int, benchmark: str | None = None) -> float:
        """m_k(q) of the re-estimate at call k (k = 1: the first-call `multiplier`)."""
        if k == 1:
            return self.multiplier(q, benchmark)
        try:
            return self._online().multiplier(q, k)
        except OnlineError as exc:
            raise PredictorError(str(exc)) from exc

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        """m(q): reserve this x `predict(...)` to cover a share `q` of true peaks (see the module docstring)."""
        table = self.info.reservation_multipliers
        if table is None:
            raise PredictorError(f"{self.info.path}: carries no reservation multipliers (exported before they "
                                 "existed); re-export it, or reserve the bare prediction")
        by_benchmark = table["by_benchmark"]
        if benchmark is None and len(by_benchmark) == 1:
            benchmark = next(iter(by_benchmark))
        row = by_benchmark.get(benchmark, table["all"])
        return multiplier_at(q, table["quantiles"], row, PredictorError, self.info.path, "multipliers")

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        """Predicted peak tokens of one session (`predict_batch` of one row, without its array work: the
        gateway's first-call path)."""
        first = float(first_prompt_tokens)
        if not (math.isfinite(first) and first >= 0):
            raise ValueError("first_prompt_tokens must be finite and non-negative")
        text = np.empty((1, 1), dtype=object)
        text[0, 0] = task_text
        feeds = {"task_text": text, "task_chars": np.array([[len(task_text)]], dtype=np.float32),
                 "first_prompt_tokens": np.array([[first]], dtype=np.float32)}
        return clamp_peak(float(self._session.run([OUTPUT], feeds)[0].flat[0]), first)

    def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> np.ndarray:
        """Predicted peak tokens of many sessions (float64 array)."""
        if len(task_texts) != len(first_prompt_tokens):
            raise ValueError(f"{len(task_texts)} task texts but {len(first_prompt_tokens)} first-prompt sizes")
        first = np.asarray(first_prompt_tokens, dtype=np.float64)
        if np.any(~np.isfinite(first)) or np.any(first < 0):
            raise ValueError("first_prompt_tokens must be finite and non-negative")
        feeds = {
            "task_text": np.asarray(task_texts, dtype=object).reshape(-1, 1),
            "task_chars": np.asarray([len(t) for t in task_texts], dtype=np.float32).reshape(-1, 1),
            "first_prompt_tokens": first.astype(np.float32).reshape(-1, 1),
        }
        raw = np.asarray(self._session.run([OUTPUT], feeds)[0], dtype=np.float64).ravel()
        raw = np.where(np.isfinite(raw), raw, MAX_PEAK_TOKENS)
        return np.clip(raw, np.maximum(first, 1.0), MAX_PEAK_TOKENS)


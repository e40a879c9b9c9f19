"""The online re-estimate of a session's peak: what the gateway knows after call k -> the session's peak.

Rules:
- Inputs at call k: the first-call prediction f (the first-call model's, `PeakPredictor.predict`),
  the prompt sizes p_1..p_k of calls 1..k and the completion sizes c_1..c_{k-1} of the calls already
  answered. k = 1 is the first-call prediction itself; this model serves k >= 2.
- Features (`FEATURES`, the same function at training and at serving): log1p(f), log1p(p_k),
  g = log1p(p_k) - log1p(p_1), g / (k - 1), log1p(c_1 + ... + c_{k-1}), log1p(k).
- One ridge per call slot s in `SLOTS` on those features (unused ones weigh 0), for log1p(peak);
  call k uses the largest slot <= k (calls past the last slot use the last). The file is a tiny ONNX
  graph: inputs `features` float [N, 6] and `slot` int64 [N], weights W [S, 6] and b [S];
  `peak_tokens` = exp(sum(features * W[slot]) + b[slot]) - 1.
- Predictions are clamped to [p_k, MAX_PEAK_TOKENS]: the peak is at least the context seen.
- Multipliers: like the first-call model's, per slot (`basin.online_multipliers`: quantiles and, per
  slot, m(q) from out-of-fold ratios), so a revision reserves m_k(q) x the re-estimate.
- The file names the first-call model it was trained with (its training-data hash and params); a
  first-call model loads its online file (`<stem>.online.onnx` beside it) only when they match.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from basin_runtime.model_files import multiplier_at, open_session

ONLINE_SCHEMA_VERSION = "1"
SLOTS = (2, 3, 4, 5, 7, 10)
FEATURES = ("log_first_call", "log_context", "log_growth", "log_growth_per_call", "log_completions", "log_calls")
INPUTS = {"features": "tensor(float)", "slot": "tensor(int64)"}
OUTPUT = "peak_tokens"
MAX_PEAK_TOKENS = 16_777_216.0


class OnlineError(ValueError):
    """An online model file that cannot be loaded, or a call history it cannot take."""


def online_file_name(first_call_file: str | Path) -> Path:
    """`peak_predictor-x.onnx` -> `peak_predictor-x.online.onnx`, beside it."""
    path = Path(first_call_file)
    return path.with_name(f"{path.stem}.online.onnx")


def slot_index(k: int) -> int:
    """Index into `SLOTS` of the slot that serves call k >= 2."""
    if k < SLOTS[0]:
        raise OnlineError(f"the online model serves calls k >= {SLOTS[0]}, got k = {k}")
    return max(i for i, s in enumerate(SLOTS) if s <= k)


def check_history(prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> None:
    """Calls 1..k: k >= 1 prompt sizes and k - 1 completion sizes, all finite and >= 0."""
    if len(prompt_tokens) < 1:
        raise OnlineError("prompt_tokens must hold the prompt sizes of calls 1..k (k >= 1), got none")
    if len(completion_tokens) != len(prompt_tokens) - 1:
        raise OnlineError(f"completion_tokens must hold the k - 1 = {len(prompt_tokens) - 1} completions of the "
                          f"calls before call k, got {len(completion_tokens)}")
    for name, values in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise OnlineError(f"{name} must be finite and >= 0")


def features(first_call: float, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> list[float]:
    """The feature row of `FEATURES` at call k = len(prompt_tokens) (>= 2)."""
    k = len(prompt_tokens)
    context, first = math.log1p(prompt_tokens[-1]), math.log1p(prompt_tokens[0])
    growth = context - first
    return [math.log1p(max(first_call, 0.0)), context, growth, growth / max(k - 1, 1),
            math.log1p(sum(completion_tokens)), math.log1p(k)]


def clamp_peak(raw: float, floor: float) -> float:
    """A model's raw peak as a prediction: not finite -> MAX_PEAK_TOKENS; then within [max(floor, 1),
    MAX_PEAK_TOKENS] (`np.clip`'s order: the upper bound wins)."""
    if not math.isfinite(raw):
        raw = MAX_PEAK_TOKENS
    return min(max(raw, floor, 1.0), MAX_PEAK_TOKENS)


class OnlineModel:
    """A loaded online re-estimate model (onnxruntime only)."""

    def __init__(self, session: ort.InferenceSession, path: Path, props: dict[str, str]) -> None:
        self._session = session
        self.path = path
        self.first_call_training_data_sha256 = props.get("basin.first_call_training_data_sha256", "")
        self.first_call_params = json.loads(props.get("basin.first_call_params", "{}"))
        self.benchmarks = tuple(json.loads(props.get("basin.benchmarks", "[]")))
        self.slots: tuple[int, ...] = tuple(int(k) for k in json.loads(props.get("basin.slots", "null")) or SLOTS)
        self.metrics: dict[str, Any] = json.loads(props.get("basin.metrics", "{}"))
        self.multipliers: dict[str, Any] = json.loads(props.get("basin.online_multipliers", "{}"))

    @classmethod
    def load(cls, path: str | Path) -> OnlineModel:
        """Load and check an online model file; `OnlineError` naming the file and the problem."""
        path = Path(path)
        if not path.is_file():
            raise OnlineError(f"{path}: no such online model file")
        session = open_session(path, OnlineError)
        props: dict[str, str] = dict(session.get_modelmeta().custom_metadata_map)
        if props.get("basin.online_schema_version") != ONLINE_SCHEMA_VERSION:
            raise OnlineError(f"{path}: online schema version {props.get('basin.online_schema_version')!r}; this "
                              f"runtime reads {ONLINE_SCHEMA_VERSION!r}")
        found = {i.name: i.type for i in session.get_inputs()}
        if found != INPUTS or [o.name for o in session.get_outputs()] != [OUTPUT]:
            raise OnlineError(f"{path}: inputs {found} / outputs do not match {INPUTS} -> {OUTPUT!r}")
        model = cls(session, path, props)
        grid, by_slot = model.multipliers.get("quantiles"), model.multipliers.get("by_slot")
        if not (isinstance(grid, list) and grid and isinstance(by_slot, dict)
                and all(len(by_slot.get(str(s), ())) == len(grid) for s in SLOTS)):
            raise OnlineError(f"{path}: basin.online_multipliers must hold quantiles and a row per slot {SLOTS}")
        return model

    def predict(self, first_call: float, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> float:
        """Re-estimated peak tokens at call k = len(prompt_tokens) >= 2 (`predict_batch` of one row, without
        its array work: the gateway's revision path)."""
        check_history(prompt_tokens, completion_tokens)
        feeds = {"features": np.array([features(first_call, prompt_tokens, completion_tokens)], dtype=np.float32),
                 "slot": np.array([slot_index(len(prompt_tokens))], dtype=np.int64)}
        return clamp_peak(float(self._session.run([OUTPUT], feeds)[0].flat[0]), float(prompt_tokens[-1]))

    def predict_batch(self, first_calls: Sequence[float], prompt_tokens: Sequence[Sequence[int]],
                      completion_tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Re-estimated peaks of many sessions, each at its own k (float64 array)."""
        rows, slots, floors = [], [], []
        for first, prompts, completions in zip(first_calls, prompt_tokens, completion_tokens, strict=True):
            check_history(prompts, completions)
            slots.append(slot_index(len(prompts)))
            rows.append(features(first, prompts, completions))
            floors.append(max(float(prompts[-1]), 1.0))
        feeds = {"features": np.asarray(rows, dtype=np.float32).reshape(-1, len(FEATURES)),
                 "slot": np.asarray(slots, dtype=np.int64)}
        raw = np.asarray(self._session.run([OUTPUT], feeds)[0], dtype=np.float64).ravel()
        raw = np.where(np.isfinite(raw), raw, MAX_PEAK_TOKENS)
        return np.clip(raw, np.asarray(floors), MAX_PEAK_TOKENS)

    def multiplier(self, q: float, k: int) -> float:
        """m_k(q) for a revision at call k (linear between the grid's quantiles)."""
        row = self.multipliers["by_slot"][str(SLOTS[slot_index(k)])]
        return multiplier_at(q, self.multipliers["quantiles"], row, OnlineError, self.path, "online multipliers")

# The peak predictors the gateway serves with, one per workload plus the default.
#
# Rules:
# - All models are loaded and checked at start-up (`PeakPredictor.load`, with the gateway's
#   tokenizer as the expected one); a file that cannot be loaded stops start-up naming the file.
# - A call's workload header picks the model; no header, or a workload without a model of its own,
#   gets the default model. The workload name is kept either way (it goes to the session log).
"""Predictor selection by workload."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from basin_runtime.gateway.config import ConfigError
from basin_runtime.predictor import PeakPredictor, PredictorError


class PeakModel(Protocol):
    """Anything that predicts a session's peak prompt tokens at its first call."""

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        """Predicted peak tokens."""
        ...


class Predictors:
    """The default model and the per-workload models."""

    def __init__(self, default: PeakModel, by_workload: Mapping[str, PeakModel] | None = None) -> None:
        self.default = default
        self.by_workload = dict(by_workload or {})

    @classmethod
    def load(cls, default_path: Path, workload_paths: Mapping[str, Path], tokenizer: str) -> Predictors:
        """Load every model file; `ConfigError` naming the file if one cannot be used."""
        try:
            default = PeakPredictor.load(default_path, expected_tokenizer=tokenizer)
            by_workload = {name: PeakPredictor.load(path, expected_tokenizer=tokenizer)
                           for name, path in workload_paths.items()}
        except PredictorError as exc:
            raise ConfigError(f"cannot load a peak predictor: {exc}") from exc
        return cls(default, by_workload)

    def for_workload(self, workload: str | None) -> PeakModel:
        """The model for this workload, else the default."""
        if workload is None:
            return self.default
        return self.by_workload.get(workload, self.default)

# The peak predictors the gateway serves with, one per workload plus the default.
#
# Rules:
# - All models are loaded and checked at start-up (`PeakPredictor.load`, with the gateway's
#   tokenizer as the expected one); a file that cannot be loaded stops start-up naming the file.
# - A call's workload header picks the model; no header, or a workload without a model of its own,
#   gets the default model. The workload name is kept either way (it goes to the session log).
# - Reservations: with a reservation quantile q, a session reserves m(q) x its predicted peak, m read
#   from the file that predicted it (`PeakPredictor.multiplier`): a workload's own file answers for its
#   benchmark; the default file answers with the workload's row when the workload is one of its
#   benchmarks, else with its all-rows row. Every file's m(q) is read once at start-up, so a file
#   without multipliers, or a q off their grid, stops start-up naming the file. Without q (None), and
#   for models without a `multiplier` (test doubles that only predict), m = 1.
"""Predictor selection by workload."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from basin_runtime.gateway.config import ConfigError
from basin_runtime.predictor import PeakPredictor, PredictorError


class PeakModel(Protocol):
    """Anything that predicts a session's peak prompt tokens at its first call."""

    def predict(self, task_text: str, first_prompt_tokens: int) -> float:
        """Predicted peak tokens."""
        ...


@runtime_checkable
class ReservingModel(PeakModel, Protocol):
    """A peak model that also knows its reservation multipliers (`PeakPredictor`)."""

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        """m(q) for this benchmark's sessions."""
        ...


class Predictors:
    """The default model and the per-workload models, and the reservation quantile."""

    def __init__(self, default: PeakModel, by_workload: Mapping[str, PeakModel] | None = None,
                 reservation_quantile: float | None = None) -> None:
        self.default = default
        self.by_workload = dict(by_workload or {})
        self.reservation_quantile = reservation_quantile

    @classmethod
    def load(cls, default_path: Path, workload_paths: Mapping[str, Path], tokenizer: str,
             reservation_quantile: float | None = None) -> Predictors:
        """Load every model file; `ConfigError` naming the file if one cannot be used."""
        try:
            default = PeakPredictor.load(default_path, expected_tokenizer=tokenizer)
            by_workload = {name: PeakPredictor.load(path, expected_tokenizer=tokenizer)
                           for name, path in workload_paths.items()}
            predictors = cls(default, by_workload, reservation_quantile)
            for workload in (None, *by_workload):
                predictors.multiplier(workload)
        except PredictorError as exc:
            raise ConfigError(f"cannot load a peak predictor: {exc}") from exc
        return predictors

    def multiplier(self, workload: str | None) -> float:
        """m(q) of the file that predicts this workload's sessions (1 without a quantile)."""
        model = self.for_workload(workload)
        if self.reservation_quantile is None or not isinstance(model, ReservingModel):
            return 1.0
        return model.multiplier(self.reservation_quantile, workload)

    def for_workload(self, workload: str | None) -> PeakModel:
        """The model for this workload, else the default."""
        if workload is None:
            return self.default
        return self.by_workload.get(workload, self.default)

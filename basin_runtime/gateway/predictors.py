"""Predictor selection by workload.

Rules:
- All models are loaded and checked at start-up (`PeakPredictor.load`, with the gateway's
  tokenizer as the expected one); a file that cannot be loaded stops start-up naming the file.
- A call's workload header picks the model; no header, or a workload without a model of its own,
  gets the default model. The workload name is kept either way (it goes to the session log).
- Reservations: with a reservation quantile q, a session reserves m(q) x its predicted peak, m read
  from the file that predicted it (`PeakPredictor.multiplier`): a workload's own file answers for its
  benchmark; the default file answers with the workload's row when the workload is one of its
  benchmarks, else with its all-rows row. Every file's m(q) is read once at start-up, so a file
  without multipliers, or a q off their grid, stops start-up naming the file. Without q (None), and
  for models without a `multiplier` (test doubles that only predict), m = 1.
- The task text a model reads is at most its first PREDICTED_TEXT_CHARS characters (`predict_peak`): the
  longest task text in the training corpora is 29,525 characters, and the model's text featurizer takes ~23
  times a text's size in memory and ~0.1 s per MB (a 60 MB first message took 1.4 GB and 6 s). A session's
  reservation never falls below its context anyway (the policy's max(m x peak, context)).
- Revisions: a model file with an online model beside it (`basin_runtime/online.py`) re-estimates
  a session's peak at the configured calls (`revise_at_calls`; by default the slots the online model is
  trained for, 2 3 4 5 7 10; `[]` never revises, as the paper's Basin) from its
  first-call prediction and its calls so far, reserving m_k(q) x the re-estimate; a file without one never
  revises (a warning at start-up names it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

from basin_runtime.gateway.config import ConfigError
from basin_runtime.online import OnlineModel
from basin_runtime.predictor import PeakPredictor, PredictorError

logger = logging.getLogger(__name__)


PREDICTED_TEXT_CHARS = 1 << 16


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


@runtime_checkable
class RevisingModel(Protocol):
    """A model that may carry an online re-estimate (`PeakPredictor.online`)."""

    online: OnlineModel | None


def predict_peak(model: PeakModel, task_text: str, first_prompt_tokens: int) -> float:
    """`model`'s predicted peak for a session, from at most the first PREDICTED_TEXT_CHARS of its task text."""
    return model.predict(task_text[:PREDICTED_TEXT_CHARS], first_prompt_tokens)


class Predictors:
    """The default model and the per-workload models, the reservation quantile and the revision calls."""

    def __init__(self, default: PeakModel, by_workload: Mapping[str, PeakModel] | None = None,
                 reservation_quantile: float | None = None, revise_at_calls: Sequence[int] | None = ()) -> None:
        self.default = default
        self.by_workload = dict(by_workload or {})
        self.reservation_quantile = reservation_quantile
        # the calls each workload's sessions are revised at: `revise_at_calls`, or (None) the slots its
        # model's online model is trained for; none without an online model
        self._revise_at: dict[str | None, frozenset[int]] = {
            workload: frozenset(revise_at_calls if revise_at_calls is not None
                                else getattr(getattr(self.for_workload(workload), "online", None), "slots", ()))
            for workload in (None, *self.by_workload)}
        # m_k(q) per (online model, k): fixed for the life of this object (the models and q are), so each is
        # read from the file's table once (an interpolation is ~4 us, at every revision)
        self._online_multipliers: dict[tuple[int, int], float] = {}

    @classmethod
    def load(cls, default_path: Path, workload_paths: Mapping[str, Path], tokenizer: str,
             reservation_quantile: float | None = None,
             revise_at_calls: Sequence[int] | None = None) -> Predictors:
        """Load every model file; `ConfigError` naming the file if one cannot be used."""
        try:
            default = PeakPredictor.load(default_path, expected_tokenizer=tokenizer)
            by_workload = {name: PeakPredictor.load(path, expected_tokenizer=tokenizer)
                           for name, path in workload_paths.items()}
            predictors = cls(default, by_workload, reservation_quantile, revise_at_calls)
            for workload in (None, *by_workload):
                predictors.multiplier(workload)
                model = predictors.for_workload(workload)
                if isinstance(model, PeakPredictor):
                    if model.online is None:
                        if revise_at_calls:
                            logger.warning("%s has no online model beside it: its sessions are not revised at "
                                           "calls %s", model.info.path, sorted(revise_at_calls))
                    elif reservation_quantile is not None:
                        for k in predictors.revise_calls(workload):
                            model.online_multiplier(reservation_quantile, k)
        except PredictorError as exc:
            raise ConfigError(f"cannot load a peak predictor: {exc}") from exc
        return predictors

    def revision(self, workload: str | None, first_call_peak: float, prompt_tokens: Sequence[int],
                 completion_tokens: Sequence[int]) -> tuple[float, float] | None:
        """(re-estimated peak, its multiplier) at call k = len(prompt_tokens) if k is a revision call and the
        workload's model re-estimates; else None."""
        k = len(prompt_tokens)
        # a `RevisingModel`'s online model, read as an attribute (a runtime Protocol check costs ~20 µs a call)
        online: OnlineModel | None = getattr(self.for_workload(workload), "online", None)
        if not self.revises_at(workload, k) or online is None:
            return None
        peak = online.predict(first_call_peak, prompt_tokens, completion_tokens)
        q = self.reservation_quantile
        if q is None:
            return peak, 1.0
        key = (id(online), k)  # the models live as long as this object, so their ids are not reused meanwhile
        if (multiplier := self._online_multipliers.get(key)) is None:
            multiplier = self._online_multipliers[key] = online.multiplier(q, k)
        return peak, multiplier

    def revise_calls(self, workload: str | None) -> frozenset[int]:
        """The calls at which this workload's sessions are re-estimated."""
        return self._revise_at.get(workload if workload in self.by_workload else None, frozenset())

    def revises_at(self, workload: str | None, k: int) -> bool:
        """Whether call k of a session of this workload is re-estimated."""
        return k in self.revise_calls(workload)

    def multiplier(self, workload: str | None) -> float:
        """m(q) of the file that predicts this workload's sessions (1 without a quantile)."""
        model = self.for_workload(workload)
        if self.reservation_quantile is None or not callable(getattr(model, "multiplier", None)):  # ReservingModel
            return 1.0
        return cast(ReservingModel, model).multiplier(self.reservation_quantile, workload)

    def for_workload(self, workload: str | None) -> PeakModel:
        """The model for this workload, else the default."""
        if workload is None:
            return self.default
        return self.by_workload.get(workload, self.default)

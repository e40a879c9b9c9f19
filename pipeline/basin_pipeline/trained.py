"""What stage `train` decided: `best.json`, one typed reader and one writer.

Rules:
- The file holds, per model (`pooled` and each benchmark with a model of its own), the chosen knobs
  (`params`), the CV objective and per-benchmark CV Spearman of the chosen trial, the trial's number,
  the model's rows and the benchmarks it serves. The fitted pipelines live beside it (`<name>.pkl`).
- `TrainedModels.write` is the only writer and `TrainedModels.read` the only reader: the stages after
  `train` (export, online, evaluate) and the benchmarks read it through here.
- A missing or malformed key is an error naming the file and the key, never a default.
- Values are kept as read (no coercion), so reading and writing again gives the same bytes, and the
  metadata stamped into the ONNX files does not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from basin_pipeline.features import ModelParams

POOLED = "pooled"
FILE_NAME = "best.json"


class TrainedModelsError(ValueError):
    """best.json is missing a key or holds a value of the wrong kind (the message names file and key)."""


@dataclass(frozen=True)
class TrainedModel:
    """One model's record: what its study chose and how well that choice cross-validated."""

    params: ModelParams
    cv_objective: float
    cv_spearman: Mapping[str, float | None]
    best_trial: int
    rows: int
    benchmarks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params.to_dict(), "cv_objective": self.cv_objective,
                "cv_spearman": dict(self.cv_spearman), "best_trial": self.best_trial, "rows": self.rows,
                "benchmarks": list(self.benchmarks)}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> TrainedModel:
        record = _mapping(raw, where)
        try:
            params = ModelParams(**_mapping(_key(record, "params", where), f"{where}.params"))
        except (TypeError, ValueError) as exc:
            raise TrainedModelsError(f"{where}.params: {exc}") from exc
        spearman = _mapping(_key(record, "cv_spearman", where), f"{where}.cv_spearman")
        for bench, value in spearman.items():
            if value is not None:
                _number(value, f"{where}.cv_spearman.{bench}")
        benchmarks = _key(record, "benchmarks", where)
        if not isinstance(benchmarks, list) or not all(isinstance(b, str) for b in benchmarks):
            raise TrainedModelsError(f"{where}.benchmarks: expected a list of names, got {benchmarks!r}")
        return cls(params=params, cv_objective=_number(_key(record, "cv_objective", where), f"{where}.cv_objective"),
                   cv_spearman=dict(spearman), best_trial=_integer(_key(record, "best_trial", where),
                                                                   f"{where}.best_trial"),
                   rows=_integer(_key(record, "rows", where), f"{where}.rows"), benchmarks=tuple(benchmarks))


@dataclass(frozen=True)
class TrainedModels:
    """Every trained model by name, in the file's order (pooled first, then benchmarks by name)."""

    models: Mapping[str, TrainedModel]

    def __getitem__(self, name: str) -> TrainedModel:
        return self.models[name]

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def __iter__(self) -> Iterator[str]:
        return iter(self.models)

    def items(self) -> Iterator[tuple[str, TrainedModel]]:
        return iter(self.models.items())

    def serving(self, benchmark: str) -> TrainedModel:
        """The model that serves `benchmark`: its own, or the pooled one when it has none."""
        return self.models.get(benchmark, self.models[POOLED])

    def to_json(self) -> dict[str, Any]:
        return {"models": {name: model.to_json() for name, model in self.models.items()}}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> TrainedModels:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TrainedModelsError(f"{path}: not JSON ({exc})") from exc
        models = _mapping(_key(_mapping(raw, str(path)), "models", str(path)), f"{path}: models")
        return cls({str(name): TrainedModel.from_json(record, f"{path}: models.{name}")
                    for name, record in models.items()})


def _key(record: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in record:
        raise TrainedModelsError(f"{where}: missing key {key!r}")
    return record[key]


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise TrainedModelsError(f"{where}: expected an object, got {value!r}")
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise TrainedModelsError(f"{where}: expected a number, got {value!r}")


def _integer(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TrainedModelsError(f"{where}: expected an integer, got {value!r}")

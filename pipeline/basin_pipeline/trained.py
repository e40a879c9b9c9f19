"""What stage `train` decided: `best.json`, one typed reader and one writer.

Rules:
- The file holds, per model (`pooled` and each benchmark with a model of its own), the chosen knobs
  (`params`), the CV objective and per-benchmark CV Spearman of the chosen trial, the trial's number,
  the model's rows and the benchmarks it serves. The fitted pipelines live beside it (`<name>.pkl`).
- `TrainedModels.write` is the only writer and `TrainedModels.read` the only reader: the stages after
  `train` (export, online, evaluate) and the benchmarks read it through here.
- `serving` (issue 49, part 5): per benchmark, what its `peak_predictor-<benchmark>.onnx` ships, chosen by
  `basin_pipeline.selection`'s rule on train's folds: `own_model`, `pooled_model` or a length line
  (`task_chars_only`, `first_prompt_only`, with its fitted `line`), and every candidate's score there. A
  file without the key (written before it existed) ships each benchmark's own model, as it always did; the
  key is written only when it holds a choice, so such a file reads and writes back the same bytes.
- A missing or malformed key is an error naming the file and the key, never a default.
- Values are kept as read (no coercion), so reading and writing again gives the same bytes, and the
  metadata stamped into the ONNX files does not change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from basin_pipeline.features import ModelParams
from basin_pipeline.length_line import LengthLine
from basin_pipeline.selection import CANDIDATES, LINE_COLUMNS, OWN, POOLED_MODEL

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
class ServingChoice:
    """What ships for one benchmark: a candidate of `basin_pipeline.selection`, its scores, a line's fit."""

    choice: str
    cv_spearman: Mapping[str, float | None]  # every candidate's per-fold Spearman on train's folds
    line: LengthLine | None = None  # the fitted line (all of the benchmark's rows) when a line is chosen

    def __post_init__(self) -> None:
        if self.choice not in CANDIDATES:
            raise ValueError(f"choice {self.choice!r} is none of {list(CANDIDATES)}")
        if (self.line is not None) != (self.choice in LINE_COLUMNS):
            raise ValueError(f"choice {self.choice!r} {'needs' if self.line is None else 'takes no'} fitted line")
        if self.line is not None and self.line.column != LINE_COLUMNS[self.choice]:
            raise ValueError(f"choice {self.choice!r} is a line on {LINE_COLUMNS[self.choice]!r}, not "
                             f"{self.line.column!r}")

    def to_json(self) -> dict[str, Any]:
        return {"choice": self.choice, "cv_spearman": dict(self.cv_spearman),
                **({"line": self.line.to_json()} if self.line is not None else {})}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ServingChoice:
        record = _mapping(raw, where)
        spearman = _mapping(_key(record, "cv_spearman", where), f"{where}.cv_spearman")
        for name, value in spearman.items():
            if value is not None:
                _number(value, f"{where}.cv_spearman.{name}")
        try:
            line = None
            if "line" in record:
                fit = _mapping(record["line"], f"{where}.line")
                line = LengthLine(str(_key(fit, "column", f"{where}.line")),
                                  _number(_key(fit, "slope", f"{where}.line"), f"{where}.line.slope"),
                                  _number(_key(fit, "intercept", f"{where}.line"), f"{where}.line.intercept"))
            return cls(str(_key(record, "choice", where)), dict(spearman), line)
        except ValueError as exc:
            if isinstance(exc, TrainedModelsError):
                raise
            raise TrainedModelsError(f"{where}: {exc}") from exc


@dataclass(frozen=True)
class TrainedModels:
    """Every trained model by name, in the file's order (pooled first, then benchmarks by name), and what
    ships for each benchmark (`serving`; empty: each benchmark's own model, else the pooled one)."""

    models: Mapping[str, TrainedModel]
    serving_choices: Mapping[str, ServingChoice] = field(default_factory=dict)

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

    def shipped(self, benchmark: str) -> str:
        """The candidate `peak_predictor-<benchmark>.onnx` ships (`selection.CANDIDATES`)."""
        choice = self.serving_choices.get(benchmark)
        if choice is not None:
            return choice.choice
        return OWN if benchmark in self.models else POOLED_MODEL

    def to_json(self) -> dict[str, Any]:
        serving = {"serving": {b: c.to_json() for b, c in self.serving_choices.items()}} if self.serving_choices \
            else {}
        return {"models": {name: model.to_json() for name, model in self.models.items()}, **serving}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> TrainedModels:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise TrainedModelsError(f"{path}: not JSON ({exc})") from exc
        models = _mapping(_key(_mapping(raw, str(path)), "models", str(path)), f"{path}: models")
        serving = _mapping(raw.get("serving", {}), f"{path}: serving")
        return cls({str(name): TrainedModel.from_json(record, f"{path}: models.{name}")
                    for name, record in models.items()},
                   {str(b): ServingChoice.from_json(c, f"{path}: serving.{b}") for b, c in serving.items()})


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

"""Each stage's section of params.yaml as a frozen dataclass; only stage `main()`s read the file.

A section's keys are its dataclass's fields and their kinds its annotations, checked by `basin_runtime.schema`
(as the gateway's options and the simulator's files are): a missing, unknown or wrongly typed key is a
`ParamsError` naming the file, the key path (`ingest.corpora[1].path`) and the value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from basin_runtime.schema import SchemaError, read_fields


class ParamsError(ValueError):
    """params.yaml is missing a section or key, or a value has the wrong type."""


@dataclass(frozen=True)
class CorpusParams:
    benchmark: str
    format: str
    path: str


@dataclass(frozen=True)
class SyntheticParams:
    seed: int
    sessions_per_benchmark: int


@dataclass(frozen=True)
class IngestParams:
    tokenizer: str
    task_text_pattern: str | None
    max_reject_fraction: float
    corpora: tuple[CorpusParams, ...]
    synthetic: SyntheticParams


T = TypeVar("T")


def _build(cls: type[T], raw: Any, where: str, path: str | Path) -> T:
    """`raw` checked against `cls`'s fields (their annotations say each kind) and built."""
    try:
        return cls(**read_fields(cls, raw, where))
    except SchemaError as exc:
        raise ParamsError(f"{path}: {exc}") from None


def load_section(path: str | Path, section: str) -> dict[str, Any]:
    """One top-level section of a params file."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if section not in data:
        raise ParamsError(f"{path}: no `{section}` section")
    value = data[section]
    if not isinstance(value, dict):
        raise ParamsError(f"{path}: `{section}` must be a mapping")
    return value


CORPORA_ROOT_ENV = "BASIN_CORPORA_ROOT"


def corpus_path(corpus: CorpusParams, params_file: str | Path) -> Path:
    """Where a corpus is: relative paths start at $BASIN_CORPORA_ROOT if set, else at params.yaml's folder.

    `dvc exp run --temp` / `--queue` run in a copy of the repository elsewhere, where
    ../shared/trajectories does not exist; point BASIN_CORPORA_ROOT at the project folder there.
    """
    root = Path(os.environ.get(CORPORA_ROOT_ENV) or Path(params_file).resolve().parent)
    return (root / corpus.path).resolve()


def ingest_params(path: str | Path = "params.yaml") -> IngestParams:
    return _build(IngestParams, {"corpora": [], **load_section(path, "ingest")}, "ingest", path)  # corpora: optional


@dataclass(frozen=True)
class FeaturizeParams:
    folds: int
    seed: int


@dataclass(frozen=True)
class SearchSpace:
    alpha: tuple[float, float]
    ngram_max: tuple[int, int]
    min_df: tuple[int, int]
    max_df: tuple[float, float]
    max_features: tuple[int, int]


@dataclass(frozen=True)
class TrainParams:
    seed: int
    n_trials: int
    search: SearchSpace


@dataclass(frozen=True)
class NestedParams:
    seeds: tuple[int, ...]
    outer_folds: int
    inner_folds: int
    trials: int
    seen_task: bool


@dataclass(frozen=True)
class OnlineParams:
    seeds: tuple[int, ...]
    outer_folds: int
    inner_folds: int
    eval_calls: tuple[int, ...]
    parity_rtol: float


@dataclass(frozen=True)
class ExportParams:
    parity_rtol: float
    publish: bool


def featurize_params(path: str | Path = "params.yaml") -> FeaturizeParams:
    return _build(FeaturizeParams, load_section(path, "featurize"), "featurize", path)


def train_params(path: str | Path = "params.yaml") -> TrainParams:
    return _build(TrainParams, load_section(path, "train"), "train", path)


def nested_params(path: str | Path = "params.yaml") -> NestedParams:
    return _build(NestedParams, load_section(path, "nested"), "nested", path)


def online_params(path: str | Path = "params.yaml") -> OnlineParams:
    return _build(OnlineParams, load_section(path, "online"), "online", path)


def export_params(path: str | Path = "params.yaml") -> ExportParams:
    return _build(ExportParams, load_section(path, "export"), "export", path)


@dataclass(frozen=True)
class SimulateParams:
    deployment: str  # the cache-first deployment of the headline row
    scenario: str  # the paper's +100% surge
    steady_scenario: str  # Basin's own steady reference
    policies: tuple[str, ...]  # run on the surge (basin and continuum at least)
    seeds: tuple[int, ...]  # every run over these (>= 10 for evidence)
    reservation_quantile: float  # what the gateway serves with (its default 0.9)


def simulate_params(path: str | Path = "params.yaml") -> SimulateParams:
    return _build(SimulateParams, load_section(path, "simulate"), "simulate", path)

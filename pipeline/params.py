"""Each stage's section of params.yaml as a frozen dataclass; only stage `main()`s read the file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml


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


def _build(cls: type[T], raw: Any, where: str) -> T:
    if not isinstance(raw, dict):
        raise ParamsError(f"params.yaml: `{where}` must be a mapping, got {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    missing, unknown = names - raw.keys(), raw.keys() - names
    if missing or unknown:
        raise ParamsError(f"params.yaml: `{where}`: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    return cls(**raw)


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
    raw = dict(load_section(path, "ingest"))
    corpora = tuple(_build(CorpusParams, c, f"ingest.corpora[{i}]") for i, c in enumerate(raw.pop("corpora", [])))
    synthetic = _build(SyntheticParams, raw.pop("synthetic", None), "ingest.synthetic")
    return _build(IngestParams, {**raw, "corpora": corpora, "synthetic": synthetic}, "ingest")


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
    return _build(FeaturizeParams, load_section(path, "featurize"), "featurize")


def train_params(path: str | Path = "params.yaml") -> TrainParams:
    raw = dict(load_section(path, "train"))
    search = raw.pop("search", None)
    if isinstance(search, dict):
        search = {k: tuple(v) if isinstance(v, list) else v for k, v in search.items()}
    return _build(TrainParams, {**raw, "search": _build(SearchSpace, search, "train.search")}, "train")


def nested_params(path: str | Path = "params.yaml") -> NestedParams:
    raw = dict(load_section(path, "nested"))
    if isinstance(raw.get("seeds"), list):
        raw["seeds"] = tuple(int(s) for s in raw["seeds"])
    return _build(NestedParams, raw, "nested")


def online_params(path: str | Path = "params.yaml") -> OnlineParams:
    raw = dict(load_section(path, "online"))
    for key in ("seeds", "eval_calls"):
        if isinstance(raw.get(key), list):
            raw[key] = tuple(int(v) for v in raw[key])
    return _build(OnlineParams, raw, "online")


def export_params(path: str | Path = "params.yaml") -> ExportParams:
    return _build(ExportParams, load_section(path, "export"), "export")


@dataclass(frozen=True)
class SimulateParams:
    deployment: str  # the cache-first deployment of the headline row
    scenario: str  # the paper's +100% surge
    steady_scenario: str  # Basin's own steady reference
    policies: tuple[str, ...]  # run on the surge (basin and continuum at least)
    seeds: tuple[int, ...]  # every run over these (>= 10 for evidence)
    reservation_quantile: float  # what the gateway serves with (its default 0.9)


def simulate_params(path: str | Path = "params.yaml") -> SimulateParams:
    raw = dict(load_section(path, "simulate"))
    for key, kind in (("policies", str), ("seeds", int)):
        if isinstance(raw.get(key), list):
            raw[key] = tuple(kind(v) for v in raw[key])
    return _build(SimulateParams, raw, "simulate")

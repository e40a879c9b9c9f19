"""Each stage's section of params.yaml as a frozen dataclass; only stage `main()`s read the file.

A section's keys are its dataclass's fields, checked by `basin_runtime.schema` (as the gateway's options and
the simulator's files are): their kinds by their annotations, their values by the checks declared on them
(folds >= 2, fractions in [0, 1], tolerances > 0, ranges low <= high, lists not empty). A missing, unknown,
wrongly typed or out-of-range key is a `ParamsError` naming the file, the key path (`ingest.corpora[1].path`,
`featurize.folds`) and the value. `python -m basin_pipeline.params` checks every section at once (`make repro`
runs it before `dvc repro`, so a bad value stops the run before DVC deletes any stage's outputs); a stage's
`main()` reads its section through `or_exit`, which ends the stage with that one line and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from basin_runtime.schema import BadValue, Check, Flag, ListOf, Number, SchemaError, Text, Whole, key, read_fields


class ParamsError(ValueError):
    """params.yaml is missing a section or key, or a value has the wrong type."""


@dataclass(frozen=True)
class Range(Check):
    """A [low, high] pair of what `item` accepts, low <= high (a search range)."""

    item: Check

    def describe(self) -> str:
        return f"a [low, high] pair with low <= high ({self.item.expected} each)"

    def read(self, key: str, value: object) -> tuple[Any, ...]:
        pair = ListOf(self.item, length=2).read(key, value) if isinstance(value, list | tuple) and len(value) == 2 \
            else None
        if pair is None or pair[0] > pair[1]:
            raise BadValue(key, self.expected, value)
        return pair


FOLDS = Whole(min=2)
SEEDS = ListOf(Whole(), min_items=1)
TOLERANCE = Number(gt=0, noun="a tolerance")


@dataclass(frozen=True)
class CorpusParams:
    benchmark: str
    format: str
    path: str


@dataclass(frozen=True)
class SyntheticParams:
    seed: int
    sessions_per_benchmark: int = field(metadata=key(Whole(min=1)))


@dataclass(frozen=True)
class IngestParams:
    tokenizer: str
    task_text_pattern: str | None
    max_reject_fraction: float = field(metadata=key(Number(ge=0, le=1, noun="a fraction")))
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
    folds: int = field(metadata=key(FOLDS))
    seed: int


@dataclass(frozen=True)
class SearchSpace:
    alpha: tuple[float, float] = field(metadata=key(Range(Number(gt=0))))
    ngram_max: tuple[int, int] = field(metadata=key(Range(Whole(min=1))))
    min_df: tuple[int, int] = field(metadata=key(Range(Whole(min=1))))
    max_df: tuple[float, float] = field(metadata=key(Range(Number(gt=0, le=1))))
    max_features: tuple[int, int] = field(metadata=key(Range(Whole(min=1))))


@dataclass(frozen=True)
class TrainParams:
    seed: int
    n_trials: int = field(metadata=key(Whole(min=1)))
    search: SearchSpace


@dataclass(frozen=True)
class NestedParams:
    seeds: tuple[int, ...] = field(metadata=key(SEEDS))
    outer_folds: int = field(metadata=key(FOLDS))
    inner_folds: int = field(metadata=key(FOLDS))
    trials: int = field(metadata=key(Whole(min=1)))
    seen_task: bool = field(metadata=key(Flag()))


@dataclass(frozen=True)
class OnlineParams:
    seeds: tuple[int, ...] = field(metadata=key(SEEDS))
    outer_folds: int = field(metadata=key(FOLDS))
    inner_folds: int = field(metadata=key(FOLDS))
    eval_calls: tuple[int, ...] = field(metadata=key(ListOf(Whole(min=2), min_items=1)))
    parity_rtol: float = field(metadata=key(TOLERANCE))


@dataclass(frozen=True)
class ExportParams:
    parity_rtol: float = field(metadata=key(TOLERANCE))
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
    policies: tuple[str, ...] = field(metadata=key(ListOf(Text(), min_items=1)))  # on the surge (basin, continuum)
    seeds: tuple[int, ...] = field(metadata=key(SEEDS))  # every run over these (>= 10 for evidence)
    reservation_quantile: float = field(metadata=key(Number(gt=0, lt=1)))  # the gateway's (default 0.9)


def simulate_params(path: str | Path = "params.yaml") -> SimulateParams:
    return _build(SimulateParams, load_section(path, "simulate"), "simulate", path)


SECTIONS: dict[str, Callable[[str | Path], Any]] = {
    "ingest": ingest_params, "featurize": featurize_params, "train": train_params, "nested": nested_params,
    "online": online_params, "export": export_params, "simulate": simulate_params}


def check_all(path: str | Path) -> list[str]:
    """Every section of `path` read and checked; the errors, one line each (empty: all good)."""
    errors = []
    for read in SECTIONS.values():
        try:
            read(path)
        except ParamsError as exc:
            errors.append(str(exc))
    return errors


def or_exit(read: Callable[[Path], T], path: Path, prog: str) -> T:
    """`read(path)`, or the stage ends here with the error's one line (file, key path, value) and no traceback."""
    try:
        return read(path)
    except ParamsError as exc:
        raise SystemExit(f"{prog}: error: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m basin_pipeline.params [params.yaml]`: check every section; one line per bad key, exit 1."""
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.params", description=main.__doc__)
    parser.add_argument("params", type=Path, nargs="?", default=Path("params.yaml"))
    args = parser.parse_args(argv)
    if not args.params.is_file():
        print(f"{parser.prog}: error: {args.params} does not exist", file=sys.stderr)
        return 1
    errors = check_all(args.params)
    for error in errors:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

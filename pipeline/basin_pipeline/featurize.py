"""Stage `featurize`: the model's input frame and the cross-validation splits.

The featurizer itself lives inside the model pipeline (`basin_pipeline.features`), so serving computes the
same features; this stage fixes what every later stage agrees on: the rows (inputs and target), and
two fold assignments. `fold_unseen` keeps all runs of a task in one fold (the unseen-task protocol);
`fold_seen` spreads runs at random, so other runs of a task sit in training (the seen-task protocol,
as when a benchmark harness reruns its tasks). Both are stratified by benchmark and seeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from basin_pipeline.params import featurize_params, or_exit
from basin_runtime.logs import configure_logging
from basin_runtime.session_table import read_table

log = logging.getLogger(__name__)
COLUMNS = ["session_id", "benchmark", "task_id", "source", "task_text", "task_chars", "first_prompt_tokens",
           "peak_prompt_tokens"]


def assign_folds(frame: pd.DataFrame, folds: int, seed: int) -> pd.DataFrame:
    """Add `fold_unseen` (by task) and `fold_seen` (by row) columns, per benchmark."""
    rng = np.random.default_rng(seed)
    unseen = np.empty(len(frame), dtype=np.int64)
    seen = np.empty(len(frame), dtype=np.int64)
    for _, index in sorted(frame.groupby("benchmark").indices.items()):
        unique = np.unique(frame["task_id"].to_numpy()[index])
        task_fold = dict(zip(rng.permutation(unique), np.arange(len(unique)) % folds, strict=True))
        unseen[index] = [task_fold[t] for t in frame["task_id"].to_numpy()[index]]
        seen[index] = rng.permutation(np.arange(len(index)) % folds)
    return frame.assign(fold_unseen=unseen, fold_seen=seen)


@dataclass(frozen=True)
class FrameSummary:
    """summary.json: what the frame holds (rows, sessions and tasks per benchmark), whether it is synthetic,
    the hash of the rows the model learns from and the tokenizer that counted them. Read by train, export
    and online; a missing key is an error naming the file."""

    rows: int
    benchmarks: dict[str, int]
    tasks: dict[str, int]
    synthetic: bool
    training_data_sha256: str
    tokenizer: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> FrameSummary:
        raw = json.loads(path.read_text(encoding="utf-8"))
        try:
            return cls(**{name: raw[name] for name in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ValueError(f"{path}: missing key {exc}") from exc


def data_hash(frame: pd.DataFrame) -> str:
    """SHA-256 over the rows the model learns from (inputs and target, in order)."""
    digest = hashlib.sha256()
    for row in frame[COLUMNS].itertuples(index=False):
        digest.update(json.dumps([str(v) for v in row], ensure_ascii=False).encode())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.featurize", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--sessions", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="frame to write (.parquet)")
    parser.add_argument("--summary", type=Path, required=True, help="summary to write (.json)")
    args = parser.parse_args(argv)
    configure_logging()
    params = or_exit(featurize_params, args.params, parser.prog)
    table = read_table(args.sessions)
    frame = table.select(COLUMNS).to_pandas()
    frame = assign_folds(frame, params.folds, params.seed)
    synthetic = bool((frame["source"] == "synthetic").all())
    summary = FrameSummary(
        rows=len(frame),
        benchmarks={str(k): int(v) for k, v in frame["benchmark"].value_counts().sort_index().items()},
        tasks={str(k): int(v) for k, v in frame.groupby("benchmark")["task_id"].nunique().sort_index().items()},
        synthetic=synthetic,
        training_data_sha256=data_hash(frame),
        tokenizer=str(table.column("tokenizer")[0]),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(args.out, index=False)
    summary.write(args.summary)
    log.info("%d rows, %s%s", len(frame), summary.benchmarks, " (SYNTHETIC)" if synthetic else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())

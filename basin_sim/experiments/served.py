"""Which first-call predictor serves each benchmark in the simulator: what train's selection shipped (issue 49).

Rules:
- Selection on (`--first-call selected`, the default): every `peak_predictor-<benchmark>.onnx` beside the model
  file serves its benchmark, as a gateway given each benchmark's file as its workload model: it predicts that
  benchmark's sessions (in-sample, and sessions the out-of-fold table does not hold) and answers their m(q);
  the out-of-fold peaks are the nested stage's selected procedure's (`selected_predicted`: own model, pooled
  model or a length line, chosen on inner folds). A benchmark without a file of its own is served by the model
  file. Export writes each benchmark's file as the candidate train chose (`basin_pipeline.export`).
- Selection off (`--first-call pooled`, the paper's Basin before issue 49 and the ablation): the model file
  alone serves every session, and the out-of-fold peaks are the pooled model's (`pooled_predicted`).
- Known approximation: the out-of-fold choice may differ between outer folds (a benchmark's sessions can be
  predicted by its own model in one fold and by a line in another), while m(q) is the shipped choice's.
- onnxruntime is imported only when a file is loaded (predictions.py's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from basin_sim.experiments.predictions import ReservingPredictor, load_predictor, model_sha256

FIRST_CALL_CHOICES = ("selected", "pooled")
SELECTED_COLUMN = "selected_predicted"
POOLED_COLUMN = "pooled_predicted"
FILE_PREFIX, FILE_SUFFIX, ONLINE_SUFFIX = "peak_predictor-", ".onnx", ".online.onnx"


def out_of_fold_column(first_call: str) -> str:
    """The out-of-fold table's column of peaks for a `--first-call` choice."""
    if first_call not in FIRST_CALL_CHOICES:
        raise ValueError(f"unknown --first-call {first_call!r}; known: {', '.join(FIRST_CALL_CHOICES)}")
    return SELECTED_COLUMN if first_call == "selected" else POOLED_COLUMN


def benchmark_files(model: Path) -> dict[str, Path]:
    """Benchmark -> its `peak_predictor-<benchmark>.onnx` beside `model` (online files are not first-call models)."""
    found = {}
    for path in sorted(model.parent.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}")):
        if path.name.endswith(ONLINE_SUFFIX) or path == model:
            continue
        found[path.name[len(FILE_PREFIX):-len(FILE_SUFFIX)]] = path
    return found


class ServedByBenchmark:
    """The model file and each benchmark's own file, answering as the file that serves the benchmark."""

    def __init__(self, default: ReservingPredictor, by_benchmark: Mapping[str, ReservingPredictor]) -> None:
        self.default = default
        self.by_benchmark = dict(by_benchmark)
        self.online = getattr(default, "online", None)  # revisions stay the model file's (in-sample only)

    def for_benchmark(self, benchmark: str) -> ReservingPredictor:
        """The file serving `benchmark`'s sessions."""
        return self.by_benchmark.get(benchmark, self.default)

    def predict_batch(self, task_texts: Sequence[str], first_prompt_tokens: Sequence[int]) -> Sequence[float]:
        """The model file's predictions (sessions of no known benchmark)."""
        return self.default.predict_batch(task_texts, first_prompt_tokens)

    def multiplier(self, q: float, benchmark: str | None = None) -> float:
        """m(q) of the file serving `benchmark`."""
        model = self.default if benchmark is None else self.for_benchmark(benchmark)
        return model.multiplier(q, benchmark)


def load_served(model: Path, first_call: str) -> ReservingPredictor:
    """The predictor the basin runs are served by for a `--first-call` choice (see the rules)."""
    default = load_predictor(model)
    if out_of_fold_column(first_call) == POOLED_COLUMN:
        return default
    return ServedByBenchmark(default, {b: load_predictor(p) for b, p in benchmark_files(model).items()})


def served_tag(model: Path, first_call: str) -> str:
    """What the basin runs' peaks and m(q) depend on beyond the model file and the out-of-fold table: '' with
    selection off (as before it existed), else the choice and each benchmark file's digest."""
    if out_of_fold_column(first_call) == POOLED_COLUMN:
        return ""
    files = ",".join(f"{b}={model_sha256(p)[:16]}" for b, p in benchmark_files(model).items())
    return f"first-call:selected[{files}]"

"""Stage `export`: fitted pipelines -> ONNX files the gateway loads, checked against scikit-learn.

Each model is converted (`basin_pipeline.onnx_export`), stamped with metadata (schema version, tokenizer,
inputs, training-data hash, params, metrics, and the reservation multipliers m(q) of
`basin_pipeline.reservations.shipping_multipliers`: quantiles of true/predicted peak over the model's
task-grouped out-of-fold predictions, per benchmark, on a grid of q), loaded through the served code path
(`basin_runtime.predictor.PeakPredictor`, which builds the ONNX inputs as the gateway does) and must
match scikit-learn to `parity_rtol` on a parity set of sessions (task text and first prompt size):
awkward texts (empty, whitespace, unicode, code, paths, 100 KB) and training sessions, or the stage
fails. Files go to the stage's output folder; those trained on real data are also published to
`models/` (kept in git, so a clone can serve without retraining). A synthetic run never publishes.
Publishing replaces a file only when the model changed: a published model trained on the same data
(training-data hash), with the same params, benchmarks and multipliers, whose predictions on the parity set of its
training rows match the new model's within `parity_rtol`, is kept byte for byte (floating-point noise
between machines, ~1e-5, would otherwise dirty git on every re-run; its metadata metrics are then the
ones it was published with), and the stage's own copy in its output folder is replaced by the published
bytes, so the simulate stage runs, and its metrics name (`predictor_sha256`), the model that ships.
What ships for each benchmark is best.json's choice (`serving`, `basin_pipeline.selection`): its own model,
the pooled model (the pooled file's bytes, and its online model, under the benchmark's name) or a length line
(`basin_pipeline.length_line`, a hand-built graph with the same inputs, stamped with m(q) from the line's
out-of-fold predictions on train's folds, parity-checked against the line as the others are against
scikit-learn; it ships no online model, as none was trained on its predictions). A benchmark's own model that
is not chosen is not shipped.
The models are logged to MLflow with `mlflow.onnx`, registered (each version tagged with its CV
metrics, params and training-data hash), and the best aliased `champion`.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
from onnx import ModelProto
from sklearn.pipeline import Pipeline

from basin_pipeline import tracking
from basin_pipeline.features import LENGTH_INPUTS, MODEL_INPUTS, model_frame
from basin_pipeline.featurize import FrameSummary
from basin_pipeline.length_line import line_out_of_fold
from basin_pipeline.onnx_export import line_to_onnx, serialize, set_metadata, to_onnx
from basin_pipeline.params import export_params, or_exit
from basin_pipeline.reservations import multiplier_table, shipping_multipliers
from basin_pipeline.selection import OWN
from basin_pipeline.trained import FILE_NAME, POOLED, ServingChoice, TrainedModel, TrainedModels, TrainedModelsError
from basin_runtime.logs import configure_logging
from basin_runtime.online import OnlineModel, online_file_name
from basin_runtime.predictor import MAX_PEAK_TOKENS, SCHEMA_VERSION, PeakPredictor, PredictorError, model_file_name

log = logging.getLogger(__name__)

AWKWARD_TEXTS = [
    "", " ", "\n\t  \r\n", "x", "ÉCOLE Ünïcödé naïve café", "日本語のテキストと中文", "emoji 🙂🚀 mixed",
    "def f(x):\n    return x / 2  # comment\n", "```python\nimport os\n```",
    "/usr/lib/python3.11/site.py and a/b/c.py:12", "C:\\Users\\dev\\file.txt", "ALLCAPS CamelCase snake_case",
    "numbers 123 4.56 7e8", "x" * 100_000, "word " * 20_000, "<pr_description>\nFix the bug\n</pr_description>",
]


# Measured (ONNX_NOTES.md): onnxruntime lower-cases U+0130 (İ) differently from Python, so texts holding
# it may differ. Such rows are still run and their difference is logged, but they cannot fail export.
KNOWN_DIFFERENCE = "\u0130"
KNOWN_DIFFERENCE_TEXTS = ["İstanbul İİ ı"]


class FramePredictor(Protocol):
    """A fitted pipeline, or a length line: peak tokens of a model frame's rows."""

    def predict(self, X: pd.DataFrame) -> Any:
        ...


class ParityError(RuntimeError):
    """The served predictor and scikit-learn disagree beyond the tolerance."""


@dataclass(frozen=True)
class ParitySet:
    """Sessions as the gateway sees them at their first call: task text and first prompt size."""

    task_texts: tuple[str, ...]
    first_prompt_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.task_texts) != len(self.first_prompt_tokens):
            raise ValueError(f"{len(self.task_texts)} task texts but {len(self.first_prompt_tokens)} prompt sizes")


def parity_set(train_frame: pd.DataFrame, rows: int = 200) -> ParitySet:
    """Awkward texts with varied prompt sizes, plus a sample of real training sessions."""
    texts = AWKWARD_TEXTS + KNOWN_DIFFERENCE_TEXTS
    # Prompt sizes spread over the training range: far outside it the served clamp (a peak is never
    # below the first prompt) would hide the graph's output, and with it any wrong feature.
    seen = train_frame["first_prompt_tokens"].to_numpy(dtype=np.float64)
    firsts = [int(v) for v in np.quantile(seen, np.linspace(0, 1, len(texts)))]
    sample = train_frame.sample(min(rows, len(train_frame)), random_state=0)
    return ParitySet(tuple(texts) + tuple(str(t) for t in sample["task_text"]),
                     tuple(firsts) + tuple(int(v) for v in sample["first_prompt_tokens"]))


def load_served(proto: ModelProto, expected_tokenizer: str | None) -> PeakPredictor:
    """The model as the gateway loads it: written to a file and opened with `PeakPredictor.load`."""
    with tempfile.TemporaryDirectory(prefix="basin-export-") as folder:
        path = Path(folder) / model_file_name()
        path.write_bytes(serialize(proto))
        return PeakPredictor.load(path, expected_tokenizer=expected_tokenizer)


def sklearn_served(model: FramePredictor, sessions: ParitySet) -> np.ndarray:
    """scikit-learn's predictions, clamped as `PeakPredictor` documents (non-finite -> upper bound)."""
    texts = list(sessions.task_texts)
    first = np.asarray(sessions.first_prompt_tokens, dtype=np.float64)
    raw = np.asarray(model.predict(model_frame(texts, [len(t) for t in texts], first)), dtype=np.float64)
    raw = np.where(np.isfinite(raw), raw, MAX_PEAK_TOKENS)
    return np.clip(raw, np.maximum(first, 1.0), MAX_PEAK_TOKENS)


def check_parity(model: FramePredictor, predictor: PeakPredictor, sessions: ParitySet, rtol: float) -> float:
    """Largest relative difference between the served predictor and scikit-learn; raises over `rtol`."""
    expected = sklearn_served(model, sessions)
    got = predictor.predict_batch(sessions.task_texts, sessions.first_prompt_tokens)
    relative = np.abs(got - expected) / np.maximum(np.abs(expected), 1e-12)
    known = np.array([KNOWN_DIFFERENCE in t for t in sessions.task_texts], dtype=bool)
    if known.any():
        log.info("rows with U+0130 (known lower-casing difference): up to %.2e relative", relative[known].max())
    relative = np.where(known, 0.0, relative)
    clamped = int(np.count_nonzero((got == expected) & (got <= np.maximum(sessions.first_prompt_tokens, 1))))
    log.info("%d of %d parity sessions are clamped to their first prompt size (they test no feature)", clamped,
             len(relative))
    worst = int(np.argmax(np.where(np.isnan(relative), np.inf, relative)))
    if not relative[worst] <= rtol:
        over = int(np.count_nonzero(~(relative <= rtol)))
        text = sessions.task_texts[worst]
        raise ParityError(
            f"served predictor (basin_runtime.predictor.PeakPredictor) differs from scikit-learn beyond "
            f"{rtol:.0e} relative on {over} of {len(relative)} parity sessions; worst is session {worst} "
            f"(task_text {text[:60]!r}, {len(text)} chars, first_prompt_tokens {sessions.first_prompt_tokens[worst]}): "
            f"served {got[worst]:.6g} vs scikit-learn {expected[worst]:.6g} ({relative[worst]:.2e} relative)")
    return float(relative[worst])


def metadata(name: str, record: TrainedModel, summary: FrameSummary, parity: float | None,
             multipliers: dict[str, Any]) -> dict[str, str]:
    """The file's `basin.*` metadata; `parity` is None in the draft that the parity check loads."""
    metrics = {"cv_unseen_task_spearman": dict(record.cv_spearman), "cv_objective": record.cv_objective}
    if parity is not None:
        metrics["parity_max_rel"] = parity
    return {
        "basin.schema_version": SCHEMA_VERSION,
        "basin.model_name": name,
        "basin.tokenizer": summary.tokenizer,
        "basin.inputs": json.dumps(list(MODEL_INPUTS)),
        "basin.features": json.dumps(["tfidf(task_text)", *([f"log1p({n})" for n in LENGTH_INPUTS]
                                                          if record.params.use_lengths else [])]),
        "basin.benchmarks": json.dumps(list(record.benchmarks)),
        "basin.training_data_sha256": summary.training_data_sha256,
        "basin.synthetic": json.dumps(summary.synthetic),
        "basin.params": json.dumps(record.params.to_dict(), sort_keys=True),
        "basin.metrics": json.dumps(metrics, sort_keys=True),
        "basin.reservation_multipliers": json.dumps(multipliers, sort_keys=True),
    }


def export_one(name: str, record: TrainedModel, model: Pipeline, frame: pd.DataFrame, summary: FrameSummary,
               rtol: float, multipliers: dict[str, Any]) -> bytes:
    """One model as ONNX bytes, after the served predictor passed the parity check."""
    rows = frame if name == "pooled" else frame[frame["benchmark"] == name]
    proto = to_onnx(model, metadata(name, record, summary, None, multipliers))
    parity = check_parity(model, load_served(proto, summary.tokenizer), parity_set(rows), rtol)
    log.info("%s: served predictor matches scikit-learn within %.1e relative", name, parity)
    set_metadata(proto, metadata(name, record, summary, parity, multipliers))  # the graph checked is the graph shipped
    return serialize(proto)


def line_metadata(bench: str, choice: ServingChoice, summary: FrameSummary, parity: float | None,
                  multipliers: dict[str, Any]) -> dict[str, str]:
    """A length line file's `basin.*` metadata (as `metadata`'s keys); `parity` is None in the checked draft."""
    if choice.line is None:
        raise ValueError(f"{bench}: ships {choice.choice}, not a length line")
    metrics: dict[str, Any] = {"cv_unseen_task_spearman": {bench: choice.cv_spearman.get(choice.choice)},
                               "cv_candidates": dict(choice.cv_spearman)}
    if parity is not None:
        metrics["parity_max_rel"] = parity
    return {
        "basin.schema_version": SCHEMA_VERSION, "basin.model_name": bench, "basin.tokenizer": summary.tokenizer,
        "basin.inputs": json.dumps(list(MODEL_INPUTS)), "basin.features": json.dumps([f"log1p({choice.line.column})"]),
        "basin.benchmarks": json.dumps([bench]), "basin.training_data_sha256": summary.training_data_sha256,
        "basin.synthetic": json.dumps(summary.synthetic),
        "basin.params": json.dumps({"length_line": choice.line.to_json()}, sort_keys=True),
        "basin.metrics": json.dumps(metrics, sort_keys=True),
        "basin.reservation_multipliers": json.dumps(multipliers, sort_keys=True),
    }


def export_line(bench: str, choice: ServingChoice, frame: pd.DataFrame, summary: FrameSummary, rtol: float) -> bytes:
    """A benchmark's length line as ONNX bytes, m(q) from its out-of-fold predictions, after the parity check."""
    if choice.line is None:
        raise ValueError(f"{bench}: ships {choice.choice}, not a length line")
    rows = frame[frame["benchmark"].astype(str) == bench].reset_index(drop=True)
    true = rows["peak_prompt_tokens"].to_numpy(dtype=np.float64)
    predicted = line_out_of_fold(rows[choice.line.column].to_numpy(), true, rows["fold_unseen"].to_numpy())
    multipliers = multiplier_table(true, predicted, rows["benchmark"].astype(str).to_numpy())
    proto = line_to_onnx(choice.line, line_metadata(bench, choice, summary, None, multipliers))
    parity = check_parity(choice.line, load_served(proto, summary.tokenizer), parity_set(rows), rtol)
    log.info("%s: the length line on %s ships; served graph matches it within %.1e relative", bench,
             choice.line.column, parity)
    set_metadata(proto, line_metadata(bench, choice, summary, parity, multipliers))
    return serialize(proto)


def ship_choices(best: TrainedModels, written: dict[str, Path], out: Path, frame: pd.DataFrame,
                 summary: FrameSummary, rtol: float) -> None:
    """Each benchmark's file when it ships the pooled model or a length line (`written` gains it)."""
    for bench, choice in best.serving_choices.items():
        if choice.choice == OWN:
            continue
        path = out / model_file_name(bench)
        online = online_file_name(path)
        online.unlink(missing_ok=True)
        if choice.line is None:  # the pooled model, with its online model, under the benchmark's name
            shutil.copyfile(written[POOLED], path)
            if online_file_name(written[POOLED]).exists():
                shutil.copyfile(online_file_name(written[POOLED]), online)
            log.info("%s: the pooled model ships", bench)
        else:
            path.write_bytes(export_line(bench, choice, frame, summary, rtol))
        written[bench] = path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.export", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--train-dir", type=Path, required=True)
    parser.add_argument("--frame", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the ONNX files")
    parser.add_argument("--publish-dir", type=Path, required=True, help="models/ (only real-data models)")
    parser.add_argument("--online-dir", type=Path, help="stage online's .online.onnx files: each is shipped beside "
                        "its first-call model and published with it")
    args = parser.parse_args(argv)
    configure_logging()
    params = or_exit(export_params, args.params, parser.prog)
    best_path = args.train_dir / FILE_NAME
    try:
        best = TrainedModels.read(best_path)
    except TrainedModelsError as exc:
        log.error("%s", exc)
        return 1
    summary = FrameSummary.read(args.summary)
    frame = pd.read_parquet(args.frame)
    args.out.mkdir(parents=True, exist_ok=True)
    multipliers = shipping_multipliers(frame, best)
    for name, table in multipliers.items():
        log.info("%s: reservation multipliers m(q) for q %s: %s", name, table["quantiles"], table["by_benchmark"])
    written: dict[str, Path] = {}
    for name, record in best.items():
        if name != POOLED and best.shipped(name) != OWN:
            continue  # its file ships another candidate (`ship_choices`)
        with (args.train_dir / f"{name}.pkl").open("rb") as handle:
            model = pickle.load(handle)
        try:
            blob = export_one(name, record, model, frame, summary, params.parity_rtol, multipliers[name])
        except (ParityError, PredictorError) as exc:
            log.error("%s: %s", name, exc)
            return 1
        path = args.out / model_file_name(None if name == "pooled" else name)
        path.write_bytes(blob)
        written[name] = path
        online = None if args.online_dir is None else args.online_dir / online_file_name(path).name
        if online is not None and online.exists():  # the online stage writes none for too few long sessions
            shutil.copyfile(online, online_file_name(path))
    try:
        ship_choices(best, written, args.out, frame, summary, params.parity_rtol)
    except (ParityError, PredictorError) as exc:
        log.error("%s", exc)
        return 1
    publish_models(written, args.publish_dir, publish=params.publish and not summary.synthetic,
             synthetic=summary.synthetic, frame=frame, rtol=params.parity_rtol)
    _track(best, tracking.file_sha256(best_path), written, summary)
    return 0


def publish_models(written: dict[str, Path], folder: Path, publish: bool, synthetic: bool, frame: pd.DataFrame,
             rtol: float) -> None:
    if not publish:
        reason = "trained on the SYNTHETIC corpus" if synthetic else "export.publish is false"
        log.warning("not publishing to %s: %s; the shipped models stay as they are", folder, reason)
        return
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in written.items():
        target = folder / path.name
        pair = [(path, target)] + ([(online_file_name(path), online_file_name(target))]
                                   if online_file_name(path).exists() else [])
        if all(t.exists() and t.read_bytes() == f.read_bytes() for f, t in pair):
            continue
        rows = frame if name == "pooled" else frame[frame["benchmark"] == name]
        difference = published_difference(target, path, parity_set(rows))
        if difference is not None and difference <= rtol:
            log.info("kept %s: the new model predicts within %.1e relative of it (tolerance %.0e)", target,
                     difference, rtol)
            for fresh, published in pair:  # the stage's file becomes the shipped bytes: what simulate runs is
                shutil.copyfile(published, fresh)  # what ships (its SHA-256 in metrics/simulate.json)
            continue
        if not online_file_name(path).exists():  # an online model of another first-call model would be refused
            online_file_name(target).unlink(missing_ok=True)
        for fresh, published in pair:  # a first-call model and its online model go together
            shutil.copyfile(fresh, published)
            log.info("published %s", published)


def published_difference(published: Path, new: Path, sessions: ParitySet) -> float | None:
    """Largest relative difference between the published model's and the new model's predictions on
    `sessions`; None when there is nothing comparable (no file, unreadable, other data, params or
    benchmarks), which always publishes."""
    if not published.exists():
        return None
    try:
        old = PeakPredictor.load(published)
    except PredictorError as exc:
        log.warning("published %s cannot be loaded (%s): replacing it", published, exc)
        return None
    fresh = PeakPredictor.load(new)
    if (old.info.training_data_sha256, old.info.params, old.info.benchmarks, old.info.reservation_multipliers) != \
            (fresh.info.training_data_sha256, fresh.info.params, fresh.info.benchmarks,
             fresh.info.reservation_multipliers):
        return None
    before = old.predict_batch(sessions.task_texts, sessions.first_prompt_tokens)
    after = fresh.predict_batch(sessions.task_texts, sessions.first_prompt_tokens)
    first = float(np.max(np.abs(after - before) / np.maximum(np.abs(before), 1e-12)))
    if (old.online is None) != (fresh.online is None):
        return None
    if old.online is None or fresh.online is None:
        return first
    if old.online.multipliers != fresh.online.multipliers:
        return None
    return max(first, _online_difference(old.online, fresh.online, before, after, sessions))


def _online_difference(old: OnlineModel, fresh: OnlineModel, old_first: np.ndarray, fresh_first: np.ndarray,
                       sessions: ParitySet) -> float:
    """Largest relative difference of the two online models' re-estimates on probe histories (calls 2, 3, 5
    and 10 of a context growing by half its first size per call), each from its own first-call predictions."""
    histories = [(i, [int(first * (1 + j / 2)) for j in range(k)], [100] * (k - 1))
                 for i, first in enumerate(sessions.first_prompt_tokens) for k in (2, 3, 5, 10)]
    rows, prompts, completions = zip(*histories, strict=True)
    a = old.predict_batch(list(old_first[list(rows)]), list(prompts), list(completions))
    b = fresh.predict_batch(list(fresh_first[list(rows)]), list(prompts), list(completions))
    return float(np.max(np.abs(b - a) / np.maximum(np.abs(a), 1e-12)))


def _track(best: TrainedModels, best_sha256: str, written: dict[str, Path], summary: FrameSummary) -> None:
    """Log, register and alias the models in MLflow (a side channel: nothing reads it back), under the
    training run that wrote this best.json, or a run `export` of their own when the store has none."""
    tracking.configure()
    run_id = tracking.training_run_id(best_sha256)
    if run_id is None:
        log.warning("no MLflow training run wrote this best.json (sha256 %s...): the models go under a new run "
                    "'export'", best_sha256[:12])
        run_id = tracking.log_run("export", {}, {}, {tracking.BEST_SHA_TAG: best_sha256})
    for name, path in written.items():
        if name not in best or (name != POOLED and best.shipped(name) != OWN):
            continue  # a length line or a copy of the pooled model: no record of its own to register
        record = best[name]
        tags = {"training_data_sha256": summary.training_data_sha256, "synthetic": json.dumps(summary.synthetic),
                "params": json.dumps(record.params.to_dict(), sort_keys=True)}
        tags |= {f"cv_spearman/{b}": f"{v:.6f}" for b, v in record.cv_spearman.items() if v is not None}
        tracking.log_onnx_model(run_id, name, path, record.cv_objective, tags)


if __name__ == "__main__":
    sys.exit(main())

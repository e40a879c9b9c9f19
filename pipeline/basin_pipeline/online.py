"""Stage `online`: re-estimating a session's peak at call k, trained, scored honestly and exported.

Rules:
- What the gateway knows at call k (`basin_runtime.online`): the first-call prediction, the prompt
  sizes of calls 1..k, the completion sizes of calls 1..k-1. The rows of slot k are the sessions
  with at least k calls, their features taken at call k; a session that ended before call k is not
  re-estimated (its peak is known by then), so each k is scored on the sessions still running.
- The first-call prediction feature is out-of-fold: each session predicted by the shipped model's
  knobs (train's `best.json`, its own model or the pooled one) fitted without its task (train's
  task-grouped folds). Those knobs were tuned on all folds: the only leak into the scores below, and
  a small one next to the features it feeds.
- Model per (file, slot): ridge on a subset of the features (`SUBSETS`) with a strength (`ALPHAS`),
  the pair chosen by the mean per-fold Spearman of grouped cross-validation. Files: one per shipped
  first-call model (pooled, and each benchmark with its own), trained on that model's rows.
- Reported (nested, unseen-task; like stage `nested`): per fold seed, outer task-grouped folds; the
  pair is chosen on inner task-grouped folds of the outer-train rows only, refitted there and scored
  on the outer-test rows; per-fold Spearman averaged over folds, then mean +- sd over seeds. Beside
  it on the same rows: the first-call prediction alone and the context at call k alone.
- Reservations at call k (q = 0.9): m_k fitted on inner out-of-fold ratios of the outer-train rows,
  reservation = max(m_k x re-estimate, context at k); against the first-call reservation grown with
  the context, max(m_1 x first-call prediction, context at k), m_1 fitted the same way; coverage and
  reserved/used on the outer-test rows (`basin_pipeline.reservations.cover`).
- Shipped multipliers per slot: quantiles of true/predicted over the shipped choice's out-of-fold
  predictions (train's folds), on the first-call grid.
- Out-of-fold re-estimates (`--out-of-fold-table`, issue 49 part 1; the simulator's revisions): for
  each benchmark, each slot k in `SLOTS` and each session reaching call k, the re-estimate at call k
  from the outer task-grouped fold that held its task out, at the first fold seed (as nested's table):
  the pair chosen on that fold's inner folds, the ridge fitted on its outer-train rows, clamped as
  served (`clamp_peak`: at least the context at k). Columns: session_id, benchmark, k,
  online_predicted, fold. A slot with fewer than 2 x outer_folds sessions has no rows (those sessions
  are not revised there). Only the re-estimate is out of fold: its reservation multiplier m_k(q) is
  the shipped file's (Assumption: m_k is a quantile of out-of-fold ratios already, and the simulator
  sweeps q, so one fold-fitted m at q = 0.9 would not serve the sweep).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pandas as pd
from onnx import TensorProto, helper
from sklearn.linear_model import Ridge

from basin_pipeline import reservations
from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.featurize import FrameSummary
from basin_pipeline.metrics_files import numbers_only, write_metrics
from basin_pipeline.nested import assign
from basin_pipeline.params import online_params, or_exit
from basin_pipeline.scoring import spearman
from basin_pipeline.trained import POOLED, TrainedModel, TrainedModels, TrainedModelsError
from basin_runtime.logs import configure_logging
from basin_runtime.online import (
    FEATURES,
    INPUTS,
    MAX_PEAK_TOKENS,
    ONLINE_SCHEMA_VERSION,
    OUTPUT,
    SLOTS,
    OnlineModel,
    features,
    slot_index,
)
from basin_runtime.predictor import model_file_name
from basin_runtime.session_table import read_table

log = logging.getLogger(__name__)
SUBSETS: tuple[tuple[int, ...], ...] = ((1,), (1, 2), (0, 1), (0, 1, 2, 4), tuple(range(len(FEATURES))))
ALPHAS = (0.01, 0.1, 1.0, 10.0, 100.0)
Q = 0.9


@dataclass(frozen=True)
class Choice:
    """A fitted choice: the feature subset and ridge strength (weights over all features, 0 where unused)."""

    subset: tuple[int, ...]
    alpha: float

    def fit(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
        ridge = Ridge(alpha=self.alpha, solver="cholesky").fit(x[:, list(self.subset)], y)
        weights = np.zeros(x.shape[1])
        weights[list(self.subset)] = ridge.coef_
        return weights, float(ridge.intercept_)


def predict(weights: np.ndarray, intercept: float, x: np.ndarray) -> np.ndarray:
    """Peak tokens from log-space weights (what the ONNX graph computes)."""
    return np.asarray(np.expm1(x @ weights + intercept), dtype=np.float64)


@dataclass
class Slice:
    """The sessions of one file with at least k calls, their features at call k, target and task folds."""

    x: np.ndarray
    log_peak: np.ndarray
    context: np.ndarray
    first_call: np.ndarray
    rows: np.ndarray  # indices into the file's frame

    @property
    def peak(self) -> np.ndarray:
        return np.asarray(np.expm1(self.log_peak), dtype=np.float64)


def history(table: pd.DataFrame) -> dict[str, tuple[list[int], list[int]]]:
    """Session id -> (prompt sizes, completion sizes) of its calls, from the session table."""
    out = {}
    for sid, calls in zip(table["session_id"], table["calls"], strict=True):
        out[str(sid)] = ([int(c["prompt_tokens"]) for c in calls], [int(c["completion_tokens"]) for c in calls])
    return out


def slice_at(frame: pd.DataFrame, calls: dict[str, tuple[list[int], list[int]]], first_call: np.ndarray,
             k: int) -> Slice:
    """The k-th call's rows of `frame` (sessions with >= k calls)."""
    rows, x, context = [], [], []
    for i, sid in enumerate(frame["session_id"].astype(str)):
        prompts, completions = calls[sid]
        if len(prompts) >= k:
            rows.append(i)
            x.append(features(float(first_call[i]), prompts[:k], completions[:k - 1]))
            context.append(prompts[k - 1])
    at = np.asarray(rows, dtype=np.int64)
    return Slice(np.asarray(x, dtype=np.float64).reshape(-1, len(FEATURES)),
                 np.log1p(frame["peak_prompt_tokens"].to_numpy(np.float64)[at]),
                 np.asarray(context, dtype=np.float64), first_call[at], at)


def per_fold_spearman(predicted: np.ndarray, true: np.ndarray, labels: np.ndarray) -> float | None:
    values = [v for f in np.unique(labels) if (v := spearman(predicted[labels == f], true[labels == f])) is not None]
    return float(np.mean(values)) if values else None


def out_of_fold(part: Slice, rows: np.ndarray, labels: np.ndarray, choice: Choice) -> np.ndarray:
    """Predictions for `rows` of the slice, each from a fit without its fold (`labels`)."""
    predicted = np.empty(len(rows))
    for fold in np.unique(labels):
        train, test = rows[labels != fold], labels == fold
        weights, intercept = choice.fit(part.x[train], part.log_peak[train])
        predicted[test] = predict(weights, intercept, part.x[rows[test]])
    return predicted


def choose(part: Slice, rows: np.ndarray, labels: np.ndarray) -> Choice:
    """The (subset, alpha) with the best mean per-fold Spearman over `labels`' folds of `rows`."""
    best, best_score = Choice(SUBSETS[0], ALPHAS[0]), -np.inf
    for subset in SUBSETS:
        for alpha in ALPHAS:
            choice = Choice(subset, alpha)
            score = per_fold_spearman(out_of_fold(part, rows, labels, choice), part.log_peak[rows], labels)
            if score is not None and score > best_score:
                best, best_score = choice, score
    return best


def nested_scores(frame: pd.DataFrame, part: Slice, seeds: Sequence[int], outer_folds: int,
                  inner_folds: int) -> dict[str, Any]:
    """Nested unseen-task scores of slot k's re-estimate, beside first call and context, with reservations."""
    names = ("online", "first_call", "context")
    spearmans: dict[str, list[float]] = {n: [] for n in names}
    folds: list[dict[str, Any]] = []
    every = np.arange(len(part.rows))
    sub = frame.iloc[part.rows].reset_index(drop=True)
    for seed in seeds:
        labels = assign(sub, every, outer_folds, seed, "unseen_task")
        per_seed: dict[str, list[float]] = {n: [] for n in names}
        for fold in np.unique(labels):
            train, test = every[labels != fold], every[labels == fold]
            inner = assign(sub, train, inner_folds, seed * 1000 + int(fold) + 1, "unseen_task")
            choice = choose(part, train, inner)
            weights, intercept = choice.fit(part.x[train], part.log_peak[train])
            predicted = predict(weights, intercept, part.x[test])
            for name, values in (("online", predicted), ("first_call", part.first_call[test]),
                                 ("context", part.context[test])):
                if (rho := spearman(values, part.log_peak[test])) is not None:
                    per_seed[name].append(rho)
            folds.append(_fold_reservations(part, train, test, inner, choice, predicted))
        for name in names:
            if per_seed[name]:
                spearmans[name].append(float(np.mean(per_seed[name])))
    out: dict[str, Any] = {"sessions": len(part.rows)}
    out.update({name: reservations.spread(values) for name, values in spearmans.items() if values})
    out["reservations_q0.9"] = {key: {m: reservations.spread([f[key][m] for f in folds]) for m in
                                      ("coverage", "reserved_over_used")} for key in ("online", "first_call")}
    return out


def out_of_fold_rows(bench: str, frame: pd.DataFrame, calls: dict[str, tuple[list[int], list[int]]],
                     first: np.ndarray, seed: int, outer_folds: int, inner_folds: int) -> pd.DataFrame:
    """The out-of-fold re-estimates of one benchmark's sessions at every slot (see the rules)."""
    out: list[pd.DataFrame] = []
    for k in SLOTS:
        part = slice_at(frame, calls, first, k)
        if len(part.rows) < 2 * outer_folds:
            continue
        every = np.arange(len(part.rows))
        sub = frame.iloc[part.rows].reset_index(drop=True)
        labels = assign(sub, every, outer_folds, seed, "unseen_task")
        predicted = np.empty(len(every))
        for fold in np.unique(labels):
            train, test = every[labels != fold], every[labels == fold]
            inner = assign(sub, train, inner_folds, seed * 1000 + int(fold) + 1, "unseen_task")
            weights, intercept = choose(part, train, inner).fit(part.x[train], part.log_peak[train])
            predicted[test] = predict(weights, intercept, part.x[test])
        floors = np.maximum(part.context, 1.0)
        raw = np.where(np.isfinite(predicted), predicted, MAX_PEAK_TOKENS)
        out.append(pd.DataFrame({"session_id": sub["session_id"].astype(str).to_numpy(), "benchmark": bench,
                                 "k": np.full(len(every), k, dtype=np.int64),
                                 "online_predicted": np.clip(raw, floors, MAX_PEAK_TOKENS),
                                 "fold": labels.astype(np.int64)}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(
        {"session_id": [], "benchmark": [], "k": np.array([], np.int64), "online_predicted": [], "fold": []})


def _fold_reservations(part: Slice, train: np.ndarray, test: np.ndarray, inner: np.ndarray, choice: Choice,
                       predicted: np.ndarray) -> dict[str, dict[str, float]]:
    true_train, true_test = part.peak[train], part.peak[test]
    m_online = reservations.multipliers(true_train, out_of_fold(part, train, inner, choice), (Q,))[str(Q)]
    m_first = reservations.multipliers(true_train, part.first_call[train], (Q,))[str(Q)]
    context = part.context[test]
    return {"online": reservations.cover(true_test, np.maximum(m_online * predicted, context)),
            "first_call": reservations.cover(true_test, np.maximum(m_first * part.first_call[test], context))}


def first_call_out_of_fold(rows: pd.DataFrame, record: TrainedModel) -> np.ndarray:
    """The shipped knobs' out-of-fold first-call predictions (train's task-grouped folds)."""
    params = record.params
    return FoldFeaturizer(rows, [params.ngram_max]).out_of_fold(params, rows["fold_unseen"].to_numpy())


def graph(weights: np.ndarray, intercepts: np.ndarray, metadata: dict[str, str]) -> onnx.ModelProto:
    """peak_tokens = exp(sum(features * W[slot], 1) + b[slot]) - 1, W [S, F], b [S]."""
    f = len(FEATURES)
    nodes = [
        helper.make_node("Gather", ["W", "slot"], ["w_rows"], axis=0),
        helper.make_node("Mul", ["features", "w_rows"], ["products"]),
        helper.make_node("ReduceSum", ["products", "axes"], ["dot"], keepdims=0),
        helper.make_node("Gather", ["b", "slot"], ["b_rows"], axis=0),
        helper.make_node("Add", ["dot", "b_rows"], ["z"]),
        helper.make_node("Exp", ["z"], ["e"]),
        helper.make_node("Sub", ["e", "one"], [OUTPUT]),
    ]
    initializers = [
        helper.make_tensor("W", TensorProto.FLOAT, [len(SLOTS), f], weights.astype(np.float32).ravel().tolist()),
        helper.make_tensor("b", TensorProto.FLOAT, [len(SLOTS)], intercepts.astype(np.float32).tolist()),
        helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
        helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
    ]
    assert set(INPUTS) == {"features", "slot"}
    g = helper.make_graph(nodes, "basin_online", [
        helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", f]),
        helper.make_tensor_value_info("slot", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["N"])], initializers)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="basin")
    model.ir_version = 8
    for key, value in sorted(metadata.items()):
        model.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(model)
    return model


MIN_SESSIONS = 10  # a slot with fewer sessions reaching its call reuses the slot before it


def ship(name: str, rows: pd.DataFrame, record: TrainedModel, first: np.ndarray, summary: FrameSummary,
         calls: dict[str, tuple[list[int], list[int]]], out: Path, rtol: float) -> dict[str, Any] | None:
    """Fit every slot on all of the file's rows, write `<stem>.online.onnx` after a parity check; its choices.

    A slot that fewer than MIN_SESSIONS sessions reach reuses the slot before it (said in its choices); when
    too few reach call 2, no online file is written for this model (its sessions are never revised).
    `first`: the rows' out-of-fold first-call predictions (`first_call_out_of_fold`)."""
    weights, intercepts = np.zeros((len(SLOTS), len(FEATURES))), np.zeros(len(SLOTS))
    chosen: dict[str, dict[str, Any]] = {}
    by_slot: dict[str, list[float]] = {}
    grid = reservations.SHIPPED_QUANTILES
    for s, k in enumerate(SLOTS):
        part = slice_at(rows, calls, first, k)
        if len(part.rows) < MIN_SESSIONS:
            if s == 0:
                log.warning("online %s: only %d sessions reach call 2 (fewer than %d): no online model; its "
                            "sessions are not revised", name, len(part.rows), MIN_SESSIONS)
                return None
            weights[s], intercepts[s] = weights[s - 1], intercepts[s - 1]
            by_slot[str(k)] = by_slot[str(SLOTS[s - 1])]
            chosen[str(k)] = {"same_as_slot": SLOTS[s - 1], "sessions": len(part.rows)}
            continue
        labels = rows["fold_unseen"].to_numpy()[part.rows]
        every = np.arange(len(part.rows))
        choice = choose(part, every, labels)
        weights[s], intercepts[s] = choice.fit(part.x, part.log_peak)
        m = reservations.multipliers(part.peak, out_of_fold(part, every, labels, choice), grid)
        by_slot[str(k)] = [round(m[str(q)], 6) for q in grid]
        chosen[str(k)] = {"features": [FEATURES[i] for i in choice.subset], "alpha": choice.alpha,
                          "sessions": len(part.rows)}
    metadata = {
        "basin.online_schema_version": ONLINE_SCHEMA_VERSION, "basin.model_name": name,
        "basin.benchmarks": json.dumps(list(record.benchmarks)), "basin.features": json.dumps(list(FEATURES)),
        "basin.slots": json.dumps(list(SLOTS)),
        "basin.first_call_training_data_sha256": summary.training_data_sha256,
        "basin.first_call_params": json.dumps(record.params.to_dict(), sort_keys=True),
        "basin.online_multipliers": json.dumps({"quantiles": list(grid), "by_slot": by_slot}, sort_keys=True),
        "basin.metrics": json.dumps({"chosen": chosen}, sort_keys=True),
    }
    path = out / model_file_name(None if name == POOLED else name).replace(".onnx", ".online.onnx")
    path.write_bytes(graph(weights, intercepts, metadata).SerializeToString())
    _check_parity(path, rows, calls, first, weights, intercepts, rtol)
    return chosen


def _check_parity(path: Path, rows: pd.DataFrame, calls: dict[str, tuple[list[int], list[int]]], first: np.ndarray,
                  weights: np.ndarray, intercepts: np.ndarray, rtol: float) -> None:
    """The served model (`OnlineModel`, onnxruntime) matches the numpy fit at every k from 2 to 12."""
    served = OnlineModel.load(path)
    firsts, prompts, completions, expected = [], [], [], []
    for i, sid in enumerate(rows["session_id"].astype(str)):
        p, c = calls[sid]
        for k in range(2, min(len(p), 12) + 1):
            slot = slot_index(k)
            x = np.asarray(features(float(first[i]), p[:k], c[:k - 1]))
            expected.append(max(float(predict(weights[slot], float(intercepts[slot]), x[None, :])[0]), p[k - 1], 1.0))
            firsts.append(float(first[i]))
            prompts.append(p[:k])
            completions.append(c[:k - 1])
    got = served.predict_batch(firsts, prompts, completions)
    relative = np.abs(got - np.asarray(expected)) / np.maximum(np.asarray(expected), 1.0)
    if relative.max() > rtol:
        raise ValueError(f"{path}: the served online model differs from the fit by {relative.max():.2e} relative "
                         f"(tolerance {rtol:.0e}) at {int(np.argmax(relative))} of {len(relative)} histories")
    log.info("%s: served online model matches the fit within %.1e relative on %d histories", path.name,
             relative.max(), len(relative))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.online", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--frame", type=Path, required=True)
    parser.add_argument("--sessions", type=Path, required=True, help="the session table (calls)")
    parser.add_argument("--summary", type=Path, required=True, help="featurize's summary.json")
    parser.add_argument("--best", type=Path, required=True, help="train's best.json")
    parser.add_argument("--out", type=Path, required=True, help="folder for the .online.onnx files")
    parser.add_argument("--metrics", type=Path, required=True, help="online.json (the full report)")
    parser.add_argument("--headline-dir", type=Path, help="folder for online_k<k>.json headline files")
    parser.add_argument("--out-of-fold-table", type=Path,
                        help="parquet of out-of-fold re-estimates per session and slot (the simulator's revisions)")
    args = parser.parse_args(argv)
    configure_logging()
    params = or_exit(online_params, args.params, parser.prog)
    started = time.monotonic()
    frame = pd.read_parquet(args.frame)
    calls = history(read_table(args.sessions).select(["session_id", "calls"]).to_pandas())
    try:
        best = TrainedModels.read(args.best)
    except TrainedModelsError as exc:
        log.error("%s", exc)
        return 1
    summary = FrameSummary.read(args.summary)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"protocol": "unseen-task, nested: " + _protocol(params), "by_benchmark": {},
                              "shipped": {}}
    table: list[pd.DataFrame] = []
    try:
        own_first: dict[str, np.ndarray] = {}  # a benchmark's own model: the same rows and knobs as its file's
        for bench in sorted(frame["benchmark"].astype(str).unique()):
            name = bench if bench in best else POOLED
            rows = frame[frame["benchmark"] == bench].reset_index(drop=True)
            first = first_call_out_of_fold(rows, best[name])
            if name == bench:
                own_first[bench] = first
            entry: dict[str, Any] = {"model": "own" if name == bench else "pooled"}
            if args.out_of_fold_table is not None:
                table.append(out_of_fold_rows(bench, rows, calls, first, params.seeds[0], params.outer_folds,
                                              params.inner_folds))
            for k in params.eval_calls:
                part = slice_at(rows, calls, first, k)
                if len(part.rows) < 2 * params.outer_folds:
                    continue
                entry[f"k{k}"] = nested_scores(rows, part, params.seeds, params.outer_folds, params.inner_folds)
                log.info("%-18s k=%-2d online %s  first call %s  context %s  (%d sessions)", bench, k,
                         _fmt(entry[f"k{k}"].get("online")), _fmt(entry[f"k{k}"].get("first_call")),
                         _fmt(entry[f"k{k}"].get("context")), len(part.rows))
            report["by_benchmark"][bench] = entry
        for name, record in best.items():
            rows = (frame if name == POOLED else frame[frame["benchmark"] == name]).reset_index(drop=True)
            first = own_first[name] if name in own_first else first_call_out_of_fold(rows, record)
            report["shipped"][name] = ship(name, rows, record, first, summary, calls, args.out, params.parity_rtol)
    except ValueError as exc:  # one line naming the file, slot or fold, no traceback
        log.error("%s", exc)
        return 1
    log.info("online: %.0f s", time.monotonic() - started)
    write_metrics(args.metrics, report)
    if args.out_of_fold_table is not None:
        args.out_of_fold_table.parent.mkdir(parents=True, exist_ok=True)
        pd.concat(table, ignore_index=True).to_parquet(args.out_of_fold_table, index=False)
    if args.headline_dir is not None:
        for k in params.eval_calls:
            write_metrics(args.headline_dir / f"online_k{k}.json", numbers_only(
                {str(b): e.get(f"k{k}", {}).get("online", {}).get("mean")
                 for b, e in report["by_benchmark"].items()}))
    return 0


def _protocol(params: Any) -> str:
    return (f"{len(params.seeds)} fold seeds x {params.outer_folds} outer task-grouped folds; the feature subset "
            f"and ridge strength chosen on {params.inner_folds} inner task-grouped folds of the outer-train rows; "
            "per-fold Spearman on sessions with >= k calls, averaged over folds, mean +- sd over seeds")


def _fmt(value: dict[str, Any] | None) -> str:
    if not value:
        return "n/a"
    return f"{value['mean']:.3f} ± {value['sd'] or 0.0:.3f}"


if __name__ == "__main__":
    sys.exit(main())

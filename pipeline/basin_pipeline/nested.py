"""Stage `nested`: the ranking quality a user gets on new data, by nested, repeated cross-validation.

Rules:
- Outer folds, per benchmark and per fold seed: unseen-task = every run of a task in one outer fold;
  seen-task = runs spread at random, scored only on test rows whose task has a run in the outer-train
  rows (benchmarks without repeated tasks are not scored seen-task). A benchmark's outer folds depend
  only on (seed, benchmark, its rows), so the pooled model, its own model and the baselines are
  scored on the same folds.
- For each outer fold, one fresh Optuna study (the search space and objective of `basin_pipeline.tuning`)
  sees ONLY the outer-train rows, split into inner folds by the same protocol; its best knobs are
  refitted on the outer-train rows and predict the outer-test rows, which no study has seen.
- The reported number is the per-fold Spearman (within one benchmark's rows of one outer fold),
  averaged over the outer folds where it is defined, then mean and sd over the seeds. The value
  pooled over all outer-test rows is reported beside it but is biased: it mixes the folds' scales
  (each fold's predictions come from a different model), so a model whose predictions sit near its
  training mean is pushed negative (a fold with a high true mean has a lower training mean); a
  constant predictor has an undefined per-fold Spearman (null), yet a defined, usually negative,
  pooled one.
- Baselines are fitted per outer fold on the outer-train rows of their benchmark: constant (their
  median), and a log-log line of one number (first-prompt tokens, task characters).
- Reservations (unseen_task only, `basin_pipeline.reservations`): in each outer fold, the chosen knobs
  predict every outer-train row from inner folds (the inner study's folds, task-grouped) without its
  own fold; m(q) per benchmark is fitted on those ratios alone, then scored on the outer-test rows
  (coverage, reserved/used) beside an oracle and a per-benchmark constant; mean, sd and min over
  every (seed, outer fold). No new study: the fold's chosen knobs are reused.
- The shipped model is trained by `train` (tuned on all folds, fitted on all rows); this stage only
  reports how well that recipe does on rows it never tuned or fitted on.
- The numbers are also logged as one MLflow run `nested` (`run_metrics`: each model's per-fold Spearman mean
  and sd per protocol and benchmark, the headline files'), a side channel nothing reads back.
- Selected (`basin_pipeline.selection`): per (seed, outer fold, benchmark), the own model, the pooled
  model and the two length lines are scored on the inner folds of the outer-train rows only (the tuned
  models' inner predictions are their studies' chosen trials', kept, not refitted); the best there is
  scored on the outer-test rows. `selected` is that whole procedure's score (the headline's), beside each
  candidate's; `selected_chosen` counts the choices.
- Out-of-fold predictions (`--predictions`): for the first fold seed of the unseen-task protocol, each
  session's prediction by the pooled model, by its benchmark's own model (null without one) and by the
  selected procedure (with the candidate it chose), each from the outer fold that held every run of its
  task out of tuning and fitting. The simulator
  replays sessions with these (basin_sim/experiments/predictions.py `load_out_of_fold`), so no simulated session
  is predicted by a model that saw its task.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import optuna
import pandas as pd
import scipy.sparse as sp
from tqdm import tqdm

from basin_pipeline import reservations, selection, tracking
from basin_pipeline.fast_cv import EmptyVocabularyError, FoldFeaturizer
from basin_pipeline.features import ModelParams
from basin_pipeline.length_line import fit_line, predict_line
from basin_pipeline.metrics_files import numbers_only, write_metrics
from basin_pipeline.params import NestedParams, SearchSpace, nested_params, or_exit, train_params
from basin_pipeline.scoring import mean_defined, spearman, spearman_by_benchmark
from basin_pipeline.train import model_subsets
from basin_pipeline.tuning import suggest
from basin_runtime.logs import configure_logging

log = logging.getLogger(__name__)
PROTOCOLS = ("unseen_task", "seen_task")
SELECTED, SELECTED_CANDIDATE = "selected", "selected_candidate"  # out-of-fold keys beside the models' names
BASELINES = {"constant": None, "first_prompt_only": "first_prompt_tokens", "task_chars_only": "task_chars"}


class Splitter(Protocol):
    """What the nested loop needs of `FoldFeaturizer` (a test can wrap it to record the indices)."""

    log_target: np.ndarray

    def split(self, params: ModelParams, train: np.ndarray, test: np.ndarray) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        ...

    def fit_predict(self, params: ModelParams, train: np.ndarray, test: np.ndarray) -> np.ndarray:
        ...


@dataclass(frozen=True)
class Settings:
    outer_folds: int
    inner_folds: int
    trials: int
    search: SearchSpace


def assign(frame: pd.DataFrame, rows: np.ndarray, folds: int, seed: int, protocol: str) -> np.ndarray:
    """Fold labels for `rows` of `frame`, per benchmark: by task (unseen_task) or by row (seen_task)."""
    labels = np.empty(len(rows), dtype=np.int64)
    benches = frame["benchmark"].to_numpy()[rows]
    tasks = frame["task_id"].to_numpy()[rows]
    for bench in np.unique(benches):
        at = np.flatnonzero(benches == bench)
        rng = np.random.default_rng([seed, zlib.crc32(str(bench).encode())])
        if protocol == "unseen_task":
            unique = np.unique(tasks[at])
            task_fold = dict(zip(rng.permutation(unique), np.arange(len(unique)) % folds, strict=True))
            labels[at] = [task_fold[t] for t in tasks[at]]
        else:
            labels[at] = rng.permutation(np.arange(len(at)) % folds)
    return labels


def scored_rows(frame: pd.DataFrame, train: np.ndarray, test: np.ndarray, protocol: str) -> np.ndarray:
    """The test rows a protocol scores: all (unseen_task), or those whose task has a training run."""
    if protocol == "unseen_task":
        return test
    keys = frame["benchmark"].astype(str) + "\x00" + frame["task_id"].astype(str)
    seen = set(keys.to_numpy()[train])
    return test[np.isin(keys.to_numpy()[test], list(seen))]


def fit_predict(featurizer: Splitter, params: ModelParams, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Peak tokens predicted for `test` by the fast pipeline fitted on `train` only."""
    return featurizer.fit_predict(params, train, test)


def inner_study(frame: pd.DataFrame, featurizer: Splitter, rows: np.ndarray, labels: np.ndarray,
                settings: Settings, seed: int) -> ModelParams:
    """Knobs chosen by a fresh study that sees only `rows` (inner folds `labels`), tuning's objective."""
    return inner_study_predictions(frame, featurizer, rows, labels, settings, seed)[0]


def inner_study_predictions(frame: pd.DataFrame, featurizer: Splitter, rows: np.ndarray, labels: np.ndarray,
                            settings: Settings, seed: int) -> tuple[ModelParams, np.ndarray]:
    """`inner_study`'s knobs and their inner out-of-fold predictions of `rows` (kept from the chosen trial,
    so nothing is fitted twice)."""
    sub = frame.iloc[rows].reset_index(drop=True)
    kept: dict[int, np.ndarray] = {}

    def objective(trial: optuna.Trial) -> float:
        params = suggest(trial, settings.search)
        try:
            predicted = inner_out_of_fold(featurizer, params, rows, labels)
        except EmptyVocabularyError as exc:
            raise optuna.TrialPruned(str(exc)) from exc
        kept[trial.number] = predicted
        return mean_defined(spearman_by_benchmark(sub, predicted))

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    study.optimize(objective, n_trials=settings.trials)
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
        raise ValueError(f"nested: all {settings.trials} trials of an inner study ({len(rows)} rows) left an empty "
                         "vocabulary; raise nested.trials or narrow train.search.min_df / max_df")
    best = study.best_trial
    return suggest(optuna.trial.FixedTrial(dict(best.params)), settings.search), kept[best.number]


def baseline_predict(frame: pd.DataFrame, name: str, train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """A baseline fitted on `train`: its median (constant) or a log-log line of one number."""
    true = frame["peak_prompt_tokens"].to_numpy(dtype=np.float64)
    column = BASELINES[name]
    if column is None:
        return np.full(len(test), float(np.expm1(np.median(np.log1p(true[train])))))
    x = frame[column].to_numpy(dtype=np.float64)
    return predict_line(*fit_line(x[train], true[train]), x[test])  # what a shipped length line computes


Predictor = Callable[[np.ndarray, np.ndarray, int], np.ndarray]
# (candidate, seed, outer fold, outer-train rows, their inner folds, their inner out-of-fold predictions,
# outer-test rows, their predictions): what a run hands `selection.Candidates` (`candidate_recorder`)
Recorder = Callable[[str, int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def score_seed(frame: pd.DataFrame, labels: np.ndarray, protocol: str, predict: Predictor,
               keep: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Per-benchmark scores of one seed's outer folds: per-fold Spearman mean, and pooled over rows; with
    `keep`, the seed's outer-fold prediction of every row is appended to it."""
    true = frame["peak_prompt_tokens"].to_numpy(dtype=np.float64)
    benches = frame["benchmark"].to_numpy()
    predicted = np.full(len(frame), np.nan)
    per_fold: dict[str, list[float | None]] = {str(b): [] for b in np.unique(benches)}
    scored = np.zeros(len(frame), dtype=bool)
    for fold in np.unique(labels):
        train, test = np.flatnonzero(labels != fold), np.flatnonzero(labels == fold)
        predicted[test] = predict(train, test, int(fold))
        rows = scored_rows(frame, train, test, protocol)
        scored[rows] = True
        for bench in per_fold:
            at = rows[benches[rows] == bench]
            per_fold[bench].append(spearman(predicted[at], true[at]))
    if keep is not None:
        keep.append(predicted)
    out: dict[str, Any] = {}
    for bench, values in per_fold.items():
        defined = [v for v in values if v is not None]
        at = scored & (benches == bench)
        out[bench] = {"per_fold": float(np.mean(defined)) if defined else None,
                      "undefined_folds": len(values) - len(defined),
                      "pooled_over_rows": spearman(predicted[at], true[at]), "scored_rows": int(at.sum())}
    return out


def inner_out_of_fold(featurizer: Splitter, params: ModelParams, rows: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Peak tokens predicted for each of `rows` by `params` fitted on the other inner folds of `rows`."""
    predicted = np.full(len(rows), np.nan)
    for fold in np.unique(labels):
        at = labels == fold
        predicted[at] = fit_predict(featurizer, params, rows[~at], rows[at])
    return predicted


def fold_reservations(frame: pd.DataFrame, featurizer: Splitter, params: ModelParams, train: np.ndarray,
                      test: np.ndarray, inner: np.ndarray, predicted: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per benchmark: multipliers fitted on the outer-train rows' inner out-of-fold ratios, scored on `test`."""
    oof = inner_out_of_fold(featurizer, params, train, inner)
    true = frame["peak_prompt_tokens"].to_numpy(dtype=np.float64)
    benches = frame["benchmark"].astype(str).to_numpy()
    out: dict[str, dict[str, Any]] = {}
    for bench in np.unique(benches[test]):
        at_train, at_test = benches[train] == bench, benches[test] == bench
        if at_train.any():
            out[str(bench)] = reservations.fold_scores(true[train][at_train], oof[at_train],
                                                       true[test][at_test], predicted[at_test])
    return out


def model_predictor(frame: pd.DataFrame, featurizer: Splitter, labels: np.ndarray, protocol: str,
                    settings: Settings, seed: int, chosen: list[dict[str, Any]],
                    reserved: list[dict[str, dict[str, Any]]] | None = None,
                    record: Recorder | None = None) -> Predictor:
    """Outer-fold predictions of the tuned model: inner study on the outer-train rows, refit, predict;
    with `reserved`, each fold's reservation scores (`fold_reservations`) are appended to it; with `record`,
    each fold's inner and outer predictions are handed to it (as candidate "model")."""
    def predict(train: np.ndarray, test: np.ndarray, fold: int) -> np.ndarray:
        inner = inner_folds(frame, train, settings, seed, fold, protocol)
        params, oof = inner_study_predictions(frame, featurizer, train, inner, settings, seed * 1000 + fold)
        chosen.append({"outer_fold": fold, **params.to_dict()})
        try:
            predicted = fit_predict(featurizer, params, train, test)
        except EmptyVocabularyError as exc:
            raise ValueError(f"nested ({protocol}, seed {seed}, outer fold {fold}): the inner study's choice leaves "
                             f"no word on the {len(train)} outer-train rows ({exc}); narrow train.search.min_df / "
                             "max_df") from exc
        if reserved is not None:
            reserved.append(fold_reservations(frame, featurizer, params, train, test, inner, predicted))
        if record is not None:
            record("model", seed, fold, train, inner, oof, test, predicted)
        return predicted
    return predict


def inner_folds(frame: pd.DataFrame, train: np.ndarray, settings: Settings, seed: int, fold: int,
                protocol: str) -> np.ndarray:
    """The inner fold labels of an outer fold's training rows (the inner study's, and the selection's)."""
    return assign(frame, train, settings.inner_folds, seed * 1000 + fold + 1, protocol)


def baseline_predictor(frame: pd.DataFrame, name: str, settings: Settings, seed: int, protocol: str,
                       record: Recorder | None = None) -> Predictor:
    """Outer-fold predictions of a baseline; with `record`, also its predictions on the inner folds."""
    def predict(train: np.ndarray, test: np.ndarray, fold: int) -> np.ndarray:
        predicted = baseline_predict(frame, name, train, test)
        if record is not None:
            inner = inner_folds(frame, train, settings, seed, fold, protocol)
            oof = np.full(len(train), np.nan)
            for f in np.unique(inner):
                oof[inner == f] = baseline_predict(frame, name, train[inner != f], train[inner == f])
            record(name, seed, fold, train, inner, oof, test, predicted)
        return predicted
    return predict


def candidate_recorder(frame: pd.DataFrame, protocol: str, candidates: selection.Candidates,
                       model_candidate: str) -> Recorder:
    """A `Recorder` filing, per benchmark of each outer fold, a candidate's score on the inner folds (their
    scored rows, as the outer folds') and its scored outer-test predictions in `candidates` (the tuned model
    under `model_candidate`)."""
    true = frame["peak_prompt_tokens"].to_numpy(dtype=np.float64)
    benches = frame["benchmark"].astype(str).to_numpy()
    ids = frame["session_id"].astype(str).to_numpy()

    def record(name: str, seed: int, fold: int, train: np.ndarray, inner: np.ndarray, oof: np.ndarray,
               test: np.ndarray, predicted: np.ndarray) -> None:
        scored_inner = np.zeros(len(train), dtype=bool)
        for f in np.unique(inner):
            at = np.flatnonzero(inner == f)
            scored_inner[at[np.isin(train[at], scored_rows(frame, train[inner != f], train[at], protocol))]] = True
        scored = np.isin(test, scored_rows(frame, train, test, protocol))
        for bench in np.unique(benches[test]):
            mine, out = scored_inner & (benches[train] == bench), scored & (benches[test] == bench)
            entry = selection.FoldCandidate(selection.inner_score(oof[mine], true[train][mine], inner[mine]),
                                            tuple(ids[test][out]), predicted[out], true[test][out])
            candidates.add(seed, fold, str(bench), model_candidate if name == "model" else name, entry)
    return record


def selected_scores(candidates: selection.Candidates, seeds: list[int]) -> dict[str, dict[str, Any]]:
    """Per benchmark: the selected procedure's scores (as each model's) and how often each candidate was chosen."""
    out: dict[str, dict[str, Any]] = {}
    for bench, entry in candidates.selected(seeds).items():
        per_seed = entry["per_seed"]
        out[bench] = {"selected": {"per_fold": repeated(per_seed, "per_fold"),
                                   "pooled_over_rows": repeated(per_seed, "pooled_over_rows"),
                                   "undefined_folds": [r["undefined_folds"] for r in per_seed],
                                   "scored_rows": [r["scored_rows"] for r in per_seed]},
                      "selected_chosen": entry["chosen"]}
    return out


def repeated(per_seed: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Mean and sd (over seeds) of one per-seed number; null where no seed defines it."""
    values = [s[key] for s in per_seed]
    defined = [v for v in values if v is not None]
    return {"mean": float(np.mean(defined)) if defined else None,
            "sd": float(np.std(defined, ddof=1)) if len(defined) > 1 else None, "seeds": values}


def nested_scores(frame: pd.DataFrame, protocol: str, seeds: list[int], settings: Settings,
                  featurizer: Splitter, *, with_baselines: bool, with_reservations: bool = False,
                  predictions: list[np.ndarray] | None = None,
                  record: Recorder | None = None) -> dict[str, dict[str, Any]]:
    """Per benchmark: the nested model's (and the baselines') per-seed scores, then mean and sd; with
    reservations, their scores over every (seed, outer fold) under `reservations`; with `predictions`,
    the model's outer-fold predictions of every row for each seed are appended to it; with `record`, every
    fold's inner and outer predictions of the model and the baselines (`Recorder`)."""
    runs: dict[str, list[dict[str, Any]]] = {"model": [], **({b: [] for b in BASELINES} if with_baselines else {})}
    chosen: dict[int, list[dict[str, Any]]] = {}
    reserved: list[dict[str, dict[str, Any]]] | None = [] if with_reservations else None
    for seed in seeds:
        labels = assign(frame, np.arange(len(frame)), settings.outer_folds, seed, protocol)
        chosen[seed] = []
        runs["model"].append(score_seed(frame, labels, protocol, model_predictor(
            frame, featurizer, labels, protocol, settings, seed, chosen[seed], reserved, record), predictions))
        for name in runs.keys() - {"model"}:
            runs[name].append(score_seed(frame, labels, protocol, baseline_predictor(
                frame, name, settings, seed, protocol, record if name in selection.CANDIDATES else None)))
    out: dict[str, dict[str, Any]] = {}
    for bench in sorted(runs["model"][0]):
        out[bench] = {name: {"per_fold": repeated([r[bench] for r in per_seed], "per_fold"),
                             "pooled_over_rows": repeated([r[bench] for r in per_seed], "pooled_over_rows"),
                             "undefined_folds": [r[bench]["undefined_folds"] for r in per_seed],
                             "scored_rows": [r[bench]["scored_rows"] for r in per_seed]}
                      for name, per_seed in runs.items()}
        out[bench]["chosen_params"] = {str(s): c for s, c in chosen.items()}
        folds = [f[bench] for f in reserved or [] if bench in f]
        if folds:
            out[bench]["reservations"] = reservations.aggregate(folds)
    return out


def protocol_text(protocol: str, params: NestedParams) -> str:
    """The protocol, named beside every number."""
    how = ("unseen-task (folds grouped by task)" if protocol == "unseen_task" else
           "seen-task (random folds, scored on test runs whose task has a run in training)")
    return (f"{how} nested CV: {params.outer_folds} outer x {params.inner_folds} inner folds, "
            f"{len(params.seeds)} fold seeds, {params.trials} Optuna trials per inner study; per-fold "
            f"Spearman averaged over outer folds, mean and sd over seeds")


def reservations_text(params: NestedParams) -> str:
    """The reservations' protocol, named beside their numbers."""
    return (f"unseen-task (folds grouped by task) nested CV: {params.outer_folds} outer x {params.inner_folds} "
            f"inner folds, {len(params.seeds)} fold seeds; m(q) from the inner out-of-fold true/predicted ratios "
            f"of the outer-train rows (the fold's chosen knobs), scored on the outer-test rows; mean, sd and min "
            f"over every (seed, outer fold)")


def repeated_tasks(frame: pd.DataFrame) -> list[str]:
    """Benchmarks with a task run more than once (the only ones a seen-task protocol can score)."""
    counts = frame.groupby("benchmark")["task_id"].agg(lambda s: s.nunique() < len(s))
    return sorted(str(b) for b, has in counts.items() if has)


def report(frame: pd.DataFrame, params: NestedParams, search: SearchSpace,
           out_of_fold: dict[str, pd.Series] | None = None) -> dict[str, Any]:
    """Nested scores of the pooled model and each benchmark's own model, with baselines, per protocol; with
    `out_of_fold`, each model's unseen-task predictions of the first seed by session id, under its name."""
    settings = Settings(params.outer_folds, params.inner_folds, params.trials, search)
    if "session_id" not in frame:  # the selection matches candidates' rows by session id (`candidate_recorder`)
        frame = frame.assign(session_id=[f"row-{i}" for i in range(len(frame))])
    result: dict[str, Any] = {"settings": {"seeds": list(params.seeds), "outer_folds": params.outer_folds,
                                           "inner_folds": params.inner_folds, "trials": params.trials},
                              "notes": NOTES}
    subsets = model_subsets(frame)
    sizes = range(search.ngram_max[0], search.ngram_max[1] + 1)
    for protocol in PROTOCOLS:
        if protocol == "seen_task" and not params.seen_task:
            continue
        benches = repeated_tasks(frame) if protocol == "seen_task" else sorted(frame["benchmark"].astype(str).unique())
        section: dict[str, Any] = {b: {"protocol": protocol_text(protocol, params)} for b in benches}
        candidates = selection.Candidates()
        for name, subset in tqdm(subsets.items(), desc=f"nested {protocol}", unit=" model"):
            if name != "pooled" and name not in benches:
                continue
            rows = subset.reset_index(drop=True)  # the pooled model learns from every benchmark's rows
            started = time.monotonic()
            kept: list[np.ndarray] = []
            record = candidate_recorder(rows, protocol, candidates,
                                        selection.POOLED_MODEL if name == "pooled" else selection.OWN)
            scores = nested_scores(rows, protocol, list(params.seeds), settings, FoldFeaturizer(rows, sizes),
                                   with_baselines=name != "pooled", with_reservations=protocol == "unseen_task",
                                   predictions=kept, record=record)
            if out_of_fold is not None and protocol == "unseen_task":
                out_of_fold[name] = pd.Series(kept[0], index=rows["session_id"].to_numpy())
            log.info("%s %s: %.0f s", protocol, name, time.monotonic() - started)
            for bench, entry in ((b, e) for b, e in scores.items() if b in benches):
                key = "pooled_model" if name == "pooled" else "own_model"
                section[bench][key] = entry.pop("model")
                section[bench][f"{key}_chosen_params"] = entry.pop("chosen_params")
                if "reservations" in entry:
                    section[bench][f"{key}_reservations"] = {"protocol": reservations_text(params),
                                                             **entry.pop("reservations")}
                section[bench].update(entry)  # baselines (from the own model's run)
        for bench, entry in selected_scores(candidates, list(params.seeds)).items():
            if bench in section:
                section[bench].update(entry)
        if out_of_fold is not None and protocol == "unseen_task":
            picked = candidates.predictions(params.seeds[0])
            out_of_fold[SELECTED] = pd.Series({sid: p for sid, (p, _) in picked.items()}, dtype="float64")
            out_of_fold[SELECTED_CANDIDATE] = pd.Series({sid: c for sid, (_, c) in picked.items()}, dtype=object)
        result[protocol] = section
    return result


NOTES = {
    "per_fold": "Spearman within one benchmark's rows of one outer fold, averaged over the outer folds where "
                "it is defined; `mean`/`sd` over fold seeds. This is the reported estimate.",
    "pooled_over_rows": "Spearman over all outer-test rows at once; biased: it mixes predictions of different "
                        "fold models, whose scales differ, and pushes weak models negative.",
    "constant": "median of the outer-train rows: it ranks nothing, so its per-fold Spearman is undefined "
                "(null), never 0; its pooled-over-rows value shows the pooling bias alone.",
    "first_prompt_only / task_chars_only": "a log-log line of one number fitted on the outer-train rows.",
    "own_model_reservations / pooled_model_reservations": (
        "unseen-task only. m(q) = q-quantile (inverted empirical CDF) of true/predicted peak over the inner "
        "out-of-fold predictions of the outer-train rows of this benchmark (the fold's chosen knobs); coverage = "
        "share of outer-test rows with true peak <= m(q) x predicted; reserved_over_used = sum of reserves / sum "
        "of true peaks on those rows. oracle reserves the true peak; constant reserves the q-quantile of the "
        "outer-train true peaks. mean, sd, min over every (seed, outer fold)."),
    "own_model / pooled_model": "a fresh Optuna study per outer fold on its inner folds, the chosen knobs "
                                "refitted on the outer-train rows.",
    "selected": "the whole procedure that picks the shipped predictor (basin_pipeline.selection): in each outer "
                "fold, the own model, the pooled model and the two length lines are scored on the inner folds of "
                "the outer-train rows only (per-fold Spearman), the best is chosen there and scored on the "
                "outer-test rows; `selected_chosen` counts the choices over every (seed, outer fold). The "
                "headline's number.",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_pipeline.nested", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--frame", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="nested.json to write")
    parser.add_argument("--headline-dir", type=Path,
                        help="folder for the headline files spearman_unseen.json, spearman_seen.json, cover90.json")
    parser.add_argument("--predictions", type=Path,
                        help="write the out-of-fold predictions (unseen task, first seed) of every session here")
    args = parser.parse_args(argv)
    configure_logging()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    params = or_exit(nested_params, args.params, parser.prog)
    frame = pd.read_parquet(args.frame)
    started = time.monotonic()
    out_of_fold: dict[str, pd.Series] = {}
    try:
        result = report(frame, params, or_exit(train_params, args.params, parser.prog).search, out_of_fold)
    except ValueError as exc:  # one line naming the fold and the knob, no traceback
        log.error("%s", exc)
        return 1
    log.info("nested: %.0f s", time.monotonic() - started)  # not in the file: it stays the same per input
    for protocol in PROTOCOLS:
        for bench, entry in result.get(protocol, {}).items():
            own = entry.get("own_model", {}).get("per_fold", {})
            pooled = entry.get("pooled_model", {}).get("per_fold", {})
            log.info("%-11s %-20s own %s  pooled %s", protocol, bench, _fmt(own), _fmt(pooled))
            cover = entry.get("own_model_reservations", entry.get("pooled_model_reservations"))
            if cover:
                log.info("%-11s %-20s m(0.9) covers %s (constant %s)", protocol, bench,
                         _fmt(cover["model"]["0.9"]["coverage"]), _fmt(cover["constant"]["0.9"]["coverage"]))
    write_metrics(args.out, result)  # 4 significant digits: a re-run elsewhere leaves git clean
    if args.predictions is not None:
        write_out_of_fold(args.predictions, frame, out_of_fold, params)
    if args.headline_dir is not None:
        for name, values in headline(result).items():
            write_metrics(args.headline_dir / f"{name}.json", values)
    tracking.configure()
    tracking.log_run("nested", {"seeds": list(params.seeds), "outer_folds": params.outer_folds,
                                "inner_folds": params.inner_folds, "trials": params.trials}, run_metrics(result), {})
    return 0


MODELS = ("selected", "own_model", "pooled_model", "first_prompt_only", "task_chars_only")


def run_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """What the MLflow run `nested` holds: per protocol, benchmark and model (the shipped recipe and the
    baselines), the per-fold Spearman's mean and sd over fold seeds (`unseen_task/terminal-bench/own_model/mean`),
    and the headline files' numbers (`headline/spearman_unseen/terminal-bench`)."""
    out: dict[str, Any] = {"headline": headline(result)}
    for protocol in PROTOCOLS:
        for bench, entry in result.get(protocol, {}).items():
            for model in MODELS:
                per_fold = entry.get(model, {}).get("per_fold", {})
                values = {k: per_fold.get(k) for k in ("mean", "sd") if per_fold.get(k) is not None}
                if values:
                    out.setdefault(protocol, {}).setdefault(str(bench), {})[model] = values
    return out


def out_of_fold_table(frame: pd.DataFrame, out_of_fold: dict[str, pd.Series], params: NestedParams) -> pd.DataFrame:
    """One row per session: its outer fold (unseen task, first seed) and the pooled and own models' predictions."""
    seed = params.seeds[0]
    table = frame[["session_id", "benchmark", "task_id", "peak_prompt_tokens"]].copy()
    table["seed"] = seed
    table["outer_fold"] = assign(frame, np.arange(len(frame)), params.outer_folds, seed, "unseen_task")
    table["pooled_predicted"] = table["session_id"].map(out_of_fold["pooled"]).astype("float64")
    models = [series for name, series in out_of_fold.items() if name not in ("pooled", SELECTED, SELECTED_CANDIDATE)]
    own = pd.concat(models) if models else pd.Series(dtype="float64")
    table["own_predicted"] = table["session_id"].map(own).astype("float64")
    if SELECTED in out_of_fold:
        table["selected_predicted"] = table["session_id"].map(out_of_fold[SELECTED]).astype("float64")
        table["selected_candidate"] = table["session_id"].map(out_of_fold[SELECTED_CANDIDATE]).astype(object)
    return table.reset_index(drop=True)


def write_out_of_fold(path: Path, frame: pd.DataFrame, out_of_fold: dict[str, pd.Series], params: NestedParams) -> None:
    """The out-of-fold table as parquet (what `basin_sim.experiments.predictions.load_out_of_fold` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out_of_fold_table(frame, out_of_fold, params).to_parquet(path, index=False)


def headline(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The headline files' contents, by benchmark name: `spearman_unseen` and `spearman_seen` (per-fold mean
    Spearman under each protocol) of the selected procedure (`selection`: the choice between the models and
    the length lines made on inner folds, scored whole), else of the model that ships for each benchmark
    (its own, else the pooled one), and `cover90` (outer-fold coverage of that tuned model's 0.9 multiplier).
    One file per number, so `dvc metrics show` is a row per number and a column per benchmark."""
    out: dict[str, dict[str, Any]] = {"spearman_unseen": {}, "spearman_seen": {}, "cover90": {}}
    for bench, entry in result.get("unseen_task", {}).items():
        model = "own_model" if "own_model" in entry else "pooled_model"
        name = str(bench)
        seen = result.get("seen_task", {}).get(bench, {})
        cover = entry.get(f"{model}_reservations", {}).get("model", {}).get("0.9", {}).get("coverage", {})
        out["spearman_unseen"][name] = entry.get(_ranked(entry, model), {}).get("per_fold", {}).get("mean")
        out["spearman_seen"][name] = seen.get(_ranked(seen, model), {}).get("per_fold", {}).get("mean")
        out["cover90"][name] = cover.get("mean")
    return {file: numbers_only(values) for file, values in out.items()}


def _ranked(entry: dict[str, Any], model: str) -> str:
    """The entry's key whose Spearman the headline shows: the selected procedure's where scored, else `model`."""
    return "selected" if "selected" in entry else model


def _fmt(value: dict[str, Any]) -> str:
    mean, sd = value.get("mean"), value.get("sd")
    return "n/a" if mean is None else f"{mean:.3f} ± {sd or 0.0:.3f}"


if __name__ == "__main__":
    sys.exit(main())

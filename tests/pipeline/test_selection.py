"""The first-call predictor that ranks best out of fold (issue 49, part 5): `basin_pipeline.selection`, the nested
stage's selected procedure, train's shipped choice, export's length line and the gateway loading it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import optuna
import pandas as pd
import pytest

from basin_pipeline import export, nested, selection, train
from basin_pipeline.features import ModelParams, model_frame
from basin_pipeline.featurize import FrameSummary, assign_folds
from basin_pipeline.length_line import LengthLine
from basin_pipeline.onnx_export import line_to_onnx, serialize
from basin_pipeline.params import NestedParams
from basin_pipeline.scoring import spearman
from basin_pipeline.trained import ServingChoice, TrainedModel, TrainedModels, TrainedModelsError
from basin_runtime.gateway.predictors import Predictors, predict_peak
from basin_runtime.predictor import PeakPredictor, model_file_name
from tests.pipeline.test_nested import SPACE, synthetic

SUMMARY = FrameSummary(rows=0, benchmarks={}, tasks={}, synthetic=True, training_data_sha256="0" * 64,
                       tokenizer="qwen3.6")


@pytest.fixture(autouse=True)
def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def length_driven(seed: int, num_rows: int, bench: str = "len") -> pd.DataFrame:
    """Texts of pure noise; the peak is a steep function of the task's length (a length line ranks it)."""
    frame = synthetic(seed, num_rows, signal=False).assign(benchmark=bench)
    rng = np.random.default_rng(seed + 100)
    frame["task_chars"] = rng.integers(100, 100_000, num_rows)
    frame["peak_prompt_tokens"] = (40 * frame["task_chars"] ** 0.8 * np.exp(rng.normal(0, 0.05, num_rows))).astype(int)
    return frame


def _ids(n: int) -> tuple[str, ...]:
    return tuple(f"s{i}" for i in range(n))


def test_the_choice_is_made_on_inner_folds_and_ignores_the_outer_test_rows() -> None:
    """Outer-test rows favour the pooled model (it ranks them perfectly), the inner folds of the outer-train rows
    the own model: the own model is chosen, and the selected score is its (poor) outer score."""
    true = np.array([*range(1, 13), 5, 1, 4, 2, 3], dtype=float)
    frame = pd.DataFrame({"benchmark": "b", "task_id": [f"t{i}" for i in range(17)], "peak_prompt_tokens": true,
                          "session_id": [f"s{i}" for i in range(17)]})
    train_rows, test_rows, inner = np.arange(12), np.arange(12, 17), np.repeat([0, 1, 2], 4)
    candidates = selection.Candidates()
    for name, sign in ((selection.OWN, 1.0), (selection.POOLED_MODEL, -1.0)):
        record = nested.candidate_recorder(frame, "unseen_task", candidates, name)
        record("model", 1, 0, train_rows, inner, sign * true[train_rows], test_rows, -sign * true[test_rows])
    assert candidates.choices() == {(1, 0, "b"): selection.OWN}
    assert candidates.folds[(1, 0, "b")][selection.OWN].inner == pytest.approx(1.0)
    selected = candidates.selected([1])["b"]
    assert selected["per_seed"][0]["per_fold"] == pytest.approx(-1.0)  # the chosen model's outer score
    assert selected["chosen"] == {selection.OWN: 1}
    assert candidates.predictions(1)["s12"] == (-5.0, selection.OWN)


def test_ties_go_to_the_earlier_candidate_and_undefined_scores_are_never_chosen() -> None:
    assert selection.choose({selection.TASK_CHARS: 0.3, selection.POOLED_MODEL: 0.3}) == selection.POOLED_MODEL
    assert selection.choose({selection.OWN: None, selection.FIRST_PROMPT: -0.2}) == selection.FIRST_PROMPT
    assert selection.choose({selection.OWN: None, selection.POOLED_MODEL: None}) == selection.OWN
    with pytest.raises(ValueError, match="constant"):
        selection.choose({"constant": 0.1})


def test_candidates_of_one_fold_must_score_the_same_rows() -> None:
    candidates = selection.Candidates()
    entry = selection.FoldCandidate(0.1, _ids(3), np.ones(3), np.arange(3.0))
    candidates.add(1, 0, "b", selection.OWN, entry)
    with pytest.raises(ValueError, match="other outer-test rows"):
        candidates.add(1, 0, "b", selection.TASK_CHARS, selection.FoldCandidate(0.2, _ids(4), np.ones(4),
                                                                                np.arange(4.0)))


def test_the_nested_selected_score_is_the_chosen_candidates_outer_score() -> None:
    """Peaks that follow task length: the line or the own model (whose features hold the length too) is chosen
    in each outer fold, and the selected per-fold score is the mean of the chosen candidates' outer scores,
    recomputed here from the runs' own outer predictions."""
    frame = length_driven(1, 60)
    frame["session_id"] = [f"s{i}" for i in range(len(frame))]
    settings = nested.Settings(outer_folds=5, inner_folds=3, trials=3, search=SPACE)
    candidates, kept = selection.Candidates(), []
    record = nested.candidate_recorder(frame, "unseen_task", candidates, selection.OWN)
    scores = nested.nested_scores(frame, "unseen_task", [1, 2], settings, nested.FoldFeaturizer(frame, [1]),
                                  with_baselines=True, predictions=kept, record=record)["len"]
    selected = nested.selected_scores(candidates, [1, 2])["len"]
    assert sum(selected["selected_chosen"].values()) == 10  # 2 seeds x 5 outer folds
    assert selected["selected_chosen"].get(selection.TASK_CHARS, 0) > 0
    true = frame["peak_prompt_tokens"].to_numpy(dtype=float)
    for i, seed in enumerate([1, 2]):
        labels = nested.assign(frame, np.arange(len(frame)), 5, seed, "unseen_task")
        per_fold = []
        for fold in range(5):
            train_rows, test_rows = np.flatnonzero(labels != fold), np.flatnonzero(labels == fold)
            chosen = candidates.choices()[(seed, fold, "len")]
            predicted = kept[i][test_rows] if chosen == selection.OWN else \
                nested.baseline_predict(frame, chosen, train_rows, test_rows)
            per_fold.append(spearman(predicted, true[test_rows]))
        assert selected["selected"]["per_fold"]["seeds"][i] == pytest.approx(np.mean(per_fold))
    assert scores["task_chars_only"]["per_fold"]["mean"] > 0.9


def test_the_nested_report_writes_the_selected_procedure_and_its_out_of_fold_predictions() -> None:
    frame = pd.concat([length_driven(1, 50), synthetic(2, 60, signal=True).assign(benchmark="words")],
                      ignore_index=True)
    frame["session_id"] = [f"s{i}" for i in range(len(frame))]
    frame = assign_folds(frame, 5, 13)
    params = NestedParams(seeds=(1, 2), outer_folds=5, inner_folds=3, trials=2, seen_task=False)
    out_of_fold: dict[str, pd.Series] = {}
    result = nested.report(frame, params, SPACE, out_of_fold)
    for bench in ("len", "words"):
        entry = result["unseen_task"][bench]
        assert sum(entry["selected_chosen"].values()) == 10
        assert entry["selected"]["per_fold"]["mean"] is not None
        assert nested.headline(result)["spearman_unseen"][bench] == entry["selected"]["per_fold"]["mean"]
    table = nested.out_of_fold_table(frame, out_of_fold, params)
    assert table["selected_predicted"].notna().all()
    assert set(table["selected_candidate"]) <= set(selection.CANDIDATES)
    own = table["selected_candidate"] == selection.OWN
    assert np.allclose(table.loc[own, "selected_predicted"], table.loc[own, "own_predicted"])
    pooled = table["selected_candidate"] == selection.POOLED_MODEL
    assert np.allclose(table.loc[pooled, "selected_predicted"], table.loc[pooled, "pooled_predicted"])


def _records(frame: pd.DataFrame) -> dict[str, TrainedModel]:
    params = ModelParams(alpha=1.0, max_features=None)
    return {name: TrainedModel(params, 0.0, {}, 0, len(frame), ("len",)) for name in ("pooled", "len")}


def test_train_ships_the_length_line_when_it_ranks_best_on_trains_folds(tmp_path: Path) -> None:
    frame = assign_folds(length_driven(3, 60), 5, 13)
    choices = train.serving_choices(frame, _records(frame))
    choice = choices["len"]
    assert choice.choice == selection.TASK_CHARS and choice.line is not None
    assert choice.cv_spearman[selection.TASK_CHARS] > 0.9
    assert set(choice.cv_spearman) == set(selection.CANDIDATES)
    assert choice.line == LengthLine.fit(frame, "task_chars")  # fitted on all of the benchmark's rows
    best = TrainedModels(_records(frame), choices)
    best.write(tmp_path / "best.json")
    again = TrainedModels.read(tmp_path / "best.json")
    assert again.serving_choices == choices and again.shipped("len") == selection.TASK_CHARS
    again.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "best.json").read_bytes()
    raw = json.loads((tmp_path / "best.json").read_text())
    raw["serving"]["len"]["line"]["column"] = "first_prompt_tokens"
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(TrainedModelsError, match=r"serving\.len: .*task_chars"):
        TrainedModels.read(tmp_path / "bad.json")


def test_a_file_without_serving_ships_each_benchmarks_own_model() -> None:
    best = TrainedModels({"pooled": _records(pd.DataFrame())["pooled"], "a": _records(pd.DataFrame())["len"]})
    assert best.shipped("a") == selection.OWN and best.shipped("b") == selection.POOLED_MODEL
    assert "serving" not in best.to_json()


def _line_choice(frame: pd.DataFrame) -> ServingChoice:
    line = LengthLine.fit(frame, "task_chars")
    return ServingChoice(selection.TASK_CHARS, {selection.TASK_CHARS: 0.9, selection.OWN: 0.1}, line)


def test_export_ships_the_length_line_as_onnx_matching_the_line(tmp_path: Path) -> None:
    frame = assign_folds(length_driven(4, 60), 5, 13)
    choice = _line_choice(frame)
    path = tmp_path / model_file_name("len")
    path.write_bytes(export.export_line("len", choice, frame, SUMMARY, rtol=1e-4))
    served = PeakPredictor.load(path, expected_tokenizer="qwen3.6")
    sessions = export.parity_set(frame)
    expected = np.clip(choice.line.predict(model_frame(list(sessions.task_texts), [len(t) for t in sessions.task_texts],
                                                       list(sessions.first_prompt_tokens))),
                       np.maximum(np.asarray(sessions.first_prompt_tokens, dtype=float), 1.0), None)
    got = served.predict_batch(sessions.task_texts, sessions.first_prompt_tokens)
    assert np.allclose(got, expected, rtol=1e-5)
    ranks = spearman(got[: len(frame)], expected[: len(frame)])
    assert ranks is not None and ranks > 0.99
    assert served.info.params == {"length_line": choice.line.to_json()}
    assert served.info.metrics["parity_max_rel"] <= 1e-4
    assert served.multiplier(0.9, "len") >= served.multiplier(0.5, "len") > 0
    assert served.online is None


def test_the_parity_check_fails_a_graph_that_is_not_the_line(tmp_path: Path) -> None:
    frame = assign_folds(length_driven(5, 40), 5, 13)
    choice = _line_choice(frame)
    assert choice.line is not None
    wrong = LengthLine("task_chars", choice.line.slope * 1.01, choice.line.intercept)
    proto = line_to_onnx(wrong, export.line_metadata("len", choice, SUMMARY, None, _table()))
    onnx.checker.check_model(proto)
    with pytest.raises(export.ParityError, match="differs from scikit-learn"):
        export.check_parity(choice.line, export.load_served(proto, "qwen3.6"), export.parity_set(frame), 1e-4)


def _table() -> dict[str, object]:
    return {"quantiles": [0.5, 0.9], "all": [1.0, 2.0], "by_benchmark": {"len": [1.0, 2.0]}}


def test_the_gateway_loads_the_shipped_length_line_for_its_workload(tmp_path: Path) -> None:
    frame = assign_folds(length_driven(6, 60), 5, 13)
    choice = _line_choice(frame)
    line_path = tmp_path / model_file_name("len")
    line_path.write_bytes(export.export_line("len", choice, frame, SUMMARY, rtol=1e-4))
    default_path = tmp_path / model_file_name()
    wrong = LengthLine("first_prompt_tokens", 0.0, 9.0)  # another file as the default: a flat line
    default_path.write_bytes(serialize(line_to_onnx(wrong, export.line_metadata(
        "pooled", ServingChoice(selection.FIRST_PROMPT, {}, wrong), SUMMARY, 0.0, _table()))))
    predictors = Predictors.load(default_path, {"len": line_path}, "qwen3.6", reservation_quantile=0.9)
    text, first = "x" * 5000, 700
    assert predict_peak(predictors.for_workload("len"), text, first) == pytest.approx(
        float(choice.line.predict(model_frame([text], [len(text)], [first]))[0]), rel=1e-5)
    assert predict_peak(predictors.for_workload(None), text, first) == pytest.approx(np.expm1(9.0), rel=1e-5)
    assert predictors.multiplier("len") == pytest.approx(PeakPredictor.load(line_path).multiplier(0.9, "len"))


def _nested_doc(with_selected: bool) -> dict[str, object]:
    def per_fold(mean: float) -> dict[str, object]:
        return {"per_fold": {"mean": mean, "sd": 0.1}}
    entry: dict[str, object] = {"own_model": per_fold(0.02), "pooled_model": per_fold(0.14),
                                "task_chars_only": per_fold(0.15), "first_prompt_only": per_fold(0.16)}
    if with_selected:
        entry |= {"selected": per_fold(0.12), "selected_chosen": {"task_chars_only": 9, "own_model": 6}}
    return {"settings": {"seeds": [1, 2, 3]}, "unseen_task": {"terminal-bench": entry}}


def test_the_readme_and_the_headline_report_the_selected_procedure_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from basin_pipeline import headline, render_results

    monkeypatch.setattr(render_results, "_load", lambda path: _nested_doc(True))
    text = render_results.nested_selected_text()
    assert text is not None
    assert text.startswith("terminal-bench **0.12 ± 0.10** (chosen: own_model 6, task_chars_only 9;")
    assert text.index("0.12") < text.index("own model 0.02") < text.index("task length alone 0.15")
    assert headline.spearman_line(_nested_doc(True)).endswith("terminal-bench 0.12 ± 0.10")
    monkeypatch.setattr(render_results, "_load", lambda path: _nested_doc(False))
    assert render_results.nested_selected_text() is None  # a file from before: the shipped model's row, as it was
    assert headline.spearman_line(_nested_doc(False)).endswith("terminal-bench 0.02 ± 0.10")


def test_export_ships_each_benchmarks_choice_and_no_stale_online_model_beside_it(tmp_path: Path) -> None:
    frame = pd.concat([length_driven(7, 40, "len"), length_driven(8, 40, "other")], ignore_index=True)
    frame = assign_folds(frame, 5, 13)
    pooled_line = LengthLine.fit(frame, "first_prompt_tokens")
    pooled = tmp_path / model_file_name()
    pooled.write_bytes(serialize(line_to_onnx(pooled_line, export.line_metadata(
        "pooled", ServingChoice(selection.FIRST_PROMPT, {}, pooled_line), SUMMARY, 0.0, _table()))))
    for bench in ("len", "other"):  # what an earlier export left: an own model's online file
        (tmp_path / model_file_name(bench).replace(".onnx", ".online.onnx")).write_bytes(b"stale")
    choice = _line_choice(frame[frame["benchmark"] == "len"])
    best = TrainedModels(_records(frame), {"len": choice, "other": ServingChoice(selection.POOLED_MODEL, {})})
    written = {"pooled": pooled}
    export.ship_choices(best, written, tmp_path, frame, SUMMARY, 1e-4)
    assert written == {"pooled": pooled, "len": tmp_path / model_file_name("len"),
                       "other": tmp_path / model_file_name("other")}
    assert written["other"].read_bytes() == pooled.read_bytes()
    assert PeakPredictor.load(written["len"]).info.params == {"length_line": choice.line.to_json()}  # type: ignore[union-attr]
    assert not list(tmp_path.glob("*.online.onnx"))  # no online model of another first-call model is left beside

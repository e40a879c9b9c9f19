"""featurize -> train -> export -> evaluate on a small synthetic corpus, and the pieces they rest on."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
import yaml
from sklearn.pipeline import Pipeline

from basin_pipeline import evaluate, export, featurize, online, train
from basin_pipeline.evaluate import seen_mask
from basin_pipeline.export import (
    AWKWARD_TEXTS,
    KNOWN_DIFFERENCE_TEXTS,
    ParityError,
    ParitySet,
    check_parity,
    load_served,
    sklearn_served,
)
from basin_pipeline.fast_cv import FoldFeaturizer
from basin_pipeline.features import ModelParams, build_model
from basin_pipeline.featurize import FrameSummary, assign_folds
from basin_pipeline.onnx_export import to_onnx
from basin_pipeline.scoring import out_of_fold
from basin_pipeline.trained import TrainedModel, TrainedModels
from basin_runtime import predictor as runtime_predictor
from basin_runtime.predictor import SCHEMA_VERSION, PeakPredictor
from basin_runtime.session_table import write_sessions
from basin_sim.workload.synthetic import generate_corpus

ROOT = Path(__file__).resolve().parents[2]


def _params_file(tmp: Path, trials: int = 3) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"]["n_trials"] = trials
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


@pytest.fixture(scope="module")
def featurized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with params.yaml, f.parquet and summary.json from `featurize` on a small synthetic corpus."""
    tmp = tmp_path_factory.mktemp("frame")
    write_sessions(tmp / "s.parquet", generate_corpus(3, 40))
    assert featurize.main(["--params", str(_params_file(tmp)), "--sessions", str(tmp / "s.parquet"),
                           "--out", str(tmp / "f.parquet"), "--summary", str(tmp / "summary.json")]) == 0
    return tmp


@pytest.fixture(scope="module")
def frame(featurized: Path) -> pd.DataFrame:
    return pd.read_parquet(featurized / "f.parquet")


@pytest.fixture(scope="module")
def summary(featurized: Path) -> FrameSummary:
    return FrameSummary.read(featurized / "summary.json")


def _served(model: Pipeline) -> PeakPredictor:
    """The fitted model exported and loaded the way the gateway loads it."""
    return load_served(to_onnx(model, {"basin.schema_version": SCHEMA_VERSION}), expected_tokenizer=None)


def test_unseen_folds_keep_every_task_in_one_fold_and_seen_folds_spread_runs() -> None:
    tasks = [f"t{i % 4}" for i in range(12)] + list("wxyz")
    rows = pd.DataFrame({"benchmark": ["a"] * 12 + ["b"] * 4, "task_id": tasks})
    folded = assign_folds(rows, folds=3, seed=1)
    assert folded.groupby(["benchmark", "task_id"])["fold_unseen"].nunique().max() == 1
    assert set(folded["fold_unseen"]) == {0, 1, 2}
    mask = seen_mask(folded)
    assert not mask[12:].any()  # single-run tasks are never "seen"
    for i in range(12):  # a run is seen iff another run of its task sits in another fold
        same = folded[(folded["task_id"] == folded["task_id"][i]) & (folded["benchmark"] == "a")]
        assert mask[i] == bool((same["fold_seen"] != folded["fold_seen"][i]).any())


@pytest.mark.parametrize("params", [
    ModelParams(alpha=0.5, binary=True, min_df=2, max_df=0.6, max_features=300),
    ModelParams(alpha=2.0, ngram_max=2, max_features=None, min_df=2, use_lengths=False),
])
def test_fast_cross_validation_equals_refitting_the_pipeline(frame: pd.DataFrame, params: ModelParams) -> None:
    fast = FoldFeaturizer(frame, [1, 2]).out_of_fold(params, frame["fold_unseen"].to_numpy())
    slow = out_of_fold(frame, "fold_unseen", lambda: build_model(params))
    np.testing.assert_allclose(fast, slow, rtol=1e-3)


@pytest.mark.parametrize("params", [ModelParams(alpha=0.3), ModelParams(alpha=1.0, ngram_max=2, max_features=None,
                                                                          binary=True)])
def test_served_predictor_matches_scikit_learn_on_awkward_texts(frame: pd.DataFrame, params: ModelParams) -> None:
    model = build_model(params).fit(frame, frame["peak_prompt_tokens"].to_numpy())
    firsts = tuple(int(v) for v in np.linspace(10, 50_000, len(AWKWARD_TEXTS)))
    assert check_parity(model, _served(model), ParitySet(tuple(AWKWARD_TEXTS), firsts), rtol=1e-4) < 1e-4


def test_u0130_is_the_known_lower_casing_difference(frame: pd.DataFrame) -> None:
    """Measured: onnxruntime lower-cases U+0130 unlike Python; export tolerates exactly those rows."""
    rows = frame.copy()
    rows.loc[rows.index[:10], "task_text"] = rows["task_text"][:10] + " İstanbul"
    model = build_model(ModelParams(alpha=0.3)).fit(rows, rows["peak_prompt_tokens"].to_numpy())
    predictor = _served(model)
    probe = ParitySet(tuple(KNOWN_DIFFERENCE_TEXTS * 2), (1000, 1000))
    got, want = predictor.predict_batch(probe.task_texts, probe.first_prompt_tokens), sklearn_served(model, probe)
    assert np.max(np.abs(got - want) / want) > 1e-4  # the difference is real...
    assert check_parity(model, predictor, probe, rtol=1e-4) == 0.0  # ...and confined to the rows export forgives


class _SwappedLengths(ort.InferenceSession):
    """A session fed as by a runtime whose input builder swaps `task_chars` and `first_prompt_tokens`."""

    def run(self, output_names: Sequence[str], input_feed: dict[str, np.ndarray], run_options: Any = None) -> Any:
        feeds = dict(input_feed, task_chars=input_feed["first_prompt_tokens"],
                     first_prompt_tokens=input_feed["task_chars"])
        return super().run(output_names, feeds, run_options)


class _CharsInBytes(ort.InferenceSession):
    """A session fed as by a runtime whose input builder counts `task_chars` in UTF-8 bytes."""

    def run(self, output_names: Sequence[str], input_feed: dict[str, np.ndarray], run_options: Any = None) -> Any:
        in_bytes = [len(str(t).encode()) for t in input_feed["task_text"].ravel()]
        feeds = dict(input_feed, task_chars=np.asarray(in_bytes, dtype=np.float32).reshape(-1, 1))
        return super().run(output_names, feeds, run_options)


@pytest.mark.parametrize("wrong_feeds", [_SwappedLengths, _CharsInBytes])
def test_export_fails_when_the_served_predictor_builds_its_inputs_wrongly(
        featurized: Path, frame: pd.DataFrame, summary: FrameSummary, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wrong_feeds: type) -> None:
    params = ModelParams(alpha=0.3)
    model = build_model(params).fit(frame, frame["peak_prompt_tokens"].to_numpy())
    record = TrainedModel(params=params, cv_objective=0.0, cv_spearman={}, best_trial=0, rows=len(frame),
                          benchmarks=tuple(sorted(frame["benchmark"].unique())))
    table = {"quantiles": [0.5, 0.9], "all": [1.0, 2.0], "by_benchmark": {}}
    blob = export.export_one("pooled", record, model, frame, summary, 1e-4, table)  # the real runtime passes
    assert PeakPredictor.load(_write(tmp_path / "ok.onnx", blob)).info.metrics["parity_max_rel"] < 1e-4

    monkeypatch.setattr(runtime_predictor.ort, "InferenceSession", wrong_feeds)
    with pytest.raises(ParityError, match=r"parity sessions; worst is session \d+ \(task_text .*first_prompt_tokens"):
        export.export_one("pooled", record, model, frame, summary, 1e-4, table)
    train_dir, out = tmp_path / "train", tmp_path / "models"
    train_dir.mkdir()
    (train_dir / "pooled.pkl").write_bytes(pickle.dumps(model))
    TrainedModels({"pooled": record}).write(train_dir / "best.json")
    assert export.main(["--params", str(featurized / "params.yaml"), "--train-dir", str(train_dir),
                        "--frame", str(featurized / "f.parquet"), "--summary", str(featurized / "summary.json"),
                        "--out", str(out), "--publish-dir", str(tmp_path / "published")]) == 1
    assert "pooled: served predictor" in caplog.text and "differs from scikit-learn" in caplog.text
    assert not list(out.glob("*.onnx"))


def _write(path: Path, blob: bytes) -> Path:
    path.write_bytes(blob)
    return path


@pytest.mark.integration
def test_whole_chain_is_deterministic_publishes_nothing_from_synthetic_data_and_tracks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = _params_file(tmp_path)
    write_sessions(tmp_path / "s.parquet", generate_corpus(3, 30))
    assert featurize.main(["--params", str(params), "--sessions", str(tmp_path / "s.parquet"),
                           "--out", str(tmp_path / "f.parquet"), "--summary", str(tmp_path / "summary.json")]) == 0
    blobs, trained = [], []
    for run in ("a", "b"):
        out = tmp_path / run
        assert train.main(["--params", str(params), "--frame", str(tmp_path / "f.parquet"), "--summary",
                           str(tmp_path / "summary.json"), "--out", str(out / "train"),
                           "--trials", str(out / "trials.csv")]) == 0
        published = tmp_path / run / "published"
        assert export.main(["--params", str(params), "--train-dir", str(out / "train"), "--frame",
                            str(tmp_path / "f.parquet"), "--summary", str(tmp_path / "summary.json"),
                            "--out", str(out / "models"), "--publish-dir", str(published)]) == 0
        assert not published.exists()  # synthetic: never replaces the shipped models
        blobs.append({p.name: p.read_bytes() for p in sorted((out / "models").glob("*.onnx"))})
        trained.append({p.name: p.read_bytes() for p in sorted((out / "train").iterdir()) if p.name != "optuna.db"})
    assert blobs[0] == blobs[1] and len(blobs[0]) == 4  # pooled + 3 synthetic benchmarks, same bytes
    # and so is what train writes (dvc.lock hashes it), but the study's SQLite file (.dvcignore'd)
    assert trained[0] == trained[1] and set(trained[0]) == {"best.json", *(f"{n}.pkl" for n in (
        "pooled", "synthetic-swebench", "synthetic-terminal", "synthetic-tau"))}
    best = json.loads((tmp_path / "a" / "train" / "best.json").read_text())
    online_dir, paired = tmp_path / "online", tmp_path / "paired"
    online_args = ["--params", str(params), "--frame", str(tmp_path / "f.parquet"), "--sessions",
                   str(tmp_path / "s.parquet"), "--summary", str(tmp_path / "summary.json"), "--best",
                   str(tmp_path / "a" / "train" / "best.json"), "--out", str(online_dir), "--metrics",
                   str(tmp_path / "online.json"), "--headline-dir", str(tmp_path)]
    assert online.main(online_args) == 0
    assert export.main(["--params", str(params), "--train-dir", str(tmp_path / "a" / "train"), "--frame",
                        str(tmp_path / "f.parquet"), "--summary", str(tmp_path / "summary.json"),
                        "--out", str(paired), "--publish-dir", str(tmp_path / "unused"),
                        "--online-dir", str(online_dir)]) == 0
    with_online = PeakPredictor.load(paired / "peak_predictor-synthetic-terminal.onnx")
    assert with_online.online is not None  # paired: same training data and params
    assert with_online.predict_online("a task", 800, [800, 2000, 4000], [50, 50]) >= 4000
    report = json.loads((tmp_path / "online.json").read_text())
    for bench, entry in report["by_benchmark"].items():
        assert {"online", "first_call", "context"} <= set(entry["k2"]), bench
        assert 0 < entry["k2"]["reservations_q0.9"]["online"]["coverage"]["mean"] <= 1
    assert set(json.loads((tmp_path / "online_k3.json").read_text())) == set(report["by_benchmark"])
    predictor = PeakPredictor.load(tmp_path / "a" / "models" / "peak_predictor.onnx", expected_tokenizer="qwen3.6")
    assert predictor.info.synthetic is True and predictor.info.params == best["models"]["pooled"]["params"]
    assert evaluate.main(["--frame", str(tmp_path / "f.parquet"), "--best", str(tmp_path / "a" / "train" / "best.json"),
                          "--metrics", str(tmp_path / "spearman.json"), "--overflow", str(tmp_path / "overflow.json"),
                          "--plot-data", str(tmp_path / "p.csv"), "--plot", str(tmp_path / "p.png")]) == 0
    _assert_mlflow_holds_the_numbers(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "a" / "train",
                                     tmp_path / "summary.json", tmp_path / "spearman.json", tmp_path / "overflow.json")
    metrics = json.loads((tmp_path / "spearman.json").read_text())
    assert set(metrics) == {"unseen_task", "seen_task", "baselines"}
    overflow = json.loads((tmp_path / "overflow.json").read_text())
    assert {m for scores in overflow.values() for m in scores} == {"constant", "pooled", "own"}
    assert set(metrics["unseen_task"]) == {"synthetic-swebench", "synthetic-terminal", "synthetic-tau"}
    assert metrics["seen_task"] == {}  # synthetic tasks never repeat
    for bench, scores in metrics["unseen_task"].items():
        assert scores["sessions"] == 30 and -1 <= scores["per_benchmark"] <= 1, bench
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_benchmark_with_fewer_tasks_than_folds_gets_no_model_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    from basin_pipeline.train import model_subsets
    from basin_pipeline.trained import POOLED

    frame = pd.DataFrame({"benchmark": ["big"] * 10 + ["rare"] * 3,
                          "task_id": [f"t{k}" for k in range(10)] + ["r0", "r0", "r1"],
                          "fold_unseen": [k % 5 for k in range(10)] + [0, 0, 1]})
    subsets = model_subsets(frame)
    assert set(subsets) == {POOLED, "big"}
    assert len(subsets[POOLED]) == 13  # the rare benchmark's rows still train the pooled model
    assert "benchmark rare: 2 task(s) cannot fill 5 task-grouped folds" in caplog.text



def _assert_mlflow_holds_the_numbers(uri: str, train_dir: Path, summary: Path, spearman_file: Path,
                                     overflow_file: Path) -> None:
    """The training's parent run has each model's CV metrics, its registered versions their metrics and
    data hash, and evaluate's run the numbers of its two files."""
    from mlflow.tracking import MlflowClient

    from basin_pipeline.tracking import EXPERIMENT, registered_name

    best = json.loads((train_dir / "best.json").read_text())
    data_hash = json.loads(summary.read_text())["training_data_sha256"]
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    top = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    train_run = max((r for r in top if r.info.run_name == "train"), key=lambda r: r.info.start_time)
    best_sha = hashlib.sha256((train_dir / "best.json").read_bytes()).hexdigest()
    assert train_run.data.tags["basin.best_sha256"] == best_sha
    assert set(best) == {"models", "serving"}  # nothing run-specific: the same data writes the same bytes
    run_id = train_run.info.run_id
    trained = train_run.data.metrics
    assert {r.info.run_name for r in top} == {"train", "evaluate"}
    for name, record in best["models"].items():
        assert trained[f"cv_objective/{name}"] == pytest.approx(record["cv_objective"])
        for bench, value in record["cv_spearman"].items():
            assert trained[f"cv_spearman/{name}/{bench}"] == pytest.approx(value)
        if best["serving"].get(name, {}).get("choice", "own_model") != "own_model":
            continue  # issue 49: its file ships the pooled model or a length line, so no version of its own
        versions = client.search_model_versions(f"name='{registered_name(name)}' and run_id='{run_id}'")
        version = max(versions, key=lambda v: int(v.version))  # each export of this training registers one
        assert version.tags["training_data_sha256"] == data_hash
        assert float(version.tags["cv_objective"]) == pytest.approx(record["cv_objective"], abs=1e-6)
        assert {k: float(v) for k, v in version.tags.items() if k.startswith("cv_spearman/")} == \
            pytest.approx({f"cv_spearman/{b}": v for b, v in record["cv_spearman"].items()}, abs=1e-6)
    [evaluated] = [r for r in top if r.info.run_name == "evaluate"]
    spearman = json.loads(spearman_file.read_text())
    overflow = json.loads(overflow_file.read_text())
    assert evaluated.data.tags["basin.train_run_id"] == run_id
    for bench, scores in spearman["unseen_task"].items():
        # the files hold 4 significant digits, MLflow the full float
        assert evaluated.data.metrics[f"unseen_task/{bench}/per_benchmark"] == \
            pytest.approx(scores["per_benchmark"], rel=1e-3)
        assert evaluated.data.metrics[f"overflow/{bench}/constant/overflow_share"] == \
            pytest.approx(overflow[bench]["constant"]["overflow_share"], rel=1e-3)

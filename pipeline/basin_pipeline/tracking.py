"""MLflow as a side channel: runs are written here and never read back by any stage.

Rules:
- Each training is one parent run `train` (params, and per model its CV objective and per-benchmark
  Spearman as metrics `cv_objective/<model>`, `cv_spearman/<model>/<benchmark>`) with one nested run
  per trial; evaluate and simulate each log one run of their own (`evaluate`, `simulate`) whose
  metrics are their metrics files flattened (`a/b/c`), tagged with the training run they judge.
- Every registered model version carries its training run's metrics for that model and the training
  data hash as tags (a version has tags, not metrics), so the registry compares versions at a glance.
- The training run is found by the hash of the best.json it wrote (its tag `basin.best_sha256`), not
  by an id inside that file: best.json holds only what training decided, so a re-run on the same
  data writes the same bytes and `dvc.lock` stays as committed. The latest such run wins; with none
  (the tracking store was wiped), export logs its models under a run `export` of its own.

The tracking store defaults to a SQLite file in the repository (`sqlite:///mlflow.db`); set
MLFLOW_TRACKING_URI to send runs elsewhere. Browse with
`mlflow ui --backend-store-uri sqlite:///mlflow.db`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

EXPERIMENT = "basin-peak-predictor"
DEFAULT_URI = "sqlite:///mlflow.db"


def configure() -> None:
    """Point MLflow at the tracking store and the experiment; quiet its chatty loggers."""
    import mlflow

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_URI))
    mlflow.set_experiment(EXPERIMENT)


def flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested mapping as MLflow metric names (`a/b`); undefined values skipped."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat(value, name + "/"))
        elif isinstance(value, bool | int | float):
            out[name] = float(value)
    return out


@contextmanager
def parent_run(name: str, params: Mapping[str, Any]) -> Iterator[str]:
    """A top-level run; yields its id."""
    import mlflow

    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params({k: str(v) for k, v in params.items()})
        yield run.info.run_id


BEST_SHA_TAG = "basin.best_sha256"


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def set_tag(key: str, value: str) -> None:
    """A tag on the active run."""
    import mlflow

    mlflow.set_tag(key, value)


def training_run_id(best_sha256: str) -> str | None:
    """The latest `train` run that wrote a best.json with this hash, or None."""
    import mlflow

    runs = mlflow.search_runs(filter_string=f"tags.`{BEST_SHA_TAG}` = '{best_sha256}' and "
                                            "attributes.run_name = 'train'",
                              order_by=["attributes.start_time DESC"], max_results=1, output_format="list")
    return runs[0].info.run_id if runs else None


def log_metrics(metrics: Mapping[str, Any]) -> None:
    """Numeric leaves of `metrics` on the active run (names as `flat`)."""
    import mlflow

    mlflow.log_metrics(flat(metrics))


def log_run(name: str, params: Mapping[str, Any], metrics: Mapping[str, Any], tags: Mapping[str, str]) -> str:
    """A finished top-level run (evaluate's, simulate's); returns its id."""
    import mlflow

    with mlflow.start_run(run_name=name, tags=dict(tags)) as run:
        mlflow.log_params({k: str(v) for k, v in params.items()})
        mlflow.log_metrics(flat(metrics))
        return str(run.info.run_id)


def log_child(name: str, params: Mapping[str, Any], metrics: Mapping[str, Any], tags: Mapping[str, str]) -> None:
    """A finished nested run under the active one, written in one batch (a few ms, not a few hundred)."""
    import mlflow
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    parent = mlflow.active_run()
    if parent is None:
        raise RuntimeError("log_child needs an active parent run")
    client = mlflow.MlflowClient()
    run = client.create_run(parent.info.experiment_id, run_name=name,
                            tags={MLFLOW_PARENT_RUN_ID: parent.info.run_id, MLFLOW_RUN_NAME: name, **tags})
    now_ms = int(time.time() * 1000)
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, v, now_ms, 0) for k, v in flat(metrics).items()],
        params=[Param(k, str(v)) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.set_terminated(run.info.run_id)


def registered_name(model_name: str) -> str:
    """Registry name of a model: the pooled default, or one per benchmark."""
    return EXPERIMENT if model_name == "pooled" else f"{EXPERIMENT}-{model_name}"


def log_onnx_model(run_id: str, model_name: str, path: Path, score: float,
                   tags: Mapping[str, str] | None = None) -> None:
    """Log an ONNX file under the training run, register it with `tags` (its metrics, data hash) and
    alias it `champion` if it scores best."""
    import mlflow
    import onnx
    from mlflow.exceptions import MlflowException
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(object), (-1, 1), "task_text"),
                       TensorSpec(np.dtype(np.float32), (-1, 1), "task_chars"),
                       TensorSpec(np.dtype(np.float32), (-1, 1), "first_prompt_tokens")]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 1), "peak_tokens")]),
    )
    registered = registered_name(model_name)
    # Named, not inferred: MLflow's inference loads the model in a subprocess (~6 s per model) only to
    # find these same packages (mlflow itself is added by MLflow).
    requirements = [*mlflow.onnx.get_default_pip_requirements(), f"numpy=={np.__version__}"]
    with mlflow.start_run(run_id=run_id):
        info = mlflow.onnx.log_model(onnx.load(path), name=f"onnx-{model_name}", registered_model_name=registered,
                                     signature=signature, onnx_execution_providers=["CPUExecutionProvider"],
                                     pip_requirements=requirements)
    client = mlflow.MlflowClient()
    version = str(info.registered_model_version)
    client.set_model_version_tag(registered, version, "cv_objective", f"{score:.6f}")
    for key, value in (tags or {}).items():
        client.set_model_version_tag(registered, version, key, value)
    try:
        champion = client.get_model_version_by_alias(registered, "champion")
        best = float(champion.tags.get("cv_objective", "-inf"))
    except MlflowException:
        best = float("-inf")
    if score >= best:
        client.set_registered_model_alias(registered, "champion", version)

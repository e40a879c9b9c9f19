"""The user's own tools compare real numbers: a real `dvc exp run` in a git copy of the project, then
`dvc exp show`, `dvc metrics diff` and `dvc plots diff` across it and the commit.

Rules:
- The copy is a git repository with the project's dvc.yaml (without `simulate`: minutes of simulation
  that this test does not need), code, .gitignore, .dvcignore and plot template, and params.yaml
  with the synthetic corpus made tiny (no corpus is present next to it), 2 trials and a one-seed,
  two-trial nested loop; `dvc repro` and a commit of what it writes under metrics/ make the
  baseline, as a user's `make repro` + `git commit` would.
- Marked `integration` (~70 s on 2 idle cores: two pipeline runs, each stage a fresh Python).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from basin_pipeline.params import CORPORA_ROOT_ENV
from tests.pipeline.test_closed_loop import copy_project

ROOT = Path(__file__).resolve().parents[2]
COPIED = ["dvc.yaml", "pipeline", "basin_runtime", "basin_sim", "models", ".gitignore", ".dvcignore"]
HEADLINE = ("metrics/spearman_unseen.json", "metrics/spearman_seen.json", "metrics/cover90.json")
ONLINE = tuple(f"metrics/online_k{k}.json" for k in (2, 3, 5, 10))
DETAILS = ("metrics/train.json", "metrics/spearman.json", "metrics/overflow.json", "metrics/ingest.json",
           "metrics/nested.json")


def _run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""), "DVC_NO_ANALYTICS": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "MLFLOW_TRACKING_URI": f"sqlite:///{project.parent / 'mlflow.db'}"}
    env.pop(CORPORA_ROOT_ENV, None)
    command = [str(Path(venv_bin) / "dvc"), *args[1:]] if args[0] == "dvc" else list(args)
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def _copy(project: Path) -> None:
    copy_project(project, COPIED)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["ingest"]["synthetic"]["sessions_per_benchmark"] = 40
    params["train"]["n_trials"] = 2
    params["nested"] = {**params["nested"], "seeds": [1], "outer_folds": 3, "inner_folds": 2, "trials": 2}
    # templated synthetic texts share most words: keep every word, so no fold is left without a vocabulary
    params["train"]["search"] |= {"min_df": [1, 1], "max_df": [0.95, 1.0]}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stages = yaml.safe_load((project / "dvc.yaml").read_text())
    del stages["stages"]["simulate"]
    (project / "dvc.yaml").write_text(yaml.safe_dump(stages, sort_keys=False))


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The copy after a committed baseline run and one `dvc exp run -S train.n_trials=3 -S nested.trials=3`."""
    project = tmp_path_factory.mktemp("dvc-exp") / "repo"
    _copy(project)
    _run(project, "git", "init", "-q")
    _run(project, "dvc", "init", "-q")
    _run(project, "dvc", "config", "--local", "core.site_cache_dir", str(project.parent / "site"))
    shutil.copytree(ROOT / ".dvc" / "plots", project / ".dvc" / "plots")
    _run(project, "dvc", "repro")
    _run(project, "git", "add", "-A")
    _run(project, "git", "commit", "-q", "-m", "baseline")
    _run(project, "dvc", "exp", "run", "-S", "train.n_trials=3", "-S", "nested.trials=3")
    return project


def _exp_rows(project: Path) -> list[dict[str, str]]:
    shown = _run(project, "dvc", "exp", "show", "--csv", "--no-pager").stdout
    return list(csv.DictReader(io.StringIO(shown)))


@pytest.mark.integration
def test_exp_show_has_the_baselines_and_the_experiments_headline_numbers(experiment: Path) -> None:
    rows = _exp_rows(experiment)
    assert len(rows) >= 2, rows  # the workspace and the committed baseline, at least
    for row in rows:
        assert "!" not in row.values(), row  # `!`: a metric file DVC could not load
        unseen = [v for k, v in row.items() if "synthetic-" in k and "spearman_unseen" in k]
        assert len(unseen) == 3 and all(-1 <= float(v) <= 1 for v in unseen), row
        assert row["train.n_trials"] in {"2", "3"} and row["nested.trials"] in {"2", "3"}
    assert {row["nested.trials"] for row in rows} == {"2", "3"}
    metric_files = {k.split(":")[0] for k in rows[0] if "synthetic-" in k}
    assert metric_files <= set(HEADLINE) | set(ONLINE), metric_files  # headline only: the details stay out


@pytest.mark.integration
def test_metrics_show_is_a_few_columns_and_diff_loads_the_commits_headline_and_details(experiment: Path) -> None:
    shown = _run(experiment, "dvc", "metrics", "show").stdout
    assert max(len(line) for line in shown.splitlines()) < 140, shown  # synthetic names are long
    assert "metrics/spearman_unseen.json" in shown and "metrics/nested.json" not in shown
    diff: dict[str, Any] = json.loads(_run(experiment, "dvc", "metrics", "diff", "HEAD", "--all", "--json").stdout)
    assert set(diff) == (set(HEADLINE) | set(ONLINE)) - {"metrics/spearman_seen.json"}  # synthetic: no repeats
    details: dict[str, Any] = json.loads(_run(experiment, "dvc", "metrics", "diff", "HEAD", "--all", "--json",
                                              "--targets", *DETAILS).stdout)
    assert set(DETAILS) <= set(details)
    for values in (*diff.values(), details["metrics/train.json"]):
        for key, change in values.items():
            assert isinstance(change["old"], int | float) and isinstance(change["new"], int | float), key
    pooled = details["metrics/train.json"]["pooled.best_trial"]
    assert pooled["old"] in {0, 1} and pooled["new"] in {0, 1, 2}


@pytest.mark.integration
def test_plots_diff_draws_both_revisions_and_one_series_per_study(experiment: Path) -> None:
    shown: dict[str, Any] = json.loads(_run(experiment, "dvc", "plots", "diff", "HEAD", "--json").stdout)
    assert not shown.get("errors"), shown["errors"]
    trials = shown["data"]["metrics/trials.csv"][0]
    values = trials["content"]["data"]["values"]
    assert {v["rev"] for v in values} == {"HEAD", "workspace"}
    assert trials["content"]["encoding"]["color"]["field"] == "model"
    series = {v["model"] for v in values}
    assert series == {"pooled", "synthetic-swebench", "synthetic-tau", "synthetic-terminal"}
    assert {v["rev"] for v in shown["data"]["metrics/predictions.csv"][0]["content"]["data"]["values"]} == \
        {"HEAD", "workspace"}

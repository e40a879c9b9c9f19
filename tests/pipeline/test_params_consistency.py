"""params.yaml, dvc.yaml and the stages' dataclasses stay in step."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from basin_pipeline.params import (
    ExportParams,
    FeaturizeParams,
    IngestParams,
    NestedParams,
    ParamsError,
    SimulateParams,
    TrainParams,
    check_all,
    export_params,
    featurize_params,
    ingest_params,
    nested_params,
    simulate_params,
    train_params,
)

ROOT = Path(__file__).resolve().parents[2]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
READERS = {"ingest": (ingest_params, IngestParams), "featurize": (featurize_params, FeaturizeParams),
           "train": (train_params, TrainParams), "export": (export_params, ExportParams),
           "nested": (nested_params, NestedParams),
           "simulate": (simulate_params, SimulateParams)}


def test_every_section_loads_into_its_dataclass() -> None:
    for section, (reader, cls) in READERS.items():
        loaded = reader(ROOT / "params.yaml")
        assert isinstance(loaded, cls)
        assert {f.name for f in dataclasses.fields(cls)} == set(PARAMS[section]), section


def test_each_stage_lists_exactly_the_params_it_reads() -> None:
    declared = {name: {str(p).split(".")[0] for p in stage.get("params", [])} for name, stage in DVC.items()}
    assert declared == {"sources": {"ingest"}, "ingest": {"ingest"}, "featurize": {"featurize"},
                        "train": {"train"}, "nested": {"nested", "train"}, "online": {"online"}, "export": {"export"},
                        "evaluate": set(), "task_memory": set(),
                        "simulate": {"simulate"}}
    for name, stage in DVC.items():
        reads_params = "--params params.yaml" in stage["cmd"]
        assert reads_params == bool(stage.get("params")), name


def _paths(entries: list[object]) -> set[str]:
    return {next(iter(e)) if isinstance(e, dict) else str(e) for e in entries}


def test_every_data_path_in_a_command_is_a_declared_dep_or_output() -> None:
    for name, stage in DVC.items():
        declared = _paths(stage.get("deps", [])) | _paths(stage.get("outs", []))
        declared |= _paths(stage.get("metrics", [])) | _paths(stage.get("plots", []))
        for path in re.findall(r"(?<=\s)(?:data|models|metrics)/\S*|(?<=\s)models(?=\s|$)", stage["cmd"]):
            inside = any(path.startswith(d + "/") for d in declared)  # a file in a declared folder
            holds = any(d.startswith(path + "/") for d in declared)  # a folder of declared files
            assert path in declared or inside or holds, (name, path)


def test_paths_are_named_once_as_outputs() -> None:
    outs = [p for stage in DVC.values() for key in ("outs", "metrics", "plots") for p in _paths(stage.get(key, []))]
    assert len(outs) == len(set(outs))


@pytest.mark.parametrize(("section", "change", "message"), [
    ("train", {"search": {**PARAMS["train"]["search"], "alpha": [0.01]}},
     r"train\.search\.alpha must be a \[low, high\] pair with low <= high \(a number > 0 each\), got \[0\.01\]"),
    ("ingest", {"corpora": [{"benchmark": "b", "format": "f"}]},
     r"ingest\.corpora\[0\]: missing key 'path'$"),
    ("nested", {"seeds": [1, "two"]}, r"nested\.seeds\[1\] must be a whole number, got 'two'"),
    ("export", {"publish": "yes"}, r"export\.publish must be true or false, got 'yes'"),
    ("simulate", {"reservation_quantile": None},
     r"simulate\.reservation_quantile must be a number in \(0, 1\), got None"),
])
def test_a_bad_section_names_the_file_the_key_path_and_the_value(
        tmp_path: Path, section: str, change: dict[str, object], message: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({**PARAMS, section: {**PARAMS[section], **change}}))
    reader = {"train": train_params, "ingest": ingest_params, "nested": nested_params, "export": export_params,
              "simulate": simulate_params}[section]
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(path))}: {message}"):
        reader(path)


# --- values, not only types (issue 45) -----------------------------------------------------------


@pytest.mark.parametrize(("section", "change", "message"), [
    ("featurize", {"folds": -5}, r"featurize\.folds must be a whole number >= 2, got -5"),
    ("featurize", {"folds": 1}, r"featurize\.folds must be a whole number >= 2, got 1"),
    ("ingest", {"max_reject_fraction": 1.5}, r"ingest\.max_reject_fraction must be a fraction in \[0, 1\], got 1\.5"),
    ("train", {"n_trials": 0}, r"train\.n_trials must be a whole number > 0, got 0"),
    ("train", {"search": {**PARAMS["train"]["search"], "alpha": [30.0, 0.01]}},
     r"train\.search\.alpha must be a \[low, high\] pair with low <= high \(a number > 0 each\), got \[30\.0, 0\.01\]"),
    ("train", {"search": {**PARAMS["train"]["search"], "max_df": [0.3, 1.5]}},
     r"train\.search\.max_df\[1\] must be a number in \(0, 1\], got 1\.5"),
    ("nested", {"seeds": []}, r"nested\.seeds must be a non-empty list"),
    ("nested", {"inner_folds": 1}, r"nested\.inner_folds must be a whole number >= 2, got 1"),
    ("online", {"eval_calls": [1, 2]}, r"online\.eval_calls\[0\] must be a whole number >= 2, got 1"),
    ("export", {"parity_rtol": 0}, r"export\.parity_rtol must be a tolerance > 0, got 0"),
    ("simulate", {"reservation_quantile": 1.0},
     r"simulate\.reservation_quantile must be a number in \(0, 1\), got 1\.0"),
])
def test_a_value_out_of_range_is_refused_naming_the_file_the_key_and_the_value(
        tmp_path: Path, section: str, change: dict[str, object], message: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({**PARAMS, section: {**PARAMS[section], **change}}))
    errors = check_all(path)
    assert len(errors) == 1 and re.match(rf"^{re.escape(str(path))}: {message}", errors[0]), errors


def test_the_shipped_params_pass_the_check() -> None:
    assert check_all(ROOT / "params.yaml") == []


def test_a_stage_given_a_bad_value_stops_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({**PARAMS, "featurize": {**PARAMS["featurize"], "folds": -5}}))
    done = subprocess.run([sys.executable, "-m", "basin_pipeline.featurize", "--params", str(path), "--sessions",
                           str(tmp_path / "never-read.parquet"), "--out", str(tmp_path / "f.parquet"), "--summary",
                           str(tmp_path / "s.json")], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 1
    assert done.stderr == (f"python -m basin_pipeline.featurize: error: {path}: featurize.folds must be a whole "
                           "number >= 2, got -5\n")
    checked = subprocess.run([sys.executable, "-m", "basin_pipeline.params", str(path)], capture_output=True,
                             text=True, check=False, timeout=120)
    assert (checked.returncode, checked.stderr.count("\n"), "Traceback" in checked.stderr) == (1, 1, False)


def test_make_repro_checks_params_before_dvc_and_dvc_keeps_the_committed_metrics() -> None:
    # DVC deletes a stage's outputs before running it: the check runs first, and every metrics file
    # in git is persist, so a stage failing for any reason leaves the committed numbers in place.
    recipe = (ROOT / "Makefile").read_text().split("\nrepro:", 1)[1].split("\n\n", 1)[0]
    assert recipe.index("basin_pipeline.params") < recipe.index("dvc repro")
    for name, stage in DVC.items():
        for key in ("outs", "metrics", "plots"):
            for entry in stage.get(key, []):
                path, options = (next(iter(entry.items())) if isinstance(entry, dict) else (entry, {}))
                if str(path).startswith("metrics/"):
                    assert options.get("persist") is True, (name, path)

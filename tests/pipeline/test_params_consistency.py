"""params.yaml, dvc.yaml and the stages' dataclasses stay in step."""

from __future__ import annotations

import dataclasses
import re
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
                        "evaluate": set(),
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
     r"train\.search\.alpha must be a 2 list \(a float each\), got \[0\.01\]"),
    ("ingest", {"corpora": [{"benchmark": "b", "format": "f"}]},
     r"ingest\.corpora\[0\]: missing key 'path'$"),
    ("nested", {"seeds": [1, "two"]}, r"nested\.seeds\[1\] must be a whole number, got 'two'"),
    ("export", {"publish": "yes"}, r"export\.publish must be true or false, got 'yes'"),
    ("simulate", {"reservation_quantile": None}, r"simulate\.reservation_quantile must be a float, got None"),
])
def test_a_bad_section_names_the_file_the_key_path_and_the_value(
        tmp_path: Path, section: str, change: dict[str, object], message: str) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({**PARAMS, section: {**PARAMS[section], **change}}))
    reader = {"train": train_params, "ingest": ingest_params, "nested": nested_params, "export": export_params,
              "simulate": simulate_params}[section]
    with pytest.raises(ParamsError, match=rf"^{re.escape(str(path))}: {message}"):
        reader(path)

"""The event model imports no onnxruntime: only the commands that load a predictor do.

Every module of basin_sim and basin_emulate is imported, one after another, in a fresh interpreter;
after each, the child notes whether onnxruntime has appeared in `sys.modules`, so the module that
brought it is named. Predictions are made (and a predictor file hashed) only by the command modules in
`LOADS_PREDICTOR`; the engine, the run, the knee cache and the emulator take predictions as numbers.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import basin_emulate
import basin_sim

ROOT = Path(__file__).resolve().parents[2]
LOADS_PREDICTOR = frozenset({
    "basin_sim.__main__", "basin_sim.experiments.cli", "basin_sim.experiments.compare",
    "basin_sim.experiments.calibrate.commands"})
CHILD = """
import importlib, json, sys
first = {}
for module in json.loads(sys.argv[1]):
    importlib.import_module(module)
    if "onnxruntime" in sys.modules and not first:
        first = {"module": module}
print(json.dumps(first))
"""


def modules_of(package: object) -> list[str]:
    """The package and every module under it, in name order."""
    name, path = package.__name__, package.__path__  # type: ignore[attr-defined]
    return [name, *sorted(m.name for m in pkgutil.walk_packages(path, f"{name}."))]


def first_to_import_onnxruntime(modules: list[str]) -> str | None:
    """The first of `modules` after whose import onnxruntime is loaded, in a fresh interpreter; None: none."""
    result = subprocess.run([sys.executable, "-c", CHILD, json.dumps(modules)], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=True)
    found: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return found.get("module")


def test_the_event_model_and_the_emulator_import_no_onnxruntime() -> None:
    modules = [m for m in modules_of(basin_sim) + modules_of(basin_emulate)
               if m not in LOADS_PREDICTOR]
    assert {"basin_sim.engine", "basin_sim.simulate", "basin_sim.experiments.calibrate.knee_cache"} <= set(modules)
    assert first_to_import_onnxruntime(modules) is None


def test_the_check_names_a_module_that_does_import_onnxruntime() -> None:
    modules = ["basin_sim.engine", "basin_sim.experiments.cli", "basin_sim.simulate"]
    assert first_to_import_onnxruntime(modules) == "basin_sim.experiments.cli"

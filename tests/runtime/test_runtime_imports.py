"""basin_runtime ships to serving: it must never pull in the training stack."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import basin_runtime

TRAINING_STACK = ("sklearn", "pandas", "optuna", "mlflow", "skl2onnx", "dvc", "scipy")


def test_importing_every_runtime_module_loads_no_training_package() -> None:
    modules = [m.name for m in pkgutil.walk_packages(basin_runtime.__path__, "basin_runtime.")]
    assert "basin_runtime.tokenizer" in modules
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout))
    assert "basin_runtime" in loaded
    assert loaded.isdisjoint(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))

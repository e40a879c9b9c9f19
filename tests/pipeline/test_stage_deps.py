"""Each DVC stage declares the pipeline modules its command imports, so editing one re-runs the stage.

Rules:
- A stage run as `python -m basin_pipeline.<module>` depends on every `basin_pipeline` module it imports,
  transitively (read statically with `ast`): each must be a dep of the stage, itself or through a folder.
- Exempt: `params.py` (the params are declared per stage by key, tests/pipeline/test_params_consistency.py)
  and `tracking.py` (MLflow logging: it writes the run's record, not the stage's outputs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOT = ROOT / "pipeline"
EXEMPT = {"basin_pipeline.params", "basin_pipeline.tracking"}


def _path_of(module: str) -> Path:
    file = SOURCE_ROOT / (module.replace(".", "/") + ".py")
    return file if file.exists() else SOURCE_ROOT / module.replace(".", "/") / "__init__.py"


def _imports(module: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(_path_of(module).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("basin_pipeline"):
            found.add(node.module or "")
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if _path_of(f"{node.module}.{a.name}").exists())
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("basin_pipeline"))
    return found - {"basin_pipeline"}


def closure(module: str) -> set[str]:
    seen, todo = {module}, [module]
    while todo:
        for imported in _imports(todo.pop()) - seen:
            seen.add(imported)
            todo.append(imported)
    return seen


def test_every_stage_depends_on_the_pipeline_modules_it_imports() -> None:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    missing = []
    for name, stage in stages.items():
        command = re.search(r"python -m (basin_pipeline\.\w+)", stage["cmd"])
        if command is None or stage.get("always_changed"):
            continue
        deps = [d if isinstance(d, str) else next(iter(d)) for d in stage.get("deps", [])]
        for module in sorted(closure(command.group(1)) - EXEMPT):
            path = _path_of(module).relative_to(ROOT).as_posix().removesuffix("/__init__.py")
            if not any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps):
                missing.append(f"{name}: {path}")
    assert not missing, "dvc.yaml stages missing a dep on code they import:\n" + "\n".join(missing)


def test_the_check_follows_imports_through_modules() -> None:
    assert {"basin_pipeline.trained", "basin_pipeline.featurize"} <= closure("basin_pipeline.export")

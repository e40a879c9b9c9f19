"""The policy core is pure: importing it loads no I/O, clock, HTTP, ML or numeric stack.

Each check runs in a fresh interpreter. A bare interpreter already loads some modules (`time` among
them, through site start-up), so the test compares against that baseline and asserts what the
policy *adds*: only stdlib modules and `basin_runtime` itself, and none of the forbidden ones.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("asyncio", "http", "httpx", "starlette", "onnxruntime", "time", "numpy", "sklearn", "pandas")
PRINT_MODULES = "import sys; print('\\n'.join(sorted(sys.modules)))"


def modules_after(statement: str) -> set[str]:
    """The modules loaded in a fresh interpreter after running `statement`."""
    result = subprocess.run(
        [sys.executable, "-c", f"{statement}\n{PRINT_MODULES}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return set(result.stdout.split())


def added_by(statement: str) -> set[str]:
    return modules_after(statement) - modules_after("pass")


def forbidden_in(modules: set[str]) -> set[str]:
    return {m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}


def test_importing_the_policy_adds_no_forbidden_module() -> None:
    added = added_by("import basin_runtime.policy")
    assert "basin_runtime.policy.core" in added  # the import really happened
    assert forbidden_in(added) == set()


def test_the_policy_needs_only_the_standard_library() -> None:
    added = added_by("import basin_runtime.policy")
    outside = {m for m in added if m.split(".")[0] not in sys.stdlib_module_names | {"basin_runtime"}}
    assert outside == set()


@pytest.mark.parametrize("module", ["asyncio", "http.client", "json"])
def test_the_check_sees_what_an_import_adds(module: str) -> None:
    added = added_by(f"import {module}")
    assert module in added
    assert (forbidden_in(added) != set()) == (module != "json")

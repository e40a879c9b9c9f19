"""basin_runtime's modules say their rules in their docstrings (so `help()` shows them), never in a comment
block above it; the gateway package's docstring lists every module of the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import basin_runtime.gateway

ROOT = Path(__file__).resolve().parents[2] / "basin_runtime"
MODULES = sorted(p for p in ROOT.rglob("*.py") if "policy" not in p.relative_to(ROOT).parts)


def test_every_module_opens_with_its_docstring_not_a_comment_block() -> None:
    wrong = []
    for path in MODULES:
        text = path.read_text(encoding="utf-8")
        if text.startswith("#") or not ast.get_docstring(ast.parse(text)):
            wrong.append(str(path.relative_to(ROOT.parent)))
    assert not wrong, f"modules without a docstring, or with a comment block above it: {wrong}"


def test_the_gateway_package_lists_every_module() -> None:
    doc = basin_runtime.gateway.__doc__ or ""
    listed = set(re.findall(r"^\s+(\w+\.py)\s", doc, re.MULTILINE)) | set(re.findall(r"`(__main__\.py)`", doc))
    present = {p.name for p in (ROOT / "gateway").glob("*.py")} - {"__init__.py"}
    assert listed == present, f"listed but absent: {sorted(listed - present)}; absent from the list: " \
                              f"{sorted(present - listed)}"

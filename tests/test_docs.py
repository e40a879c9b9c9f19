"""The README's and the docs site's result tables are what their JSON gives (basin_pipeline.render_results)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def renderer() -> ModuleType:
    return importlib.import_module("basin_pipeline.render_results")


def test_every_generated_block_in_the_readme_and_docs_is_what_its_json_gives() -> None:
    done = subprocess.run([sys.executable, "-m", "basin_pipeline.render_results", "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_hand_edited_block_is_rewritten_and_an_unknown_block_is_refused() -> None:
    render_results = renderer()
    where = ROOT / "README.md"
    fresh = render_results.render(where.read_text(), where)
    edited = fresh.replace("| Basin / Continuum there", "| Basin / Continuum there (typed by hand: 1.30)", 1)
    assert edited != fresh
    assert render_results.render(edited, where) == fresh
    with pytest.raises(render_results.RenderError, match="'made-up' names no renderer"):
        render_results.render("<!-- generated: made-up -->\n<!-- /generated -->\n", where)


def test_the_readme_stays_a_short_page_and_every_page_it_links_exists() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for link in [part.split(")")[0] for part in text.split("](")[1:]]:
        assert (ROOT / link).exists(), f"README.md links {link}, which does not exist"

"""Opening trajectory files, gzipped or not, and finding them in folders."""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from pathlib import Path
from typing import IO


def open_text(path: Path) -> IO[str]:
    """Open a text file, transparently gunzipping `*.gz`."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def find_files(sources: Iterable[Path], endings: tuple[str, ...]) -> list[Path]:
    """Files named on the command line, plus files with a known ending inside named folders (sorted)."""
    found: list[Path] = []
    for src in sources:
        if src.is_dir():
            found.extend(sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(endings)))
        elif src.is_file():
            found.append(src)
        else:
            raise FileNotFoundError(f"{src}: no such file or folder")
    return found

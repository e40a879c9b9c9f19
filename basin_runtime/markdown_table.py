"""Markdown tables for reports and generated pages: the one renderer.

Rules:
- A table is its head row, its rule row, then one line per row, joined by newlines (no newline after
  the last). The caller formats and escapes each cell; the renderer adds no escaping.
- A cell is written between pipes with one space on each side (`| text |`, an empty string `|  |`);
  None is a cell with nothing in it at all (`| |`: the untitled label column of a side-by-side table).
- `markdown_row` writes one row alone, for a table printed as its rows come (head: a table of no rows).
- The rule row holds `rule` per column: " --- " (`| --- | --- |`), or "---" (`|---|---|`, the ingest
  report's, whose bytes DVC tracks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Cell = str | None


def markdown_table(head: Sequence[Cell], rows: Iterable[Sequence[Cell]], rule: str = " --- ") -> str:
    """The table's text (see the rules above)."""
    lines = [markdown_row(head), "|" + f"{rule}|" * len(head)]
    lines += [markdown_row(row) for row in rows]
    return "\n".join(lines)


def markdown_row(cells: Sequence[Cell]) -> str:
    """One row's line (see the rules above)."""
    return "|" + "".join(" |" if cell is None else f" {cell} |" for cell in cells)

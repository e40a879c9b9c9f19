"""The one Markdown table renderer (`basin_runtime/markdown_table.py`)."""

from __future__ import annotations

from basin_runtime.markdown_table import markdown_row, markdown_table


def test_a_table_is_its_head_its_rule_and_one_line_per_row() -> None:
    assert markdown_table(["a", "b"], [["1", "2"], ["3", "4"]]) == "| a | b |\n| --- | --- |\n| 1 | 2 |\n| 3 | 4 |"


def test_an_empty_cell_is_padded_and_a_none_cell_is_not() -> None:
    assert markdown_table([None, "with", "without"], [["x", "", "1"]]) == \
        "| | with | without |\n| --- | --- | --- |\n| x |  | 1 |"


def test_the_compact_rule_and_a_table_of_no_rows() -> None:
    assert markdown_table(["a", "b"], [], rule="---") == "| a | b |\n|---|---|"


def test_a_row_alone_is_the_line_the_table_writes() -> None:
    assert markdown_row(["q", "1.5"]) == markdown_table(["q", "1.5"], []).splitlines()[0] == "| q | 1.5 |"

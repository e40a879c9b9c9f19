"""The gateway's option reference as Markdown, rendered from the options' declarations (`config.py`).

The committed page `docs/gateway/options.md` is this module's output (`REGENERATE`); a test keeps the two
equal, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from basin_runtime.gateway.config import OPTIONS
from basin_runtime.gateway.options import Declared
from basin_runtime.markdown_table import markdown_table
from basin_runtime.schema import Flag, OneOf

REGENERATE = "python -m basin_runtime.gateway.options_doc --output docs/gateway/options.md"
INTRO = f"""\
# Gateway options

Every option of `basin-gateway` (`python -m basin_runtime.gateway`), from its one declaration on the
fields of `GatewayConfig` (`basin_runtime/gateway/config.py`). Generated: `{REGENERATE}`.

- Each option can be given on the command line or in the config file (`--config FILE`, YAML or JSON, keys
  spelled as the options with `_` or `-`). The command line wins, then the file, then the default.
- A value from either place passes the same check (*Accepts*); a bad one stops start-up with one line
  naming where it came from, the option and the value.
- Paths in the config file are relative to the file; on the command line, to the working directory.
- `model` takes one plain `PATH` (the default model) and any number of `WORKLOAD=PATH` entries (a model
  per workload, chosen by the `X-Basin-Workload` header).
- `policy` exists in the config file only: a mapping of `PolicyConfig` fields
  (`basin_runtime/policy/config.py`) but the budget, checked when the policy is built.
"""
COLUMNS = ("Option", "Flag", "Accepts", "Default", "Unit", "What it does")


def flag_text(declared: Declared) -> str:
    """How the option is written on the command line, or that it has no flag."""
    if declared.flag is None:
        return "(config file only)"
    opt = declared.option
    if opt.cli == "switch" or (isinstance(opt.check, Flag) and opt.cli == "value"):
        return f"`{declared.flag}`"
    if isinstance(opt.check, OneOf):
        metavar = "{" + ",".join(str(choice) for choice in opt.check.choices) + "}"
    else:
        metavar = opt.metavar or ("S" if opt.unit == "s" else declared.name.upper())
    repeat = " (repeat)" if opt.cli == "append" else ""
    words = f" {metavar} ..." if opt.cli == "list" else f" {metavar}"
    return f"`{declared.flag}{words}`{repeat}"


def row(declared: Declared) -> list[str]:
    """One table row: name, flag, accepted values, default, unit, help."""
    default = declared.default_text
    if default is None:
        value = declared.default
        default = "required" if value is dataclasses.MISSING else "false" if value is False else "none"
    return [f"`{declared.name}`", flag_text(declared), declared.option.check.expected, default,
            declared.option.unit, declared.option.help]


def render() -> str:
    """The whole reference page."""
    rows = ([_cell(text) for text in row(declared)] for declared in OPTIONS.values())
    return INTRO + "\n" + markdown_table(COLUMNS, rows) + "\n"


def _cell(text: str) -> str:
    """Text safe in a Markdown table cell (a pipe ends the cell; `<stem>` would be read as HTML)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or write it to `--output`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, metavar="FILE", help="write the page here (default: stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

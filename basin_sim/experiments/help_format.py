"""The help formatter of every `basin-sim` parser: text as written, and each option's default after its help."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (examples keep their lines); each option's default after its help,
    unless it has none to show (None, off) or its help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        shown = " ".join(map(str, action.default)) if isinstance(action.default, list | tuple) else "%(default)s"
        return f"{text} (default: {shown})"

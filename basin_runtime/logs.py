"""Logging set-up for every command-line entry point: one function, called only from a `main`.

Rules:
- Library code logs through `logging.getLogger(__name__)` and never configures logging.
- A CLI's `main` calls `configure_logging` once: the root logger at `level` (a number, or a name such as
  "info" in any case), one `line` per record on stderr (`logging.basicConfig`: a root logger that already
  has handlers, as under pytest, is left as it is).
- Lines: `LINE` (level, logger, message) for batch tools; `TIMED_LINE` (the same after the time) for
  servers, whose logs are read against other logs; `BARE_LINE` (the message alone) for a report written
  through logging.
- Chatty libraries named in `quiet` (HTTP clients, MLflow) log at WARNING, unless `level` is DEBUG.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

LINE = "%(levelname)s %(name)s: %(message)s"
TIMED_LINE = "%(asctime)s " + LINE
BARE_LINE = "%(message)s"


def configure_logging(level: int | str = logging.INFO, line: str = LINE, quiet: Iterable[str] = ()) -> None:
    """Set up the root logger for a CLI (see the rules above)."""
    named = level.upper() if isinstance(level, str) else level
    logging.basicConfig(level=named, format=line)
    number = logging.getLevelName(named) if isinstance(named, str) else named
    for name in quiet:
        logging.getLogger(name).setLevel(number if number == logging.DEBUG else logging.WARNING)


def quiet_level(is_quiet: bool) -> int:
    """A batch CLI's level: WARNING with `--quiet`, else INFO."""
    return logging.WARNING if is_quiet else logging.INFO

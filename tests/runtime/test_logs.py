"""The one logging set-up every CLI calls (`basin_runtime/logs.py`), run in a fresh interpreter (pytest owns the
root logger here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys
from basin_runtime.logs import {line}, configure_logging
configure_logging({level!r}, {line}, ["chatty"])
logging.getLogger("basin.x").info("info line")
logging.getLogger("basin.x").debug("debug line")
logging.getLogger("chatty").info("chatty info")
print(logging.getLogger().level, logging.getLogger("chatty").level)
"""


def _run(level: object, line: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(level=level, line=line)], capture_output=True,
                          text=True, check=True)
    return done.stdout, done.stderr


def test_a_batch_cli_logs_level_logger_and_message_and_quiets_chatty_loggers() -> None:
    out, err = _run(20, "LINE")
    assert err == "INFO basin.x: info line\n"
    assert out.split() == ["20", "30"]


@pytest.mark.parametrize("name", ["debug", "DEBUG"])
def test_a_level_name_in_any_case_and_debug_lets_the_chatty_loggers_speak(name: str) -> None:
    out, err = _run(name, "BARE_LINE")
    assert err == "info line\ndebug line\nchatty info\n"
    assert out.split() == ["10", "10"]


def test_a_server_line_starts_with_the_time() -> None:
    _, err = _run("warning", "TIMED_LINE")
    assert err == ""
    _, err = _run("info", "TIMED_LINE")
    date, time, rest = err.split(" ", 2)
    assert len(date) == 10 and time[2] == ":" and rest == "INFO basin.x: info line\n"

"""Trajectory formats ingest can read, from a small registry: name -> reader of one file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from basin_pipeline.adapters.gateway_log import read_gateway_log
from basin_pipeline.adapters.messages_jsonl import read_messages_jsonl
from basin_pipeline.adapters.mini_swe_agent import read_mini_swe_agent
from basin_pipeline.records import RawSession, Reject
from basin_runtime.session_table import Session

Reader = Callable[[Path, str], Iterator[RawSession | Session | Reject]]

FORMATS: dict[str, tuple[Reader, tuple[str, ...]]] = {
    # name: (reader, file name endings it reads in a folder)
    "mini-swe-agent": (read_mini_swe_agent, (".traj.json", ".traj.json.gz")),
    "messages-jsonl": (read_messages_jsonl, (".jsonl", ".jsonl.gz")),
    "gateway-log": (read_gateway_log, (".jsonl", ".jsonl.gz")),
}


def format_names() -> list[str]:
    return sorted(FORMATS)

"""Turning a raw conversation into a session-table row, counted in the serving model's tokens."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from basin_pipeline.adapters import FORMATS
from basin_pipeline.adapters.files import find_files
from basin_pipeline.records import RawSession, Reject
from basin_runtime.session_table import Call, Session
from basin_runtime.task_text import TaskTextError, TaskTextRule, extract_task_text
from basin_runtime.tokenizer import ChatTokenizer, TokenizerError


@dataclass(frozen=True)
class Corpus:
    """Files of one format, all of one benchmark (a gateway log: the benchmark of records without a workload)."""

    benchmark: str
    format: str
    sources: tuple[Path, ...]


@dataclass
class IngestResult:
    """Sessions read and inputs rejected (with their reasons)."""

    sessions: list[Session] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)

    @property
    def reject_fraction(self) -> float:
        total = len(self.sessions) + len(self.rejects)
        return len(self.rejects) / total if total else 0.0


def build_session(raw: RawSession, benchmark: str, tokenizer: ChatTokenizer, rule: TaskTextRule) -> Session:
    """Count every call of a raw conversation (raises ValueError with the reason if it cannot)."""
    roles = {m.get("role") for m in raw.messages}
    if "user" not in roles:
        raise ValueError("the conversation has no user message")
    if "assistant" not in roles:
        raise ValueError("the conversation has no assistant message (no model call)")
    counted = tokenizer.call_tokens(raw.messages, raw.tools)
    calls = tuple(
        Call(
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            cached_tokens=usage.cached_tokens if usage else None,
            recorded_prompt_tokens=usage.prompt_tokens if usage else None,
            gap_s=gap,
        )
        for c, usage, gap in zip(counted, raw.usage, raw.gaps_s, strict=True)
    )
    return Session(
        session_id=raw.session_id,
        benchmark=benchmark,
        source=raw.source,
        agent=raw.agent,
        model=raw.model,
        task_id=raw.task_id,
        task_text=extract_task_text(raw.messages, rule),
        task_description=raw.task_description,
        tokenizer=tokenizer.name,
        calls=calls,
        resolved=raw.resolved,
    )


def _read_corpus(corpus: Corpus) -> Iterator[tuple[str, RawSession | Session | Reject]]:
    if corpus.format not in FORMATS:
        raise ValueError(f"unknown format {corpus.format!r}; known: {', '.join(sorted(FORMATS))}")
    reader, endings = FORMATS[corpus.format]
    for src in corpus.sources:
        files = find_files([src], endings)
        if not files:
            yield str(src), Reject(str(src), 0, f"no {corpus.format} files ({', '.join(endings)}) found here")
        for path in files:
            for item in reader(path, src.name):
                yield str(path), item


def ingest(
    corpora: Iterable[Corpus], tokenizer: ChatTokenizer, rule: TaskTextRule, show_progress: bool = True
) -> IngestResult:
    """Read corpora into sessions; every input ends as a session or a reject, and ids stay unique."""
    result = IngestResult()
    seen: dict[str, str] = {}
    for corpus in corpora:
        items = tqdm(_read_corpus(corpus), desc=f"ingest {corpus.benchmark}", unit=" sessions",
                     disable=not show_progress, mininterval=0.5 if sys.stderr.isatty() else 5.0)
        for path, item in items:
            if isinstance(item, Reject):
                result.rejects.append(item)
                continue
            try:
                session = _to_session(item, corpus.benchmark, tokenizer, rule)
            except (ValueError, TypeError, TaskTextError, TokenizerError) as exc:
                result.rejects.append(_reject_at(item, path, str(exc)))
                continue
            if session.session_id in seen:
                result.rejects.append(_reject_at(item, path, f"duplicate session_id {session.session_id!r} "
                                                       f"(first read from {seen[session.session_id]})"))
                continue
            seen[session.session_id] = _origin(item, path)
            result.sessions.append(session)
    return result


def _to_session(item: RawSession | Session, benchmark: str, tokenizer: ChatTokenizer, rule: TaskTextRule) -> Session:
    if isinstance(item, Session):
        if item.tokenizer != tokenizer.name:
            raise ValueError(f"counted with tokenizer {item.tokenizer!r}, this run uses {tokenizer.name!r}")
        # Already counted (a gateway log): its own benchmark (the record's workload) wins over the corpus's.
        return dataclasses.replace(item, benchmark=item.benchmark or benchmark)
    return build_session(item, benchmark, tokenizer, rule)


def _origin(item: RawSession | Session, path: str) -> str:
    return item.origin if isinstance(item, RawSession) else path


def _reject_at(item: RawSession | Session, path: str, reason: str) -> Reject:
    origin = _origin(item, path)
    file, sep, line = origin.rpartition(":")
    if sep and line.isdigit():
        return Reject(file, int(line), reason)
    return Reject(origin, 0, reason)

"""The durable, rotating session-log writer (a thread fed by a queue).

Rules:
- `append` never blocks the event loop: it only puts the record on an in-memory queue (bounded;
  when full the record is dropped with a warning and counted in `num_dropped`). One writer thread
  turns records into lines, appends them, flushes and `fsync`s after each batch it drains. A batch
  is what arrived within `BATCH_WAIT_S` of its first record (a stop request ends the wait at once),
  so under load the file is opened, checked and synced a few times a second, not once per session.
- Rotation: when the live file (`path`) would pass `max_bytes`, it is renamed to
  `<stem>-<UTC time>-<seq><suffix>` beside it and a new one is started. Retention: at most
  `keep_files` rotated files are kept; the oldest are deleted. Every file ends in `.jsonl`, so
  `python -m basin_pipeline.ingest --format gateway-log DIR` reads the whole folder.
- Text-free (`keep_text=False`): the task text is not written (`task_text: null`); its length
  (`task_chars`) and every token count are. Ingest rejects such records for text models, by name.
- `close()` writes what is queued, then stops the thread; appends after it raise.
- Lines are encoded by orjson (the line `SessionLogRecord.to_json` writes, read back the same).
- A record that cannot be written (it does not encode as JSON/UTF-8) is skipped with an error log
  line naming the session and counted in `num_failed`; the thread goes on with the next one. No
  exception ends the writer thread: it logs, counts the batch as failed and keeps serving.
- Files hold users' task texts: the folder is created 0700 and every file 0600 (owner only).
- A live file whose last line is torn (a crash mid-append) gets a newline before the next record,
  so the torn line stays one bad line and never swallows the next record.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import orjson

from basin_runtime.session_log import SessionLogRecord

logger = logging.getLogger(__name__)
_STOP = object()
BATCH_WAIT_S = 0.05


class SessionLogWriter:
    """Appends finished sessions to a JSONL file off the event loop, rotating and pruning it."""

    def __init__(self, path: Path, *, max_bytes: int = 256 << 20, keep_files: int = 20, keep_text: bool = False,
                 max_queued: int = 100_000) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep_files = keep_files
        self.keep_text = keep_text
        self.num_written = 0
        self.num_dropped = 0
        self.num_failed = 0  # records that could not be encoded or written
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued)
        self._wake = threading.Event()  # set by `close`: a batch being gathered is written at once
        self._is_closed = False
        self._seq = 0
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="basin-session-log", daemon=True)
        self._thread.start()

    def append(self, record: SessionLogRecord) -> None:
        """Queue one finished session for writing (returns at once)."""
        if self._is_closed:
            raise RuntimeError(f"the session log {self.path} is closed")
        if not self.keep_text:
            record = replace(record, task_text=None)
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("session log %s: queue full, session %s not logged", self.path, record.session_id)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued record is on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued and stop the writer thread."""
        if self._is_closed:
            return
        self._is_closed = True
        self._queue.put(_STOP)
        self._wake.set()
        self._thread.join(timeout_s)

    def rotated_files(self) -> list[Path]:
        """The rotated files beside the live one, oldest first."""
        pattern = f"{self.path.stem}-*{self.path.suffix}"
        return sorted(p for p in self.path.parent.glob(pattern) if p != self.path)

    def _run(self) -> None:
        is_stopping = False
        while not is_stopping:
            items = [self._queue.get()]
            if items[0] is not _STOP:
                self._wake.wait(BATCH_WAIT_S)
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            records = [r for r in items if isinstance(r, SessionLogRecord)]
            is_stopping = any(r is _STOP for r in items)
            try:
                self._write(records)
            except Exception:  # the writer must outlive any failure, and say so
                self.num_failed += len(records)
                logger.exception("session log %s: writing %d sessions failed", self.path, len(records))
            finally:
                for _ in items:
                    self._queue.task_done()

    def _write(self, records: list[SessionLogRecord]) -> None:
        if not records:
            return
        size = self.path.stat().st_size if self.path.exists() else 0
        handle = self._open()
        if size > 0 and not self._ends_with_newline():
            handle.write(b"\n")  # a torn last line stays a line of its own
            size += 1
        try:
            for record in records:
                try:
                    line = orjson.dumps(record.to_object(), option=orjson.OPT_APPEND_NEWLINE)
                except (ValueError, TypeError) as exc:  # orjson's JSONEncodeError is a TypeError
                    self.num_failed += 1
                    logger.error("session log %s: session %r not logged, its record does not encode: %s",
                                 self.path, record.session_id, exc)
                    continue
                if size > 0 and size + len(line) > self.max_bytes:
                    handle.flush()
                    os.fsync(handle.fileno())
                    handle.close()
                    self._rotate()
                    handle = self._open()
                    size = 0
                handle.write(line)
                size += len(line)
                self.num_written += 1
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            handle.close()

    def _open(self) -> BinaryIO:
        """The live file for appending, created owner-only (0600)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return os.fdopen(fd, "ab")

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as handle:
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) == b"\n"

    def _rotate(self) -> None:
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.path.with_name(f"{self.path.stem}-{stamp}-{self._seq:06d}{self.path.suffix}")
        os.replace(self.path, target)
        rotated = self.rotated_files()
        for old in rotated[:max(0, len(rotated) - self.keep_files)]:
            old.unlink(missing_ok=True)
        logger.info("session log rotated to %s", target)

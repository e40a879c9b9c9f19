# Surviving a restart: which sessions may skip the queue because they were live before it.
#
# Rules (the adoption rule, stated in the README):
# - A conversation that arrives with history (an assistant turn in its first call seen by this
#   gateway run) is admitted like any other new session: it is predicted, and it waits in the
#   queue when the policy says so. Harness few-shot turns in a first call are therefore harmless,
#   and a fabricated history opens no door around admission.
# - The one exception is proof of a prior session: its id is in the live-sessions file the previous
#   run of this gateway wrote, and it arrives within `adoption_window_s` of this run's start. Such a
#   session is adopted (it never waits: it was admitted before the restart and its context is in the
#   cache). Each listed id is adopted at most once; a call without history under a listed id is a new
#   session (a new run of the task), and takes the id off the list.
# - The file is written atomically (temporary file, fsync, rename; 0600 in a 0700 folder) when the
#   set of live sessions changed, at most every `interval_s`, and at shutdown after the drain, from
#   a worker thread. A run killed with -9 leaves the last periodic write: sessions admitted in its
#   last interval are not on it, and are admitted again like any other.
# - A missing file is an empty list; an unreadable or malformed one is logged and treated as empty
#   (a bad file must not stop the gateway from starting, and adopting nobody is the safe side).
"""The live-sessions file and the restart-adoption rule."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_FORMAT = "basin-live-sessions"
FILE_VERSION = 1


class LiveSessionsFile:
    """The ids of the sessions a gateway run holds, kept on disk for the next run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: frozenset[str] | None = None

    def read(self) -> frozenset[str]:
        """The ids the previous run left (empty if there is no usable file)."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return frozenset()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning("live-sessions file %s is unreadable, no session will be adopted: %s", self.path, exc)
            return frozenset()
        ids = raw.get("sessions") if isinstance(raw, dict) and raw.get("format") == FILE_FORMAT else None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            logger.warning("live-sessions file %s is not a %s file, no session will be adopted", self.path,
                           FILE_FORMAT)
            return frozenset()
        return frozenset(ids)

    def is_unchanged(self, session_ids: frozenset[str]) -> bool:
        """True if these are the ids last written (nothing to do, no thread hop needed)."""
        return session_ids == self._written

    def write(self, session_ids: Iterable[str]) -> bool:
        """Write the ids if they changed since the last write; True if the file was written."""
        ids = frozenset(session_ids)
        if self.is_unchanged(ids):
            return False
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        data = json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "sessions": sorted(ids)},
                          ensure_ascii=False).encode("utf-8")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        self._written = ids
        return True


class Adoption:
    """Decides whether a conversation that arrives with history is a session from before the restart."""

    def __init__(self, previous_ids: Iterable[str], started_s: float, window_s: float) -> None:
        self._ids = set(previous_ids)
        self._until_s = started_s + window_s
        self.window_s = window_s

    def __len__(self) -> int:
        return len(self._ids)

    def claim(self, session_id: str, has_history: bool, now: float) -> bool:
        """True if this first call (in this run) of `session_id` resumes a session of the previous run."""
        if session_id not in self._ids:
            return False
        self._ids.discard(session_id)  # once: a listed id is adopted, or starts anew, at most once
        return has_history and now <= self._until_s

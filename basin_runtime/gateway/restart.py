"""The live-sessions file and the restart-adoption rule.

Surviving a restart: which sessions may skip the queue because they were live before it, and what the next run
needs to log them whole.

Rules (the adoption rule, stated in the README):
- A conversation that arrives with history (an assistant turn in its first call seen by this
  gateway run) is admitted like any other new session: it is predicted, and it waits in the
  queue when the policy says so. Harness few-shot turns in a first call are therefore harmless,
  and a fabricated history opens no door around admission.
- The one exception is proof of a prior session: the previous run of this gateway listed it as live, with the
  digest of the conversation it last saw (`prefix_digest`: its messages' digests, `measure.py`), and it comes
  back within `adoption_window_s` of this run's start with history whose first messages are that conversation,
  unchanged, and with the API key it came with (`key_digest`, if it came with one; its id alone proves nothing:
  ids are often guessable). Such a session is adopted: it is live at once and reserves what it held before the
  restart (its last context listed), and its resumed call is then observed like any later call, so one that brings
  more than that reservation is re-reserved and waits when it does not fit (the core's outgrowth rule). Each listed
  id is adopted at most once; a call under a listed id that does not continue its conversation leaves the listed
  entry alone for its owner, and is a session of its own under another id (`identity.py`).
- The file lists, for each live session, what its session-log record holds so far (start, prediction, model,
  workload, task length, the calls that ended), and says whether those records were logged (`is_logged`): a
  graceful shutdown logs every live session as `shutdown` and then writes the file marked logged; the periodic
  writes are not. After a restart that was not graceful (a kill), an adopted session's record starts from the
  previous run's part (`LiveSession.calls`), and calls whose answers its conversation holds but the file had
  not seen yet are added from the conversation (`measure.Meter.unrecorded_calls`), so the session log holds the
  whole session in one record and ingest reads it like any other.
- The file is written atomically (temporary file, fsync, rename; 0600 in a 0700 folder) when the
  live sessions or their calls changed, at most every `interval_s`, and at shutdown after the drain, from a
  worker thread. A run killed with -9 leaves the last periodic write: sessions admitted in its last interval are
  not on it, and are admitted again like any other.
- A missing file is an empty list; an unreadable or malformed one, or one of version 1 (ids only: no
  conversation to tie an id to), is logged and treated as empty (a bad file must not stop the gateway from
  starting, and adopting nobody is the safe side).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from basin_runtime.session_log import LoggedCall

logger = logging.getLogger(__name__)

FILE_FORMAT = "basin-live-sessions"
FILE_VERSION = 2


def prefix_digest(message_digests: Sequence[bytes]) -> str:
    """The digest of a conversation, from its messages' digests (`measure.MemoCounts.keys`)."""
    digest = hashlib.sha256()
    for key in message_digests:
        digest.update(key)
    return digest.hexdigest()


@dataclass(frozen=True)
class LiveSession:
    """What a run knew of one live session: the conversation it last saw and its session-log record so far."""

    prefix_digest: str
    num_messages: int
    started_at: float
    predicted_peak_tokens: float
    reserved_peak_tokens: float
    task_chars: int
    model: str | None
    workload: str | None
    calls: tuple[LoggedCall, ...]
    key_digest: str | None = None  # hex digest of the API key its calls came with (`identity.key_digest`)

    def to_object(self) -> dict[str, Any]:
        """As JSON-ready data."""
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["calls"] = [[getattr(c, f.name) for f in fields(LoggedCall)] for c in self.calls]
        return body

    @classmethod
    def from_object(cls, obj: object) -> LiveSession:
        """From `to_object`'s data; `ValueError` or `TypeError` if it is not that."""
        if not isinstance(obj, Mapping):
            raise TypeError(f"a live session must be an object, got {type(obj).__name__}")
        calls = tuple(LoggedCall(*row) for row in obj["calls"])
        session = cls(**{**obj, "calls": calls})
        if not (isinstance(session.prefix_digest, str) and isinstance(session.num_messages, int)
                and session.num_messages >= 0):
            raise ValueError(f"bad conversation digest or length: {session.prefix_digest!r}, {session.num_messages!r}")
        return session


@dataclass(frozen=True)
class LiveSessions:
    """The contents of a live-sessions file."""

    sessions: Mapping[str, LiveSession]
    is_logged: bool = False  # their records so far are in the session log (a graceful shutdown)


class LiveSessionsFile:
    """The sessions a gateway run holds, kept on disk for the next run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._written: object = None  # the signature of what was last written

    def read(self) -> LiveSessions:
        """What the previous run left (nothing if there is no usable file)."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return LiveSessions({})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning("live-sessions file %s is unreadable, no session will be adopted: %s", self.path, exc)
            return LiveSessions({})
        if not isinstance(raw, dict) or raw.get("format") != FILE_FORMAT or raw.get("version") != FILE_VERSION:
            logger.warning("live-sessions file %s is not a %s file of version %d (one of version 1 lists ids "
                           "without their conversations), no session will be adopted", self.path, FILE_FORMAT,
                           FILE_VERSION)
            return LiveSessions({})
        try:
            sessions = {str(sid): LiveSession.from_object(obj) for sid, obj in raw["sessions"].items()}
            return LiveSessions(sessions, raw["is_logged"] is True)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.warning("live-sessions file %s is malformed, no session will be adopted: %s", self.path, exc)
            return LiveSessions({})

    def is_unchanged(self, signature: object) -> bool:
        """True if what `signature` stands for was the last thing written (nothing to do, no thread hop needed)."""
        return signature == self._written

    def write(self, live: LiveSessions, signature: object = None) -> bool:
        """Write `live` unless `signature` (of its contents) is the last one written; True if the file was written."""
        if signature is not None and self.is_unchanged(signature):
            return False
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        data = json.dumps({"format": FILE_FORMAT, "version": FILE_VERSION, "is_logged": live.is_logged,
                           "sessions": {sid: s.to_object() for sid, s in sorted(live.sessions.items())}},
                          ensure_ascii=False).encode("utf-8")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        self._written = signature
        return True


class Adoption:
    """Decides whether a conversation that arrives with history is a session from before the restart."""

    def __init__(self, previous: LiveSessions, started_s: float, window_s: float) -> None:
        self._sessions = dict(previous.sessions)
        self.is_logged = previous.is_logged
        self._until_s = started_s + window_s
        self.window_s = window_s

    def __len__(self) -> int:
        return len(self._sessions)

    def listed(self, session_id: str, now: float) -> LiveSession | None:
        """The previous run's session listed under this id, while the adoption window lasts (None after it)."""
        if now > self._until_s:
            self._sessions.clear()
            return None
        return self._sessions.get(session_id)

    @staticmethod
    def continues(previous: LiveSession, has_history: bool, message_digests: Sequence[bytes],
                  key: bytes | None) -> bool:
        """Does a first call (in this run) resume `previous`: with history, beginning with the conversation the
        previous run last saw of it, and with the API key it came with?"""
        n = previous.num_messages
        return (has_history and len(message_digests) >= n and prefix_digest(message_digests[:n]) ==
                previous.prefix_digest and previous.key_digest == (None if key is None else key.hex()))

    def take(self, session_id: str) -> LiveSession:
        """Take a listed session off the list to adopt it (once)."""
        return self._sessions.pop(session_id)


@dataclass(frozen=True)
class Restart:
    """What a run carries over from the one before: its live-sessions file (None: none is kept) and the adoption
    the previous run's list allows."""

    file: LiveSessionsFile | None
    adoption: Adoption

    @classmethod
    def begin(cls, file: LiveSessionsFile | None, started_s: float, window_s: float) -> Restart:
        """Read what the previous run left in `file` (nothing without one); adoptable within `window_s` of now."""
        previous = LiveSessions({}) if file is None else file.read()
        if previous.sessions:
            logger.info("%d sessions live before the restart may be adopted within %.0f s (the run before %s)",
                        len(previous.sessions), window_s,
                        "shut down gracefully" if previous.is_logged else "was killed: they are logged whole here")
        return cls(file, Adoption(previous, started_s, window_s))

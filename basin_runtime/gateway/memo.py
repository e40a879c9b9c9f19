"""What a session keeps of its last chat prompt for its next call, as plain values.

Rules:
- `BodyPrefix`: the last body's bytes up to the end of its last message, with what was read of them (the
  top-level fields before `messages`, counts of messages and content parts, whether a system or assistant
  turn was among them). `resend.py` reads a later body that starts with those bytes from there on.
- `MemoCounts`: each message's token count under a digest of the message, and the tools' count, as
  `measure.py` counted them; with the prefix they came from, if any.
- `Resent`: how a call was read after a prefix: the memo counts it repeats and its own prefix.
- Values only (frozen, no I/O, no parsing): `calls.py`, `resend.py` and `measure.py` all import this module
  and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class BodyPrefix:
    """What a session's next call may reuse of this body: its bytes up to `end` (just after its last message)."""

    raw: bytes
    end: int
    head: Mapping[str, Any]  # the top-level fields before `messages`, parsed
    num_messages: int
    has_assistant: bool
    has_system: bool
    num_parts: int = 0  # content parts in its messages (`calls.content_parts`)


@dataclass(frozen=True)
class MemoCounts:
    """One chat prompt's per-message token counts under the messages' digests, and its tools' count."""

    keys: tuple[bytes, ...] = ()
    tokens: tuple[int, ...] = ()
    tools_key: bytes | None = None
    tools_tokens: int = 0
    prefix: BodyPrefix | None = None  # the prompt's body prefix, for reading its session's next call (`resend.py`)


@dataclass(frozen=True)
class Resent:
    """How a resent call was read: the memo counts its unchanged messages came from, and its own prefix."""

    base: MemoCounts  # `base.prefix` is the prefix this body repeats; `base.keys`/`tokens` its messages' counts
    prefix: BodyPrefix  # this body's prefix (for the next call)

    @property
    def num_known(self) -> int:
        """How many leading messages were not read again."""
        assert self.base.prefix is not None
        return self.base.prefix.num_messages

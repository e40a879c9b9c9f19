"""Which conversation a session id names: the binding of an id to its first call (issue 46).

Rules:
- A session id names one conversation. A session's first call binds it to that call's head: for a
  chat call, the digests of its messages up to and including its first user message (its system
  prompt and task, `measure._digest`, the per-message digests the prompt memo keeps); for a
  raw-prompt call, the digest of its first text prompt's first RAW_HEAD_CHARS characters (and their
  number); a call of token ids only has no head. Where the client sent an API key
  (`Authorization`), the id is bound to a digest of it too.
- A later call under the id continues the session only if it keeps that head (its first messages
  unchanged: a harness that compacts or trims later turns still continues) and comes with the same
  key (or none, when none came first). A chat call `resend.py` read after the session's last body's
  byte prefix keeps the head by construction: only its key is compared.
- A call that does not continue the session is foreign: with `--foreign-call new-session` (the
  default) it is a new session of its own, under an id derived from the id, its head and its key
  (`derived_id`: its later calls find it again, and it goes through admission like any first call);
  with `--foreign-call refuse` it gets a JSON 409 `session_id_in_use`. The same holds for an id the
  previous run listed as live (`restart.py`): a call that does not continue the listed conversation
  leaves the listed entry alone.
- Digests are SHA-256 cut to 16 bytes; the key's is salted, so the API key never leaves the process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from basin_runtime.gateway.calls import Call
from basin_runtime.gateway.errors import ForeignCallError
from basin_runtime.gateway.measure import message_digest

ForeignCall = Literal["new-session", "refuse"]
FOREIGN_CALLS: tuple[ForeignCall, ...] = ("new-session", "refuse")
RAW_HEAD_CHARS = 4096  # a raw prompt's head: what the first call's prompt and every later one must begin with
_KEY_SALT = b"basin-session-api-key\x00"


@dataclass(frozen=True)
class Binding:
    """What a session id is bound to: its first call's head and the digest of the API key it came with."""

    head: tuple[bytes, ...]  # chat: the head messages' digests; raw: (the digest of the head's text,)
    head_chars: int  # raw prompts: the head's length in characters (0 for chat and token ids)
    key: bytes | None

    def continues(self, call: Call, key: bytes | None) -> bool:
        """Does `call` (with this key's digest) continue the conversation this binding names?"""
        if key != self.key:
            return False
        if call.resent is not None:  # it repeats the session's last body byte for byte up to its new messages
            return True
        if call.messages is not None:
            n = len(self.head)
            return n > 0 and len(call.messages) >= n and all(
                message_digest(call.messages[k]) == self.head[k] for k in range(n))
        if not call.texts:
            return not self.head  # token ids only: nothing to compare, as long as the first call had none either
        text = call.texts[0]
        return (self.head_chars > 0 and len(text) >= self.head_chars
                and _text_digest(text[:self.head_chars]) == self.head[0])


def binding_of(call: Call, key: bytes | None, head_keys: Sequence[bytes]) -> Binding:
    """The binding a session's first call makes; `head_keys` are its messages' digests (chat; as counted)."""
    if call.messages is not None:
        return Binding(tuple(head_keys[:head_length(call.messages)]), 0, key)
    if not call.texts:
        return Binding((), 0, key)
    head = call.texts[0][:RAW_HEAD_CHARS]
    return Binding((_text_digest(head),), len(head), key)


def head_length(messages: Sequence[Mapping[str, object]]) -> int:
    """How many leading messages make a chat conversation's head: up to its first user message (all, if none)."""
    first_user = next((k for k, m in enumerate(messages) if m.get("role") == "user"), None)
    return len(messages) if first_user is None else first_user + 1


def key_digest(authorization: str | None) -> bytes | None:
    """The salted digest of the client's API key (its `Authorization` header's value), or None if it sent none."""
    value = authorization
    if not value:
        return None
    return hashlib.sha256(_KEY_SALT + value.strip().encode("utf-8", "surrogateescape")).digest()[:16]


def derived_id(session_id: str, binding: Binding) -> str:
    """The id a foreign call's own session goes by: the id it used, with a digest of its head and key."""
    digest = hashlib.sha256(b"".join(binding.head) + b"\x00" + (binding.key or b""))
    digest.update(str(binding.head_chars).encode())
    return f"{session_id}~{digest.hexdigest()[:16]}"


def refuse_foreign(session_id: str, why: str) -> ForeignCallError:
    """The 409 a foreign call gets under `--foreign-call refuse`."""
    return ForeignCallError(f"session id {session_id!r} names another conversation ({why}); send this one under "
                            "an id of its own", session_id)


def _text_digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:16]

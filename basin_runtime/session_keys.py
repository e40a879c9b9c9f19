"""Per-session end keys derived from the gateway's secret, bound to one incarnation of a session.

A session's end key: the narrow permission an agent ends its own session with, apart from the
operator's admin token. Shared by the gateway (which derives, hands out and checks keys) and its
clients (the replayer, the benchmarks: the header name), so it lives in basin_runtime, which clients
may import, not in the gateway package; stdlib only.

Rules:
- A key belongs to one incarnation of a session, not to its id: key = the first 32 hex characters of
  HMAC-SHA256(secret, "basin-session-end:" + run + "/" + incarnation + ":" + id), where the incarnation is
  the policy's record of the session (its sequence number and arrival time, `incarnation`) and `run` a
  nonce drawn at each start of an in-process gateway. So the key of an ended session ends no later session
  with that id, and every key changes when the gateway restarts (a session adopted after it gets a new
  one on its first answer). Replicas sharing one state (`--state`) use no run nonce: the session's record
  is theirs in common, so they derive the same key for it, and a key lives as long as its session.
- The secret is the admin token when one is configured, else 32 random bytes drawn once per process.
- The gateway hands a session its key in SESSION_KEY_HEADER on the first answer it forwards for it
  (`gateway/gateway.py`), not on every answer: anyone who knows a session's id can send a call under it,
  and must not get the key that way while the session is held.
- A key opens `POST /basin/sessions/{id}/end` of its own session and nothing else (`gateway/app.py`);
  it is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SESSION_KEY_HEADER = "X-Basin-Session-Key"
KEY_CHARS = 32
_PROCESS_SECRET = secrets.token_bytes(32)  # used while no admin token is configured
_PURPOSE = "basin-session-end:"


def incarnation(seq: int, arrival_s: float) -> str:
    """One incarnation of a session: its policy record's sequence number and arrival time."""
    return f"{seq}/{arrival_s!r}"


class SessionKeys:
    """Derives and checks session end keys (`run`: this start's nonce; None draws one, "" for shared replicas)."""

    def __init__(self, admin_token: str | None = None, *, run: str | None = None) -> None:
        self._secret = _PROCESS_SECRET if admin_token is None else admin_token.encode("utf-8")
        self.run = secrets.token_hex(16) if run is None else run

    def key(self, session_id: str, of: str) -> str:
        """The end key of incarnation `of` of `session_id`."""
        message = f"{_PURPOSE}{self.run}/{of}:{session_id}".encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:KEY_CHARS]

    def is_key_of(self, session_id: str, of: str, key: str) -> bool:
        """True if `key` is the end key of incarnation `of` of `session_id` (constant-time)."""
        return hmac.compare_digest(key.strip().encode("utf-8", "surrogatepass"), self.key(session_id, of).encode())

# A session's end key: the narrow permission an agent ends its own session with, apart from the
# operator's admin token. Shared by the gateway (which derives, hands out and checks keys) and its
# clients (the replayer, the benchmarks: the header name), so it lives in basin_runtime, which clients
# may import, not in the gateway package; stdlib only.
#
# Rules:
# - key(session id) = the first 32 hex characters of HMAC-SHA256(secret, "basin-session-end:" + id).
#   The secret is the admin token when one is configured (replicas sharing a token derive the same
#   keys, and a key outlives a restart), else 32 random bytes drawn once per process.
# - The gateway hands a session its key in SESSION_KEY_HEADER on the first answer it forwards for it
#   (`gateway/gateway.py`), not on every answer: anyone who knows a session's id can send a call under it,
#   and must not get the key that way while the session is held.
# - A key opens `POST /basin/sessions/{id}/end` of its own session and nothing else (`gateway/app.py`);
#   it is compared in constant time.
"""Per-session end keys derived from the gateway's secret."""

from __future__ import annotations

import hashlib
import hmac
import secrets

SESSION_KEY_HEADER = "X-Basin-Session-Key"
KEY_CHARS = 32
_PROCESS_SECRET = secrets.token_bytes(32)  # used while no admin token is configured
_PURPOSE = "basin-session-end:"


class SessionKeys:
    """Derives and checks session end keys."""

    def __init__(self, admin_token: str | None = None) -> None:
        self._secret = _PROCESS_SECRET if admin_token is None else admin_token.encode("utf-8")

    def key(self, session_id: str) -> str:
        """The end key of `session_id`."""
        message = (_PURPOSE + session_id).encode("utf-8", "surrogatepass")
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:KEY_CHARS]

    def is_key_of(self, session_id: str, key: str) -> bool:
        """True if `key` is the end key of `session_id` (constant-time)."""
        return hmac.compare_digest(key.strip().encode("utf-8", "surrogatepass"), self.key(session_id).encode())

"""Session identity, per-session records, and the session registry.

Rules:
- Identity, first match wins: the session header (`X-Session-ID` by default); the body's `user`
  field; a stable hash of the conversation's first messages (its first system message, if any,
  and its first user message). A raw-prompt call (`/v1/completions`, `/generate`) with neither
  header nor `user` has nothing stable to hash: it is a session of its own, ended with its call.
  Two runs of the same task at once hash alike and share a session: give such clients a header.
  A header or `user` id is bounded in length and characters (`limits.checked_session_id`).
- The registry holds exactly the sessions the policy holds (live or queued), under the same ids;
  an ended, withdrawn or shed session is removed, and its id is then unknown again.
- A session is idle when it is live, has no call in flight, and its last call ended (or started)
  at least the idle timeout ago.
- Each session keeps its calls (`CallRecord`), what the session log (issue 6) is written from.
- The registry keeps the ranking of every session the policy holds by its fixed Basin priority
  (`priority.PriorityLevels`, fed by the waiting room as policy steps apply): the engine priority a
  call carries is the session's bucketed rank at that moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # the C escaper json.dumps uses
from typing import Literal, TypeAlias

from basin_runtime.gateway.calls import Call
from basin_runtime.gateway.identity import Binding
from basin_runtime.gateway.limits import DEFAULT_MAX_SESSION_ID_CHARS, checked_session_id
from basin_runtime.gateway.measure import PromptMemo
from basin_runtime.gateway.priority import PriorityLevels
from basin_runtime.gateway.restart import LiveSession
from basin_runtime.messages import message_text
from basin_runtime.policy import HeldState, Shed
from basin_runtime.session_log import LoggedCall

Verdict: TypeAlias = Literal["admitted", "ended", "shutdown"] | Shed
CallOutcome = Literal["completed", "rejected", "client_gone", "upstream_error", "gateway_error"]


_HASH_SLICE_CHARS = 1 << 20


def session_id_for(call: Call, named: str, header_name: str,
                   max_chars: int = DEFAULT_MAX_SESSION_ID_CHARS) -> tuple[str, bool]:
    """(session id, is a single-call session) by header (`named`: its value, "" without one), then `user`, then
    the conversation's hash.

    An id too long or of characters it may not hold is refused (`limits.checked_session_id`: a 400
    naming where it came from).
    """
    value = named.strip()
    if value:
        return checked_session_id(value, f"the {header_name} header", max_chars, is_header=True), False
    if call.user is not None:
        return checked_session_id(call.user, "the `user` field", max_chars, is_header=False), False
    if call.messages is None:
        return f"call-{uuid.uuid4().hex}", True
    system = next((m for m in call.messages if m.get("role") == "system"), None)
    user = next((m for m in call.messages if m.get("role") == "user"), None)
    head = [message_text(m.get("content")) if m is not None else None for m in (system, user)]
    return f"conv-{_head_digest(head)[:24]}", False


def _head_digest(head: list[str | None]) -> str:
    """sha256 of `json.dumps(head, ensure_ascii=False)` in UTF-8, fed slice by slice.

    JSON escapes each character on its own, so the slices' escapes join into the whole text's; no
    single C call then holds the GIL for long on a huge first message (a 23 MB one took ~100 ms).
    """
    digest = hashlib.sha256(b"[")
    for k, text in enumerate(head):
        digest.update(b", " if k else b"")
        if text is None:
            digest.update(b"null")
            continue
        digest.update(b'"')
        for start in range(0, len(text), _HASH_SLICE_CHARS):
            digest.update(encode_basestring(text[start:start + _HASH_SLICE_CHARS])[1:-1].encode("utf-8"))
        digest.update(b'"')
    digest.update(b"]")
    return digest.hexdigest()


@dataclass
class CallRecord:
    """One call forwarded for a session (token counts are the serving tokenizer's)."""

    started_at: float  # unix seconds
    prompt_tokens: int
    rid: str | None
    is_stream: bool
    ended_at: float | None = None
    status_code: int | None = None
    outcome: CallOutcome | None = None
    served_by: str | None = None  # the worker that answered, as the router names it (the decode worker in PD)
    completion_tokens: int | None = None  # from the upstream's usage (issue 6)
    cached_tokens: int | None = None  # from the upstream's usage (issue 6)
    engine_priority: int | None = None  # the priority value the call carried


@dataclass
class SessionEntry:
    """What the gateway keeps about one live or queued session."""

    session_id: str
    state: HeldState  # the policy's vocabulary (`basin_runtime/policy/lifecycle.py`), moved through its table
    decision: asyncio.Future[Verdict]  # resolved once: admitted, shed or ended while queued
    priority_s: float  # Basin's fixed priority (seconds, smaller first); engines get its bucketed rank
    routing_key: str  # `priority.routing_key(session_id)`: sticky routing and rids
    predicted_peak_tokens: float
    task_text: str
    workload: str | None
    started_at: float  # unix seconds
    last_active_s: float  # gateway clock
    memo: PromptMemo
    is_adopted: bool = False
    is_single_call: bool = False
    arrived_s: float = 0.0  # gateway clock
    model: str | None = None  # the first call's `model` field (the session log keeps it)
    calls: list[CallRecord] = field(default_factory=list)
    in_flight: int = 0
    waiters: int = 0
    has_sent_key: bool = False  # its end key went out on an answer (`basin_runtime/session_keys.py`)
    is_held_for_growth: bool = False  # queued again: a call outgrew its reservation while admission was engaged
    binding: Binding | None = None  # the conversation its id names (`identity.py`); None: not bound yet
    reservation_multiplier: float = 1.0  # m(q) of its predictor file (m_k(q) after a revision at call k)
    revised_peak_tokens: float | None = None  # the last online re-estimate, if any
    recovery_hold: asyncio.Future[Verdict] | None = None  # held by recovery (`recovery_holds.py`) until resolved
    is_engine_session_closed: bool = False  # closed on the engines for its current recovery hold
    context_tokens: int = 0  # its latest prompt size told to the policy (its context)
    # adopted after a run that was killed: that run's part of its record, and calls only its conversation shows
    earlier: LiveSession | None = None
    unrecorded_calls: tuple[LoggedCall, ...] = ()

    @property
    def reserved_peak_tokens(self) -> float:
        """What its prediction reserves: m x the predicted (or last revised) peak."""
        peak = self.predicted_peak_tokens if self.revised_peak_tokens is None else self.revised_peak_tokens
        return self.reservation_multiplier * peak

    @property
    def reserved_tokens(self) -> int:
        """What it reserves now, as the policy counts it: max(ceil(m x peak), its context), never below its context."""
        return max(math.ceil(self.reserved_peak_tokens), self.context_tokens)

    def is_idle(self, now: float, idle_timeout_s: float) -> bool:
        """Live, nothing in flight, and quiet for at least the idle timeout."""
        return self.state == "live" and self.in_flight == 0 and now - self.last_active_s >= idle_timeout_s


class SessionRegistry:
    """The live and queued sessions by id."""

    def __init__(self, levels: PriorityLevels | None = None) -> None:
        self._entries: dict[str, SessionEntry] = {}
        self.levels = levels or PriorityLevels()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[SessionEntry]:
        return iter(list(self._entries.values()))

    def get(self, session_id: str) -> SessionEntry | None:
        """The session with this id, or None."""
        return self._entries.get(session_id)

    def add(self, entry: SessionEntry) -> None:
        """Register a session the policy now holds."""
        assert entry.session_id not in self._entries, entry.session_id
        self._entries[entry.session_id] = entry

    def remove(self, session_id: str) -> SessionEntry | None:
        """Forget a session (ended, withdrawn or shed); None if it was not held."""
        return self._entries.pop(session_id, None)

    def engine_priority(self, entry: SessionEntry) -> int:
        """The priority value the session's call carries now (its bucketed rank)."""
        return self.levels.value(entry.session_id)

    def idle_ids(self, now: float, idle_timeout_s: float) -> list[str]:
        """Ids of the sessions that have been idle for the timeout."""
        return [e.session_id for e in self._entries.values() if e.is_idle(now, idle_timeout_s)]

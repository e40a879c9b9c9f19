"""Deterministic conversations sized to recorded token counts, and seeded arrival plans.

Replaying recorded agent sessions against a live OpenAI-compatible server: the conversations and
the arrival plan. No I/O (basin_sim/replay_client.py sends the requests).

Rules:
- Text is deterministic: filler is made of common English words that are one token each in the
  serving tokenizer (with or without a leading space), cut from one seeded word sequence at an offset
  derived from a key (run id, call index), so the same planned session always sends the same text
  and every call's conversation is a true prefix extension of the previous one (prefix caching can
  hit). The answer in the history is the server's own text, so the next call's tool message is sized
  only once that answer is known.
- Call 1 = [system, user(task_text + "(ref <run id>)"), optional user(filler)]. The system message is
  shared by every session of a benchmark (a real agent's system prompt); its size is the smallest
  first prompt of that benchmark in the pool minus that session's task message, at least
  MIN_SYSTEM_TOKENS. The reference line keeps two replays of one pool session from sharing more
  than the system prompt and task text. A task text too long for the recorded first prompt is cut;
  the rest of the recorded first prompt is the filler user message (left out under
  MIN_FILLER_TOKENS, so a prompt may fall short by a few tokens).
- After call k the server's answer (its text) and a tool message are appended; the tool message is
  sized so that call k+1's prompt counts the recorded prompt_tokens of call k+1 (at least one
  filler word: when the answer alone overshoots, the prompt overshoots). Prompts are counted with
  `ChatTokenizer.count_prompt` (Qwen ChatML, generation prompt included). max_tokens = recorded
  completion tokens (at least 1).
- Arrivals: Poisson on a piecewise-constant rate schedule, segment by segment, in model seconds;
  sessions drawn uniformly with replacement from the pool by one seeded stream. Run ids are
  "<tag>-<index>", unique per planned session. A gap the trace did not record is `default_gap_s`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from basin_runtime.session_table import Session
from basin_runtime.tokenizer import ChatTokenizer
from basin_sim.lifecycle import SessionSpec
from basin_sim.profile import Deployment
from basin_sim.unloaded import UnloadedTimes
from basin_sim.workload.scenarios import DEFAULT_GAP_S, shared_prefix_tokens

MIN_SYSTEM_TOKENS = 16
MIN_FILLER_TOKENS = 8  # a filler user message smaller than this is left out
WORD_SEQUENCE_LENGTH = 1 << 16
_CANDIDATE_WORDS = (  # noqa: SIM905 -- a paragraph of words reads better than 135 quoted strings
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their can has been if more when will would who so no time out up other "
    "into its then two first any do see made could may new some these most over only such after also did way "
    "many must where much well down back just years because each people still year should work now very used "
    "life those here world what how both between own good same last long make great little while state day man "
    "part place old end right high three off take since small against large water every again never side point "
    "next word"
).split()

Message = dict[str, Any]


class ReplayPlanError(ValueError):
    """A schedule or plan that does not make sense."""


@cache
def _one_token_words(tokenizer: ChatTokenizer) -> tuple[str, ...]:
    words = tuple(w for w in _CANDIDATE_WORDS if tokenizer.count_text(w) == 1 and tokenizer.count_text(" " + w) == 1)
    if len(words) < 32:
        raise ReplayPlanError(f"tokenizer {tokenizer.name!r}: only {len(words)} one-token filler words")
    return words


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class Filler:
    """Deterministic filler text with an exact token count in one tokenizer.

    Text is cut from one long seeded sequence of one-token words at an offset derived from the key:
    joining a slice is cheap, drawing words one by one is not (tool outputs reach tens of thousands of
    tokens per call).
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = _word_sequence(tokenizer)

    def text(self, key: str, num_words: int) -> str:
        """`num_words` one-token words at the offset of `key` in the sequence (same key: same text)."""
        words, start = self.words, _seed(key) % len(self.words)
        parts: list[str] = []
        while num_words > 0:
            piece = words[start:start + num_words]
            parts.append(" ".join(piece))
            num_words -= len(piece)
            start = 0
        return " ".join(parts)

    def sized(self, key: str, target_tokens: int, count: Callable[[str], int], prefix: str = "") -> tuple[str, int]:
        """`prefix` + filler whose `count` is `target_tokens` (or the shortest possible when that is too
        small), and its count."""
        base = count(prefix + self.text(key, 1)) - 1  # what the rendering adds around the words
        words = max(1, target_tokens - base)
        text = prefix + self.text(key, words)
        got = count(text)
        for _ in range(3):  # each word is one token, so this loop normally does not run
            if got == target_tokens or (got > target_tokens and words == 1):
                break
            words = max(1, words + target_tokens - got)
            text = prefix + self.text(key, words)
            got = count(text)
        return text, got


@cache
def _word_sequence(tokenizer: ChatTokenizer) -> tuple[str, ...]:
    rng = random.Random(20_260_501)
    return tuple(rng.choices(_one_token_words(tokenizer), k=WORD_SEQUENCE_LENGTH))


@dataclass(frozen=True)
class PlannedSession:
    """One replay of a pool session: its run id (sent as X-Session-ID), arrival and tool gaps."""

    run_id: str
    session: Session
    arrival_s: float
    gaps_s: tuple[float, ...]

    def spec(self, shared_tokens: Mapping[str, int]) -> SessionSpec:
        """The simulator's view of this replay (for its unloaded time)."""
        b = self.session.benchmark
        return SessionSpec(self.run_id, self.session, self.arrival_s, b, shared_tokens[b], self.gaps_s)


def make_run_id(tag: str, index: int) -> str:
    """The id of a plan's `index`-th session (sent as X-Session-ID)."""
    return f"{tag}-{index:06d}"


def reference_line(session_run_id: str) -> str:
    """What the first user message carries after the task text, unique per replay."""
    return f"\n\n(ref {session_run_id})"


class Conversation:
    """The messages of one replayed session, call by call."""

    def __init__(self, planned: PlannedSession, system_text: str, filler: Filler) -> None:
        self.planned = planned
        self.filler = filler
        self.messages: list[Message] = []
        self.call_index = -1
        self.prompt_tokens = 0  # of the current call, as built
        self._system_text = system_text

    @property
    def target_prompt_tokens(self) -> int:
        """The recorded prompt size of the current call."""
        return self.planned.session.calls[self.call_index].prompt_tokens

    @property
    def max_tokens(self) -> int:
        """The recorded completion size of the current call (at least 1)."""
        return max(1, self.planned.session.calls[self.call_index].completion_tokens)

    @property
    def has_next(self) -> bool:
        """True when the session has a call after the current one."""
        return self.call_index + 1 < self.planned.session.n_calls

    def _count(self, message: Message) -> int:
        return self.filler.tokenizer.count_message(message)

    def first_call(self) -> list[Message]:
        """The messages of call 1."""
        if self.call_index != -1:
            raise ReplayPlanError(f"{self.planned.run_id}: first_call after call {self.call_index + 1}")
        tok, rid = self.filler.tokenizer, self.planned.run_id
        self.call_index = 0
        system: Message = {"role": "system", "content": self._system_text}
        room = self.target_prompt_tokens - self._count(system) - tok.generation_prompt_tokens
        user: Message = {"role": "user", "content": _fit_task(self.planned.session.task_text, reference_line(rid),
                                                              room, lambda m: self._count(m))}
        self.messages = [system, user]
        self.prompt_tokens = self._count(system) + self._count(user) + tok.generation_prompt_tokens
        rest = self.target_prompt_tokens - self.prompt_tokens
        if rest >= MIN_FILLER_TOKENS:
            text, size = self.filler.sized(f"{rid}/context", rest,
                                           lambda t: self._count({"role": "user", "content": t}))
            self.messages.append({"role": "user", "content": text})
            self.prompt_tokens += size
        return list(self.messages)

    def next_call(self, answer_text: str) -> list[Message]:
        """The messages of the next call: these plus the answer and a tool message sized to the recorded prompt."""
        if self.call_index < 0 or not self.has_next:
            raise ReplayPlanError(f"{self.planned.run_id}: no call after call {self.call_index + 1}")
        answer: Message = {"role": "assistant", "content": answer_text}
        answer_tokens = self._count(answer)
        self.call_index += 1
        k = self.call_index
        call_id = f"call_{k}"

        def count(text: str) -> int:
            return self._count({"role": "tool", "tool_call_id": call_id, "content": text})

        need = self.target_prompt_tokens - self.prompt_tokens - answer_tokens
        text, tool_tokens = self.filler.sized(f"{self.planned.run_id}/tool/{k}", need, count)
        self.messages += [answer, {"role": "tool", "tool_call_id": call_id, "content": text}]
        self.prompt_tokens += answer_tokens + tool_tokens
        return list(self.messages)


def _fit_task(task_text: str, reference: str, room_tokens: int, count: Callable[[Message], int]) -> str:
    """Task text + reference line, the task text cut (by characters) if the message exceeds `room_tokens`."""
    if count({"role": "user", "content": task_text + reference}) <= room_tokens:
        return task_text + reference
    lo, hi = 0, len(task_text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count({"role": "user", "content": task_text[:mid] + reference}) <= room_tokens:
            lo = mid
        else:
            hi = mid - 1
    return task_text[:lo] + reference


class ConversationBuilder:
    """System prompts per benchmark (from the pool) and a conversation per planned session.

    `tag` is the plan's run-id tag: the reference line's size is reserved in every first prompt.
    """

    def __init__(self, pool: Sequence[Session], tokenizer: ChatTokenizer, tag: str) -> None:
        self.filler = Filler(tokenizer)
        self.system_texts: dict[str, str] = {}
        sizes: dict[str, int] = {}
        sample_ref = reference_line(make_run_id(tag, 0))
        for s in pool:
            task = tokenizer.count_message({"role": "user", "content": s.task_text + sample_ref})
            room = s.first_prompt_tokens - task - tokenizer.generation_prompt_tokens
            sizes[s.benchmark] = min(sizes.get(s.benchmark, room), room)
        for benchmark, size in sorted(sizes.items()):
            header = f"You are an autonomous agent solving {benchmark} tasks. Notes:"
            self.system_texts[benchmark], _ = self.filler.sized(
                f"system/{benchmark}", max(MIN_SYSTEM_TOKENS, size),
                lambda t: tokenizer.count_message({"role": "system", "content": t}), prefix=header + " ")

    def conversation(self, planned: PlannedSession) -> Conversation:
        """A fresh conversation for one planned session."""
        benchmark = planned.session.benchmark
        if benchmark not in self.system_texts:
            raise ReplayPlanError(f"{planned.run_id}: benchmark {benchmark!r} is not in the builder's pool")
        return Conversation(planned, self.system_texts[benchmark], self.filler)


@dataclass(frozen=True)
class RateSchedule:
    """Arrival rate per model second: `segments` = (start_s, rate_per_s), the first at 0, up to `end_s`."""

    segments: tuple[tuple[float, float], ...]
    end_s: float

    def __post_init__(self) -> None:
        starts = [s for s, _ in self.segments]
        if not starts or starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(starts)):
            raise ReplayPlanError(f"segment starts must begin at 0 and increase, got {starts}")
        if not starts[-1] < self.end_s:
            raise ReplayPlanError(f"end_s {self.end_s} must be after the last segment start {starts[-1]}")
        if any(not rate >= 0 for _, rate in self.segments):
            raise ReplayPlanError(f"rates must be >= 0, got {[r for _, r in self.segments]}")

    @classmethod
    def steady(cls, rate_per_s: float, duration_s: float,
               surge: tuple[float, float, float] | None = None) -> RateSchedule:
        """`rate_per_s` until `duration_s`, times `factor` inside a surge (start_s, end_s, factor)."""
        if surge is None:
            return cls(((0.0, rate_per_s),), duration_s)
        start, end, factor = surge
        if not 0 < start < end <= duration_s:
            raise ReplayPlanError(f"surge [{start}, {end}) must lie inside (0, {duration_s}]")
        parts = [(0.0, rate_per_s), (start, rate_per_s * factor)] + ([(end, rate_per_s)] if end < duration_s else [])
        return cls(tuple(parts), duration_s)

    @classmethod
    def steps(cls, rates_per_s: Sequence[float], step_s: float) -> RateSchedule:
        """One rate per step of `step_s` (the knee ramp)."""
        return cls(tuple((k * step_s, r) for k, r in enumerate(rates_per_s)), len(rates_per_s) * step_s)

    def pieces(self) -> list[tuple[float, float, float]]:
        """(start_s, end_s, rate_per_s) of every segment."""
        ends = [s for s, _ in self.segments[1:]] + [self.end_s]
        return [(start, end, rate) for (start, rate), end in zip(self.segments, ends, strict=True)]


def plan_sessions(pool: Sequence[Session], schedule: RateSchedule, seed: int, tag: str,
                  default_gap_s: float = DEFAULT_GAP_S, max_sessions: int | None = None) -> list[PlannedSession]:
    """Every session of a replay, in arrival order (seeded: same inputs, same plan)."""
    if not pool:
        raise ReplayPlanError("the session pool is empty")
    rng = random.Random(seed * 7919 + 3)
    planned: list[PlannedSession] = []
    for start, end, rate in schedule.pieces():
        t = start + (rng.expovariate(rate) if rate > 0 else end)
        while t < end and (max_sessions is None or len(planned) < max_sessions):
            session = pool[rng.randrange(len(pool))]
            gaps = tuple(default_gap_s if c.gap_s is None else c.gap_s for c in session.calls[:-1])
            planned.append(PlannedSession(make_run_id(tag, len(planned)), session, t, gaps))
            t += rng.expovariate(rate)
    return planned


def unloaded_times(planned: Sequence[PlannedSession], pool: Sequence[Session],
                   deployment: Deployment) -> dict[str, float]:
    """Run id -> the session's end-to-end time alone on `deployment` (the simulator's cost model)."""
    shared = shared_prefix_tokens(pool)
    times = UnloadedTimes(deployment)
    return {p.run_id: times.of(replace(p.spec(shared), arrival_s=0.0)) for p in planned}

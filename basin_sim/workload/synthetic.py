"""A synthetic corpus of agent sessions, deterministic by seed, fitted to the real session table.

Each family mirrors one real benchmark. A session draws a latent size z ~ N(0, 1) that drives its
number of calls and its tool outputs, and its task text is made of words whose odds depend on z, so
the text carries real (learnable, noisy) signal about the session's peak context. Statistics (log-mean
and log-sd of calls per session, first prompt, tool output per call, completion, gap) come from
`fit_family` on the real table (values in `FAMILIES`; `tests/sim/test_synthetic.py` refits them).
Used when no real corpus is present, and by the simulator for scales the real corpora do not reach.
`presets.py` derives named pools from these families (their tool gaps drawn by a `GapSampler`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from basin_runtime.session_table import Call, Session

SYNTHETIC_TOKENIZER = "qwen3.6"

GapSampler = Callable[[random.Random], float]  # one tool gap in seconds, drawn from the session's stream


@dataclass(frozen=True)
class LogNormal:
    mu: float
    sigma: float


@dataclass(frozen=True)
class Family:
    """Fitted statistics of one benchmark's sessions (natural-log space)."""

    benchmark: str
    n_calls: LogNormal
    first_prompt_tokens: LogNormal
    tool_output_tokens: LogNormal  # growth per call beyond the answer itself
    completion_tokens: LogNormal
    gap_s: LogNormal
    task_chars: LogNormal
    preamble: str  # the fixed instructions every task text of the family carries


# Fitted on the real session table (qwen3.6 tokens) by `fit_family`; gaps for tau-bench (no
# timestamps recorded) are an assumption: a customer's reply takes a few seconds.
FAMILIES: tuple[Family, ...] = (
    Family("synthetic-swebench", LogNormal(3.589, 0.419), LogNormal(7.429, 0.233), LogNormal(4.646, 1.316),
           LogNormal(4.663, 1.188), LogNormal(1.598, 0.696), LogNormal(8.741, 0.209),
           "Consider the following PR description and make the tests pass."),
    Family("synthetic-terminal", LogNormal(2.822, 0.534), LogNormal(6.811, 0.201), LogNormal(4.817, 1.442),
           LogNormal(5.186, 1.262), LogNormal(0.588, 1.157), LogNormal(8.030, 0.232),
           "Please solve this task in the terminal."),
    Family("synthetic-tau", LogNormal(2.392, 0.539), LogNormal(8.273, 0.010), LogNormal(4.199, 1.262),
           LogNormal(3.976, 0.707), LogNormal(1.500, 0.600), LogNormal(4.375, 0.405),
           "Hi!"),
)

_VERBS = ("fix", "add", "refactor", "migrate", "rename", "support", "optimize", "document", "debug", "port",
          "rewrite", "validate", "deprecate", "parallelize", "compile", "configure", "train", "deploy", "cancel",
          "book", "upgrade", "change", "explore", "recover", "benchmark", "serialize", "vectorize", "patch")
_NOUNS = ("typo", "docstring", "parser", "queryset", "migration", "test suite", "cache", "tokenizer", "router",
          "schema", "database", "kernel module", "build system", "compiler", "cluster", "pipeline", "model",
          "reservation", "flight", "baggage", "payment", "README", "changelog", "regex", "index", "timezone",
          "encoder", "dataset", "container", "webserver", "certificate", "maze", "chess engine", "archive",
          "log file", "spreadsheet", "matrix", "integration", "plugin", "codebase", "dependency graph")
_MODIFIERS = ("small", "single-line", "simple", "minor", "across all modules", "end to end", "large",
              "legacy", "distributed", "recursive", "multi-step", "entire", "from scratch", "several",
              "quick", "one", "whole repository", "interactive", "concurrent", "incremental")


def family_named(benchmark: str, families: Sequence[Family] = FAMILIES) -> Family:
    """The family of that benchmark name; KeyError naming the known ones."""
    for candidate in families:
        if candidate.benchmark == benchmark:
            return candidate
    raise KeyError(f"no synthetic family {benchmark!r}; known: {', '.join(f.benchmark for f in families)}")


def _loadings() -> dict[str, float]:
    """Each word's pull toward large sessions: fixed, independent of the corpus seed."""
    rng = random.Random(20260417)
    words = [*_VERBS, *_NOUNS, *_MODIFIERS]
    return {w: rng.gauss(0.0, 1.0) for w in words}


_LOADINGS = _loadings()


def _cumulative_weights(words: Sequence[str], z: float) -> list[float]:
    total, cumulative = 0.0, []
    for w in words:
        total += math.exp(0.9 * _LOADINGS[w] * z)
        cumulative.append(total)
    return cumulative


def task_text(rng: random.Random, family: Family, z: float) -> str:
    """A task text of about the family's length whose words lean with the session's size."""
    target = int(math.exp(rng.gauss(family.task_chars.mu, family.task_chars.sigma)))
    lists = (_VERBS, _MODIFIERS, _NOUNS)
    weights = [_cumulative_weights(words, z) for words in lists]
    parts = [family.preamble]
    length = len(family.preamble)
    while length < target - 18:  # stop within half a sentence of the target
        verb, modifier, noun = (rng.choices(w, cum_weights=c, k=1)[0] for w, c in zip(lists, weights, strict=True))
        sentence = f"{verb.capitalize()} the {modifier} {noun}."
        parts.append(sentence)
        length += len(sentence) + 1
    return " ".join(parts)


def _draw(rng: random.Random, dist: LogNormal, shift: float = 0.0) -> float:
    return math.exp(rng.gauss(dist.mu + shift * dist.sigma, dist.sigma))


def synthetic_session(rng: random.Random, family: Family, index: int, draw_gap: GapSampler | None = None) -> Session:
    """One synthetic session of a family; gaps from `draw_gap` if given, else the family's log-normal."""
    z = rng.gauss(0.0, 1.0)
    n_calls = max(1, round(_draw(rng, LogNormal(family.n_calls.mu, family.n_calls.sigma * 0.6), 0.8 * z / 0.6)))
    text = task_text(rng, family, z)
    first = int(_draw(rng, family.first_prompt_tokens))
    calls: list[Call] = []
    prompt = first
    gap_of = draw_gap if draw_gap is not None else lambda r: _draw(r, family.gap_s)
    for k in range(n_calls):
        completion = max(1, int(_draw(rng, family.completion_tokens)))
        gap = gap_of(rng) if k + 1 < n_calls else None
        calls.append(Call(prompt, completion, None, None, gap))
        output = _draw(rng, family.tool_output_tokens, 0.3 * z)
        if rng.random() < 0.02:  # an occasional large jump: a whole file or log dumped into the context
            output *= 10
        prompt += completion + int(output)
    return Session(
        session_id=f"{family.benchmark}-{index:05d}", benchmark=family.benchmark, source="synthetic",
        agent="synthetic", model="synthetic", task_id=f"{family.benchmark}-task-{index:05d}", task_text=text,
        task_description="", tokenizer=SYNTHETIC_TOKENIZER, calls=tuple(calls), resolved=None,
    )


def generate_corpus(seed: int, sessions_per_benchmark: int,
                    families: Sequence[Family] = FAMILIES) -> list[Session]:
    """The synthetic corpus: `sessions_per_benchmark` sessions of every family, the same for the same seed."""
    rng = random.Random(seed)
    return [synthetic_session(rng, family, i) for family in families for i in range(sessions_per_benchmark)]


def _log_stats(values: Sequence[float]) -> LogNormal:
    logs = [math.log(max(v, 1.0)) for v in values]
    mean = sum(logs) / len(logs)
    var = sum((x - mean) ** 2 for x in logs) / len(logs)
    return LogNormal(round(mean, 3), round(math.sqrt(var), 3))


def fit_family(sessions: Sequence[Session], benchmark: str, preamble: str = "") -> Family:
    """Fit a family's statistics to real sessions (all of one benchmark)."""
    growth = [s.calls[k + 1].prompt_tokens - s.calls[k].prompt_tokens - s.calls[k].completion_tokens
              for s in sessions for k in range(s.n_calls - 1)]
    gaps = [c.gap_s for s in sessions for c in s.calls if c.gap_s is not None]
    return Family(
        benchmark=benchmark,
        n_calls=_log_stats([s.n_calls for s in sessions]),
        first_prompt_tokens=_log_stats([s.first_prompt_tokens for s in sessions]),
        tool_output_tokens=_log_stats(growth or [1.0]),
        completion_tokens=_log_stats([c.completion_tokens for s in sessions for c in s.calls]),
        gap_s=_log_stats(gaps) if gaps else LogNormal(1.5, 0.6),
        task_chars=_log_stats([s.task_chars for s in sessions]),
        preamble=preamble,
    )

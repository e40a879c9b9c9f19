"""Basin's ablations: one part of the policy changed at a time, everything else as `basin` runs it.

Rules:
- An ablation is a row label ("basin:<part>") for the registered `basin` policy with one change:
  what a session reserves (`reservation`), whether the online re-estimates apply (`revisions`),
  whether the latency gate is on (`latency_gate`), or `PolicyConfig` fields set by hand (`overrides`,
  as the gateway config's `policy:` section). `basin` itself is the paper's Basin (no latency gate).
- Reservations: "predicted" (m(q) x the ONNX prediction, as served), "oracle-peak" (each session's
  true peak: an oracle, never servable), "benchmark-constant" (every session of a benchmark
  reserves that benchmark's q-quantile of the pool's peaks: no predictor; in-sample, so its cover
  is q by construction), "current-context" (a session reserves only its context now, the
  prototype's reservation, while its priority still comes from the prediction: the multiplier is
  CONTEXT_ONLY_MULTIPLIER, so ceil(m x peak) is 1 token and max(1, context) is the context).
  Priority follows the same peak (arrival + peak / tokens_per_s). "pooled-first-call" (`basin:no-selection`,
  issue 49 part 5 off): the model file alone predicts every session and answers m(q), with the pooled
  model's out-of-fold peaks (served.py's `--first-call pooled`), where `basin` takes each benchmark's
  shipped file and the selected procedure's peaks; it is told as the compare cell computed it.
- Each reservation kind is calibrated on its own knee ramp (its r), keyed by `calibration_tag`, so
  the budget is in the unit that kind sums.
- Revisions off ("basin:no-revisions", issue 49 part 1 off): no online re-estimate at the online model's
  slots (revisions.py), each session keeps its first-call reservation and the outgrowth rule alone.
- Memory of finished tasks off ("basin:no-task-memory"): each session is told its prediction alone
  (`basin` shrinks it toward its task's finished peaks in the run, policies/task_memory.py). The
  memory applies to the "predicted" reservation only: the other kinds are not predictions.
- Latency gate on ("basin:latency-gate", beyond the paper; the gateway's --latency-gate): the working
  set engages admission only while the engines' windowed first-token latency reaches the
  calibration's gate (plateau latency + 3 call cycles).
- The quantile sweep ("basin:q<q>"): reserve m(q) x the prediction for another q than the served
  one while the budget stays the served calibration's (r measured at the served q), so B in tokens
  is the same for every q and a larger q admits fewer into it (design.md: why not re-measure r).
  The sweep runs without the latency gate, as `basin` does (its q = 0.9 row is `basin`).
- Size-aware priority off: tokens_per_s so large that the priority is the arrival time.
  Adaptive budget off: the budget's bounds are both 1 (it never moves; the completion ceiling off
  too). The knee budget ("basin:knee-budget"): the adaptive budget bounded at max_fraction x B as
  before the completion peak (`completion_budget` off). Shedding off: no peak
  completion rate. Growth unchecked (`can_outgrow_reservation`): a later call past its session's
  reservation is neither re-reserved nor held (the core's outgrowth rule off; `basin` has it on, as
  the gateway does). Recovery off (`basin:no-recovery`): no live session is held at its tool boundary
  in a collapse (the core's `recovery.py`; `basin` has it on). Admission off: a budget no working set
  reaches (NO_ADMISSION_BUDGET_TOKENS), so every session is admitted on arrival and nothing queues or
  is shed; the order stays Basin's.
- No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from basin_runtime.session_table import Session

# A label's suffix (compare): the run's deployment has SGLang's session-aware radix cache on its prefill instances
# with its intended semantics (`session_radix_cache: true`); as today's PD prefill code runs it ("faithful") it
# takes no reference and the run is the same as without it (tests/sim/test_session_radix_cache.py).
SESSION_CACHE = "+session-cache"


def split_label(label: str) -> tuple[str, bool]:
    """(a compare label without its `+session-cache` suffix, whether it had one)."""
    if label.endswith(SESSION_CACHE):
        return label[:-len(SESSION_CACHE)], True
    return label, False


Reservation = Literal["predicted", "oracle-peak", "benchmark-constant", "current-context", "pooled-first-call"]
ARRIVAL_ORDER_TOKENS_PER_S = 1e12  # peak / this is < 1 µs for any context: priority = arrival
CONTEXT_ONLY_MULTIPLIER = 1e-12  # x any predicted peak (< 1e9 tokens) rounds up to 1 token
NO_ADMISSION_BUDGET_TOKENS = 10**15


@dataclass(frozen=True)
class Ablation:
    """`basin` with one part changed."""

    name: str
    description: str
    reservation: Reservation = "predicted"
    revisions: bool = True
    overrides: Mapping[str, Any] = field(default_factory=dict)
    quantile: float | None = None  # reserve m(this q) x prediction (None: the served q), budget unchanged
    latency_gate: bool = False
    task_memory: bool = True  # the memory of finished tasks (with the "predicted" reservation)


SWEEP_QUANTILES = (0.5, 0.75, 0.95, 0.99)  # beside the served 0.9, within the model files' grid (0.5..0.99)
ABLATIONS: dict[str, Ablation] = {a.name: a for a in (
    Ablation("basin", "the paper's Basin: m(q) x prediction, size-aware priority, adaptive budget, shedding"),
    Ablation("basin:oracle-peak", "reserves each session's true peak (an oracle)", "oracle-peak", revisions=False),
    Ablation("basin:benchmark-constant", "reserves its benchmark's q-quantile peak (no predictor)",
             "benchmark-constant", revisions=False),
    Ablation("basin:current-context", "reserves only its current context (priority still predicted)",
             "current-context", revisions=False),
    Ablation("basin:no-selection", "first-call predictor selection off: the pooled model file and its out-of-fold "
             "peaks for every benchmark (issue 49, part 5)", "pooled-first-call"),
    Ablation("basin:no-revisions", "reservations that follow the session off: no online re-estimate at the online "
             "model's slots (issue 49, part 1)", revisions=False),
    Ablation("basin:arrival-order", "size-aware priority off: priority = arrival",
             overrides={"tokens_per_s": ARRIVAL_ORDER_TOKENS_PER_S}),
    Ablation("basin:fixed-budget", "adaptive budget off: the budget never moves",
             overrides={"budget_min_fraction": 1.0, "budget_max_fraction": 1.0, "completion_budget": False}),
    Ablation("basin:knee-budget", "the adaptive budget bounded at the knee (+10%), not at the completion peak",
             overrides={"completion_budget": False}),
    Ablation("basin:no-shedding", "shedding off", overrides={"peak_completion_rate_per_s": None}),
    Ablation("basin:growth-unchecked", "a later call may outgrow its session's reservation unchecked (the "
             "outgrowth rule off: no re-reservation, never held)", overrides={"can_outgrow_reservation": True}),
    Ablation("basin:no-recovery", "recovery at tool boundaries off: no live session is held in a collapse",
             overrides={"recovery": False}),
    Ablation("basin:no-admission", "admission off: everyone admitted on arrival (order and priority kept)",
             overrides={"budget_tokens": NO_ADMISSION_BUDGET_TOKENS}),
    Ablation("basin:no-task-memory", "the memory of finished tasks off: each session is told its prediction alone",
             task_memory=False),
    Ablation("basin:latency-gate", "beyond the paper: the working set engages admission only while the engines' "
             "first-token latency reaches the calibration's gate", latency_gate=True),
    *(Ablation(f"basin:q{q:g}", f"reserving m({q:g}) x prediction in the budget measured at the served q",
               quantile=q) for q in SWEEP_QUANTILES),
)}


class AblationError(ValueError):
    """An unknown ablation name; the message lists the known ones."""


def ablation(name: str) -> Ablation:
    """The ablation called `name`."""
    found = ABLATIONS.get(name)
    if found is None:
        raise AblationError(f"unknown ablation {name!r}; known: {', '.join(ABLATIONS)}")
    return found


def benchmark_constants(pool: Sequence[Session], q: float) -> dict[str, float]:
    """Benchmark -> the q-quantile (nearest rank) of its sessions' peaks in `pool`."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    peaks: dict[str, list[int]] = {}
    for session in pool:
        peaks.setdefault(session.benchmark, []).append(session.peak_prompt_tokens)
    return {bench: float(sorted(values)[max(0, math.ceil(q * len(values)) - 1)]) for bench, values in peaks.items()}


def reservations(kind: Reservation, pool: Sequence[Session], peaks: Mapping[str, float],
                 multipliers: Mapping[str, float], q: float | None) -> tuple[dict[str, float], dict[str, float]]:
    """(peak per pool session, m per pool session) for a reservation kind; m empty: the peak is reserved as is."""
    if kind == "predicted":
        return dict(peaks), dict(multipliers)
    if kind == "oracle-peak":
        return {s.session_id: float(s.peak_prompt_tokens) for s in pool}, {}
    if kind == "current-context":
        return dict(peaks), {session_id: CONTEXT_ONLY_MULTIPLIER for session_id in peaks}
    if kind == "pooled-first-call":
        raise ValueError("pooled-first-call peaks come from the pooled model (compare's Cell.unselected), not from "
                         "the served peaks")
    constants = benchmark_constants(pool, 0.9 if q is None else q)
    return {s.session_id: constants[s.benchmark] for s in pool}, {}


def calibration_tag(kind: Reservation, predictor_sha256: str, q: float | None) -> str:
    """What a reservation kind's knee calibration is keyed by in place of the predictor's SHA-256."""
    if kind == "predicted":
        return predictor_sha256
    if kind in ("oracle-peak", "current-context"):
        return kind
    if kind == "pooled-first-call":
        return f"{predictor_sha256}:{kind}"
    return f"benchmark-constant-q{0.9 if q is None else q:g}"

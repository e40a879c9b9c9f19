"""`Step`: one policy step as serialisable data, and the one function that applies it to a `Policy`.

Rules:
- A `Step` is one call of the policy core (`arrive`, `adopt`, `observe`, `revise`, `finish`, `tick`,
  `set_reference_budget`) or of the replicated state around it (`claim`: a replica takes over a held
  session; `reap`: sessions of dead replicas are let go, `replica.py`), with its session id, its
  arguments in the core method's order, and `now`. `apply_step` is the one translation of a step into
  a core call: the in-process backend and every Redis replica run the same function, so the rules
  live in the policy core alone.
- A step's arguments are passed to the core unchecked: the core validates them (an illegal step raises
  `PolicyError` and changes nothing, on every replica alike). Only the shape is checked here: a known
  kind, a session id where the kind takes one, and an argument count the core method accepts.
- Encoding is JSON (NaN and infinities kept, so an illegal value reaches the core as it was sent);
  `now` is left out of an encoded step that the sequencer stamps with its clock (`SEQUENCER_CLOCK`).
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Any, Final, Literal, SupportsFloat, SupportsIndex, cast, get_args

from basin_runtime.policy import Event, Policy, PolicyError

StepKind = Literal["arrive", "adopt", "observe", "revise", "finish", "tick", "set_reference_budget", "claim",
                   "reap"]
STEP_KINDS: frozenset[str] = frozenset(get_args(StepKind))
SESSION_KINDS = frozenset({"arrive", "adopt", "observe", "revise", "finish", "claim"})
# Argument counts each kind accepts (the core method's parameters after the session id and `now`).
ARITY: Final[dict[str, tuple[int, ...]]] = {
    "arrive": (2, 3), "adopt": (2, 3), "observe": (1,), "revise": (1, 2), "finish": (0,), "tick": (0, 1, 2),
    "set_reference_budget": (1,), "claim": (0,), "reap": (2,),
}


class SEQUENCER_CLOCK:  # a sentinel, used as a value (never instantiated)
    """`Step.now` when the sequencer (Redis TIME) stamps the step's time."""


@dataclass(frozen=True)
class Step:
    """One step: `kind`, its session id (None for `tick`, `set_reference_budget`, `reap`), arguments, `now`."""

    kind: StepKind
    session_id: str | None
    args: tuple[Any, ...] = ()
    now: Any = SEQUENCER_CLOCK  # seconds; None only for an operator budget change without a time

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise PolicyError(f"unknown step kind {self.kind!r}; known: {sorted(STEP_KINDS)}")
        if (self.kind in SESSION_KINDS) != (self.session_id is not None):
            raise PolicyError(f"step {self.kind!r}: session id {self.session_id!r} is "
                              f"{'missing' if self.kind in SESSION_KINDS else 'not taken'}")
        if len(self.args) not in ARITY[self.kind]:
            raise PolicyError(f"step {self.kind!r} takes {' or '.join(map(str, ARITY[self.kind]))} arguments, "
                              f"got {len(self.args)}")

    @property
    def is_stamped(self) -> bool:
        """True if the sequencer's clock gives this step its time."""
        return self.now is SEQUENCER_CLOCK


def apply_step(policy: Policy, step: Step, now: Any) -> list[Event]:
    """Run `step` on `policy` at `now`; its events, or `PolicyError` (nothing changed). Not for claim/reap."""
    sid, args = step.session_id, step.args
    if step.kind in ("arrive", "adopt"):
        method = policy.arrive if step.kind == "arrive" else policy.adopt
        assert sid is not None
        return method(sid, now, *args)
    if step.kind in ("observe", "revise"):
        assert sid is not None
        return (policy.observe if step.kind == "observe" else policy.revise)(sid, now, *args)
    if step.kind == "finish":
        assert sid is not None
        return policy.finish(sid, now)
    if step.kind == "tick":
        return policy.tick(now, *args)
    if step.kind == "set_reference_budget":
        return policy.set_reference_budget(args[0], now)
    raise PolicyError(f"step {step.kind!r} is not a policy-core step")


def encode_step(step: Step, counter: int) -> str:
    """The step as the JSON a stream entry carries; `counter` numbers this replica's steps (1, 2, ...)."""
    data: dict[str, Any] = {"k": step.kind, "q": counter, "a": list(step.args)}
    if step.session_id is not None:
        data["s"] = step.session_id
    if not step.is_stamped:
        data["t"] = step.now
    return json.dumps(data, default=_plain, separators=(",", ":"))


def decode_step(text: str | bytes) -> tuple[Step, int]:
    """(step, its replica's counter) from `encode_step`'s JSON; `PolicyError` for anything else."""
    try:
        data = json.loads(text)
        step = Step(data["k"], data.get("s"), tuple(data["a"]), data.get("t", SEQUENCER_CLOCK))
        counter = data["q"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PolicyError(f"malformed step entry {text[:200]!r}: {exc}") from None
    if type(counter) is not int or counter < 1:
        raise PolicyError(f"malformed step entry {text[:200]!r}: counter {counter!r}")
    return step, counter


def _plain(value: object) -> Any:
    """JSON for the numbers the core accepts that json does not know (numpy integers and floats)."""
    if hasattr(type(value), "__index__"):
        return operator.index(cast(SupportsIndex, value))
    if hasattr(type(value), "__float__"):
        return float(cast(SupportsFloat, value))
    raise TypeError(f"a step argument must be plain JSON, got {type(value).__name__}")

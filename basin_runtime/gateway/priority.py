# The session's fixed Basin priority as the integer SGLang schedules by, and the request id.
#
# Rules:
# - Basin's priority p is in seconds on the gateway clock, smaller served first
#   (`basin_runtime.policy.priority`). SGLang's request field `priority` is an int; the engine uses
#   it only with `--enable-priority-scheduling`, and serves *larger* values first unless
#   `--schedule-low-priority-values-first` is set. Basin needs both flags on every engine.
# - Mapping: priority = floor(p - origin_s), origin_s = the gateway clock at start-up. Sign: smaller
#   is earlier, same as p. Unit: 1 = one second of Basin priority, so SGLang's preemption threshold
#   (`--priority-scheduling-preemption-threshold`, default 10) reads "10 s apart". Range: values
#   start at 0 and grow with uptime and predicted peak (+1 per 30 predicted tokens at the default
#   rate); they are clamped to int32 [-2**31, 2**31 - 1], which 68 years of uptime does not reach.
#   Sessions within the same second tie; SGLang then serves them in arrival order.
# - Every forwarded request carries the session's priority; a client's own `priority` is replaced.
# - `rid`: a client's own rid is kept untouched. Otherwise the gateway adds a unique
#   `basin-<gateway tag>-<session digest>-<call index>`, except on batch requests (a list of prompts),
#   where SGLang expects one rid per item, so none is added.
"""Session priority as an SGLang integer, and request ids."""

from __future__ import annotations

import hashlib
import math
from typing import Any

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def sglang_priority(priority_s: float, origin_s: float) -> int:
    """Basin priority (seconds) as SGLang's integer: floor(p - origin), clamped to int32."""
    if math.isnan(priority_s):
        raise ValueError("priority is NaN")
    if math.isinf(priority_s):
        return INT32_MAX if priority_s > 0 else INT32_MIN
    return max(INT32_MIN, min(INT32_MAX, math.floor(priority_s - origin_s)))


def request_id(gateway_tag: str, session_id: str, call_index: int) -> str:
    """A rid unique per gateway run, session and call, safe ASCII whatever the session id holds."""
    digest = hashlib.blake2b(session_id.encode("utf-8"), digest_size=6).hexdigest()
    return f"basin-{gateway_tag}-{digest}-{call_index}"


def stamp(body: dict[str, Any], priority: int, rid: str | None) -> str | None:
    """Set `priority` on the request body, and `rid` if the client sent none; return the rid in effect."""
    body["priority"] = priority
    if "rid" not in body and rid is not None:
        body["rid"] = rid
    current = body.get("rid")
    return current if isinstance(current, str) else None

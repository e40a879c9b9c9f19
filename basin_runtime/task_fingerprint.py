"""The task fingerprint: which sessions ran the same task, from the task text alone.

Defined once; the pipeline (`basin_pipeline.task_memory`), the simulator (`basin_sim.policies.task_memory`)
and the gateway read it from the task text `basin_runtime.task_text.extract_task_text` cuts out of the first
prompt (the text the predictor is trained and served on).

Rules:
- Normalise, then hash: Unicode NFKC (one code point sequence for one rendered text), `str.casefold`
  (case carries no task), every run of whitespace (spaces, tabs, CR/LF) to one space, stripped at both
  ends. Assumption: two runs of one task differ only there (clients re-wrap lines and send CRLF or LF);
  nothing else is removed. Run-specific ids (dates, uuids, paths) are kept on purpose: no rule tells an id
  from the task's content (a SWE-bench issue's numbers are its content), and the errors are not symmetric:
  two tasks merged by a loose rule hand one task's peaks to another, while a task split by a strict rule
  only loses memory hits (the predictor's own estimate is used, as with no memory).
- The fingerprint is the SHA-256 hex digest of the normalised text's UTF-8 bytes, cut to
  FINGERPRINT_HEX_CHARS hex characters (128 bits: no collision in any log a gateway keeps; shorter keys
  in the state backend). An empty normalised text has no fingerprint (None): an empty task is no task.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

FINGERPRINT_HEX_CHARS = 32
_WHITESPACE = re.compile(r"\s+")


def normalise_task_text(text: str) -> str:
    """The task text as fingerprinted: NFKC, case-folded, whitespace runs as one space, stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def task_fingerprint(text: str) -> str | None:
    """The task's fingerprint (hex), or None for a text with nothing left once normalised."""
    normalised = normalise_task_text(text)
    if not normalised:
        return None
    return hashlib.sha256(normalised.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_CHARS]

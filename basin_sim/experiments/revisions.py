"""Reservations that follow the session (issue 49 part 1): Basin's online revisions in the simulator.

Rules:
- When: at the calls the online model is trained for, its slots (`basin.slots` in the `.online.onnx`
  file beside the model file: `basin_runtime.online.SLOTS`, calls 2, 3, 4, 5, 7, 10), by default for
  Basin; `--revise-at-calls K ...` names other calls, `--no-revisions` (the `basin:no-revisions` row of
  compare) makes none. A model file without an online model revises nothing.
- Where the re-estimate comes from: with `--predictions out-of-fold` (the default) from the `online`
  stage's out-of-fold table (`--online-out-of-fold`, data/online_oof/online_predictions.parquet; a
  session's re-estimate at call k from the outer fold that held its task out), keyed by session id
  and k, never from the in-sample online model. Its m_k(q) is the shipped online file's (the stage's
  rules say why). A pool session the table does not hold at k (a preset's or a gateway log's session,
  never in the training table) is re-estimated by the shipped online model, as its first call is
  predicted by the shipped model (predictions.py). A call the table has no row for (a slot too few
  sessions reach) is not revised. With no table at that path, out-of-fold runs make no revisions and
  say so in the log (never an in-sample fallback). `--predictions in-sample` re-estimates every
  session with the shipped online model (a near-oracle, as its first-call peaks).
- A scaled pool (workload.median_peak_tokens): the table's re-estimate (made as recorded) is scaled by
  the pool's token scale, as its first-call peak is (predictions.pool_peaks). Assumption: the
  re-estimate's log-space ridge moves with the scale as the first-call model's does; exact only where
  its log-size coefficients sum to one, an approximation otherwise (the in-sample path predicts the
  scaled calls instead).
- The rule, one for gateway and simulator (the policy core's, `basin_runtime.policy.core`): at a
  revision call the driver tells the core the call's prompt (`observe`) and then the re-estimate
  (`revise`), the gateway's `WaitingRoom.observe` and `BasinPolicy.on_call` alike. A call whose context
  passes its session's reservation is handled inside `observe` by the core's outgrowth rule: re-reserved
  at its context plus the predicted growth (ceil(m x peak) minus its first context), kept running if it
  would be admitted now, else requeued; a revision at that same call then replaces the re-reservation
  with max(ceil(m_k x re-estimate), context). Neither driver has a rule of its own.
- onnxruntime and pyarrow are imported only when a file is read (predictions.py's rule).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from basin_runtime.session_table import Session
from basin_sim.experiments.predictions import PredictionsError, ReservingPredictor, Revisions, online_revisions

log = logging.getLogger(__name__)
DEFAULT_ONLINE_OUT_OF_FOLD = Path("data/online_oof/online_predictions.parquet")

OnlineTable = dict[str, dict[int, float]]  # session id -> call k -> out-of-fold re-estimate (recorded tokens)


def model_slots(predictor: object) -> tuple[int, ...]:
    """The calls the predictor's online model is trained for (its file's slots); () without an online model."""
    online = getattr(predictor, "online", None)
    if online is None:
        return ()
    return tuple(getattr(online, "slots", ()))


def revision_calls_for(predictor: object, calls: Sequence[int] | None, enabled: bool = True) -> tuple[int, ...]:
    """The calls Basin revises at: none when off, `calls` when given, else the online model's slots."""
    if not enabled:
        return ()
    return tuple(calls) if calls is not None else model_slots(predictor)


def load_online_table(path: Path) -> OnlineTable | None:
    """Session id -> k -> out-of-fold re-estimate, from the online stage's table; None if there is no file,
    `PredictionsError` naming it if it is not such a table."""
    import pyarrow.parquet as pq

    if not path.exists():
        return None
    try:
        data = pq.read_table(path, columns=["session_id", "k", "online_predicted"]).to_pydict()
    except Exception as exc:  # pyarrow raises several kinds for a bad file
        raise PredictionsError(f"{path}: not an out-of-fold online table with session_id, k and online_predicted "
                               f"({exc}); re-run the online stage (`make repro`) or pass --no-revisions") from exc
    out: OnlineTable = {}
    for sid, k, peak in zip(data["session_id"], data["k"], data["online_predicted"], strict=True):
        if peak is not None:
            out.setdefault(str(sid), {})[int(k)] = float(peak)
    return out


def revisions_for(predictor: ReservingPredictor, pool: Sequence[Session], peaks: Mapping[str, float],
                  q: float | None, calls: Sequence[int], source: str, table_path: Path = DEFAULT_ONLINE_OUT_OF_FOLD,
                  token_scale: float = 1.0, table: OnlineTable | None = None) -> Revisions:
    """Pool session id -> call k -> (re-estimate, m_k(q)) at `calls` (see the rules); `table` skips reading
    `table_path`."""
    online = getattr(predictor, "online", None)
    if online is None or not calls:
        return {}
    if source == "in-sample":
        return online_revisions(predictor, pool, peaks, q, calls)
    if table is None:
        table = load_online_table(table_path)
    if table is None:
        log.warning("no out-of-fold online re-estimates at %s (stage online): out-of-fold runs revise nothing",
                    table_path)
        return {}
    out: Revisions = {s.session_id: {} for s in pool}
    others: list[Session] = []
    for session in pool:
        held = table.get(session.session_id)
        if held is None:
            others.append(session)
            continue
        for k in calls:
            if len(session.calls) >= k and k in held:
                out[session.session_id][k] = (held[k] * token_scale, 1.0 if q is None else online.multiplier(q, k))
    if others:
        out.update(online_revisions(predictor, others, peaks, q, calls))
    return out

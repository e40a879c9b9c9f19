"""The online stage's out-of-fold re-estimates (issue 49 part 1): each from a model that never saw its task."""

from __future__ import annotations

import numpy as np
import pandas as pd

from basin_pipeline.online import Choice, out_of_fold_rows, predict, slice_at
from basin_runtime.online import SLOTS


def _sessions(n: int = 80, seed: int = 5) -> tuple[pd.DataFrame, dict[str, tuple[list[int], list[int]]], np.ndarray]:
    """Sessions of 40 tasks (2 each), 2 to 11 calls whose context grows; the peak is about 3x the context at
    call 2, so the re-estimate learns from the peaks of the tasks it trains on."""
    rng = np.random.default_rng(seed)
    calls: dict[str, tuple[list[int], list[int]]] = {}
    peaks = []
    for i in range(n):
        first = int(rng.integers(1_000, 3_000))
        prompts = [int(first * (1 + 0.5 * j * rng.uniform(0.5, 1.5))) for j in range(int(rng.integers(2, 12)))]
        calls[f"s{i}"] = (prompts, [100] * len(prompts))
        peaks.append(max(prompts[-1], int(3 * prompts[1] * rng.lognormal(0, 0.2))))
    frame = pd.DataFrame({"session_id": list(calls), "benchmark": "b", "task_id": [f"t{i // 2}" for i in range(n)],
                          "peak_prompt_tokens": peaks})
    return frame, calls, rng.uniform(1_000, 50_000, n)


def test_a_sessions_re_estimate_does_not_move_when_its_own_tasks_peaks_do_while_an_in_sample_fit_does() -> None:
    frame, calls, first = _sessions()
    before = out_of_fold_rows("b", frame, calls, first, seed=1, outer_folds=5, inner_folds=3)
    assert set(before.columns) == {"session_id", "benchmark", "k", "online_predicted", "fold"}
    assert set(before["k"]) <= set(SLOTS) and 2 in set(before["k"])
    reached = {(sid, k) for sid, (p, _) in calls.items() for k in SLOTS if len(p) >= k}
    assert set(zip(before["session_id"], before["k"], strict=True)) <= reached
    for sid, k, peak in zip(before["session_id"], before["k"], before["online_predicted"], strict=True):
        assert peak >= calls[sid][0][k - 1]  # clamped as served: at least the context at call k
    task = frame["task_id"] == "t3"  # its sessions' peaks x 50: only a model that saw task t3 notices
    changed = frame.assign(peak_prompt_tokens=np.where(task, frame["peak_prompt_tokens"] * 50,
                                                       frame["peak_prompt_tokens"]))
    after = out_of_fold_rows("b", changed, calls, first, seed=1, outer_folds=5, inner_folds=3)
    own = before["session_id"].isin(frame.loc[task, "session_id"])
    assert own.sum() >= 2
    np.testing.assert_array_equal(after.loc[own, "online_predicted"], before.loc[own, "online_predicted"])
    assert not np.allclose(after.loc[~own, "online_predicted"], before.loc[~own, "online_predicted"])
    # the fixture tells the two apart: an in-sample fit (on all rows, t3 included) moves t3's re-estimate
    for rows in (frame, changed):
        part = slice_at(rows, calls, first, 2)
        weights, intercept = Choice((1,), 1.0).fit(part.x, part.log_peak)
        rows.attrs["in_sample"] = predict(weights, intercept, part.x)[np.isin(part.rows, np.flatnonzero(task))]
    assert (changed.attrs["in_sample"] > 1.05 * frame.attrs["in_sample"]).all()


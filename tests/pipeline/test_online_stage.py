"""The online stage's nested protocol on data where the answer is known."""

from __future__ import annotations

import numpy as np
import pandas as pd

from basin_pipeline.online import Slice, nested_scores
from basin_runtime.online import FEATURES, features


def _known(seed: int, n: int = 150) -> tuple[pd.DataFrame, Slice]:
    """Sessions whose peak is 3x their context at call 3 (times noise), with a first-call prediction that is
    pure noise: a re-estimate from the context must rank the peak far better than the first call."""
    rng = np.random.default_rng(seed)
    first_prompt = rng.integers(1_000, 3_000, n)
    context = first_prompt * rng.uniform(1.0, 8.0, n)
    peak = 3 * context * rng.lognormal(0, 0.2, n)
    first_call = rng.uniform(1_000, 50_000, n)
    x = np.asarray([features(float(f), [int(a), int((a + c) / 2), int(c)], [50, 50])
                    for f, a, c in zip(first_call, first_prompt, context, strict=True)])
    frame = pd.DataFrame({"benchmark": "b", "task_id": [f"t{i // 2}" for i in range(n)]})
    return frame, Slice(x, np.log1p(peak), context, first_call, np.arange(n))


def test_the_re_estimate_beats_a_noise_first_call_and_reservations_cover_about_q() -> None:
    frame, part = _known(3)
    scores = nested_scores(frame, part, [1, 2], outer_folds=5, inner_folds=3)
    assert len(FEATURES) == part.x.shape[1] and scores["sessions"] == 150
    assert scores["online"]["mean"] > 0.8 and abs(scores["first_call"]["mean"]) < 0.2
    assert scores["context"]["mean"] > 0.8
    online, first = scores["reservations_q0.9"]["online"], scores["reservations_q0.9"]["first_call"]
    assert abs(online["coverage"]["mean"] - 0.9) < 0.06 and abs(first["coverage"]["mean"] - 0.9) < 0.06
    assert online["reserved_over_used"]["mean"] < first["reserved_over_used"]["mean"]  # it knows more

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import pytest

from basin_runtime.session_table import Call, Session, to_table
from basin_sim.workload.presets import (
    CALIBRATION_SEED,
    CALIBRATION_SESSIONS,
    PRESETS,
    PresetError,
    calibrate,
    generate_preset,
    pool_statistics,
    preset_family,
    preset_pool,
)
from basin_sim.workload.synthetic import family_named, generate_corpus
from basin_sim.workload.tool_time import TOOL_TIME

PAPER = PRESETS["paper-terminal-bench"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_paper_preset_meets_the_paper_statistics_on_fresh_seeds(seed: int) -> None:
    stats = pool_statistics(preset_pool("paper-terminal-bench", seed, 1000))
    assert stats.median_prompt_tokens == pytest.approx(25_600, rel=0.03)
    assert stats.median_reuse == pytest.approx(0.982, abs=0.001)


def test_the_stored_scales_are_the_calibration_fixed_point() -> None:
    assert calibrate(PAPER) == PAPER  # refitting from the constants moves nothing
    stats = pool_statistics(generate_preset(PAPER, CALIBRATION_SEED, CALIBRATION_SESSIONS))
    assert stats.median_prompt_tokens == pytest.approx(25_600, rel=0.002)
    assert stats.median_reuse == pytest.approx(0.982, abs=0.0002)


def test_calibration_from_unscaled_reaches_both_targets() -> None:
    start = replace(PAPER, first_prompt_scale=1.0, tool_output_scale=1.0)
    assert pool_statistics(generate_preset(start, 5, 100)).median_prompt_tokens < 10_000  # the base family
    fitted = calibrate(start, seed=5, num_sessions=100)
    stats = pool_statistics(generate_preset(fitted, 5, 100))
    assert stats.median_prompt_tokens == pytest.approx(25_600, rel=0.002)
    assert stats.median_reuse == pytest.approx(0.982, abs=0.0002)
    assert fitted.first_prompt_scale > 5


def test_same_seed_same_pool_other_seed_other_pool_and_smaller_pools_are_prefixes() -> None:
    pool = preset_pool("paper-terminal-bench", 5, 40)
    assert pool == preset_pool("paper-terminal-bench", 5, 40)
    assert pool != preset_pool("paper-terminal-bench", 6, 40)
    assert preset_pool("paper-terminal-bench", 5, 15) == pool[:15]


def test_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(PresetError, match=r"unknown preset 'paper-swe'.*paper-terminal-bench"):
        preset_pool("paper-swe", 1)
    with pytest.raises(PresetError, match="at least 1"):
        preset_pool("paper-terminal-bench", 1, 0)


def test_sessions_keep_the_base_family_shape_and_draw_gaps_from_the_tool_time_model() -> None:
    pool = preset_pool("paper-terminal-bench", 2, 600)
    base = generate_corpus(2, 600, [family_named(PAPER.base_family)])
    for stat in ("n_calls", "task_chars"):
        assert statistics.median(getattr(s, stat) for s in pool) == pytest.approx(
            statistics.median(getattr(s, stat) for s in base), rel=0.1), stat
    completions = [c.completion_tokens for s in pool for c in s.calls]
    assert statistics.median(completions) == pytest.approx(
        statistics.median(c.completion_tokens for s in base for c in s.calls), rel=0.1)
    first = statistics.median(s.first_prompt_tokens for s in pool)
    assert first == pytest.approx(statistics.median(s.first_prompt_tokens for s in base) * PAPER.first_prompt_scale,
                                  rel=0.05)
    gaps = [g for s in pool for c in s.calls[:-1] if (g := c.gap_s) is not None]
    assert len(gaps) == sum(s.n_calls - 1 for s in pool)
    model = TOOL_TIME[PAPER.gap_model]
    for q in (0.5, 0.9):
        assert np.quantile(gaps, q) == pytest.approx(model.quantile_s(q), rel=0.1), q
    assert all(s.calls[-1].gap_s is None and s.benchmark == "paper-terminal-bench" for s in pool)
    assert to_table(pool).num_rows == 600  # valid session-table rows, unique ids


def test_preset_family_scales_only_the_first_prompt_and_the_tool_output() -> None:
    base, family = family_named(PAPER.base_family), preset_family(PAPER)
    assert family == replace(base, benchmark=PAPER.name, first_prompt_tokens=family.first_prompt_tokens,
                             tool_output_tokens=family.tool_output_tokens)
    first_scale = np.exp(family.first_prompt_tokens.mu - base.first_prompt_tokens.mu)
    assert first_scale == pytest.approx(PAPER.first_prompt_scale)
    assert np.exp(family.tool_output_tokens.mu - base.tool_output_tokens.mu) == pytest.approx(PAPER.tool_output_scale)
    assert family.first_prompt_tokens.sigma == base.first_prompt_tokens.sigma


def _session(prompts: list[int]) -> Session:
    calls = tuple(Call(p, 10, None, None, 1.0 if k + 1 < len(prompts) else None) for k, p in enumerate(prompts))
    return Session(f"s{prompts}", "b", "test", "a", "m", "t", "task", "", "qwen3.6", calls)


def test_pool_statistics_by_hand() -> None:
    stats = pool_statistics([_session([100, 200, 400]), _session([1000, 1250]), _session([50])])
    assert stats.median_prompt_tokens == 300  # of 50, 100, 200 | 400, 1000, 1250
    assert stats.median_reuse == 0.5  # of 0.5, 0.5, 0.8
    with pytest.raises(PresetError, match="second call"):
        pool_statistics([_session([50])])

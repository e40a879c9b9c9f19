"""The serving model's timing: reasoning decoded per call, its scale, files; tool time is not the timing's."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from basin_sim import catalog
from basin_sim.workload import serving
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.scenarios import WorkloadSpec
from tests.sim.builders import session

SHIPPED = "qwen3.6-35b-a3b"


def pool(n: int = 400, benchmark: str = "terminal-bench") -> list:  # type: ignore[type-arg]
    return [session(f"s{k}", [1000, 1500, 2100, 2800], completion=50, gap_s=0.5, benchmark=benchmark)
            for k in range(n)]


def test_reasoning_is_decoded_on_top_of_the_visible_answer_and_prompts_stay_as_recorded() -> None:
    timing = serving.load_timing(SHIPPED, reasoning_scale=1.0)
    base = pool()
    served = [timing.apply(s) for s in base]
    extra = [c.completion_tokens - 50 for s in served for c in s.calls]
    assert all(0 <= e <= timing.reasoning.max for e in extra)
    # median of the draws near the file's median (1,600 draws of a sigma-1.34 log-normal: within 12%)
    assert statistics.median(extra) == pytest.approx(timing.reasoning.median, rel=0.12)
    assert [c.prompt_tokens for s in served for c in s.calls] == [c.prompt_tokens for s in base for c in s.calls]


def test_the_timing_leaves_every_gap_as_it_was() -> None:
    timing = serving.load_timing(SHIPPED, 1.0)
    base = pool()
    assert [c.gap_s for s in (timing.apply(s) for s in base) for c in s.calls] == [c.gap_s for s in base
                                                                                   for c in s.calls]


def test_a_session_gets_the_same_timing_in_every_pool_and_zero_scales_give_the_recorded_session() -> None:
    timing = serving.load_timing(SHIPPED, 1.3)
    a, b = timing.apply(pool(3)[2]), timing.apply(pool(5)[2])
    assert a == b
    assert timing.apply(pool(3)[0]) != a  # another id, another stream
    zero = serving.load_timing(SHIPPED, 0.0)
    assert [zero.apply(s) for s in pool(5)] == pool(5)  # zero draws still advance the stream: same later calls


def test_the_workload_pool_applies_the_timing_and_recorded_leaves_it_alone() -> None:
    base = pool(20)
    recorded = workload_pool(base, WorkloadSpec(benchmarks=("terminal-bench",)))
    served = workload_pool(base, WorkloadSpec(benchmarks=("terminal-bench",), timing=SHIPPED, reasoning_scale=1.0))
    assert sum(c.completion_tokens for s in served for c in s.calls) > sum(
        c.completion_tokens for s in recorded for c in s.calls)
    assert [c.prompt_tokens for s in served for c in s.calls] == [c.prompt_tokens for s in recorded for c in s.calls]


def test_without_scales_the_fit_files_values_are_used_and_without_a_fit_file_it_is_an_error(tmp_path: Path) -> None:
    text = serving.timing_path(SHIPPED).read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text(text)
    with pytest.raises(serving.TimingError, match=r"no fit file .*mine\.fit\.yaml.*timing_fit"):
        serving.load_timing(str(mine))
    (tmp_path / "mine.fit.yaml").write_text("fitted: {reasoning_scale: 1.5}\n")
    assert serving.load_timing(str(mine)).reasoning_scale == 1.5
    assert serving.load_timing(str(mine), reasoning_scale=3.0).reasoning_scale == 3.0
    (tmp_path / "mine.fit.yaml").write_text("fitted: {reasoning_scale: 1.5, harness_scale: 0.25}\n")
    with pytest.raises(serving.TimingError, match=r"mine\.fit\.yaml: needs fitted: \{reasoning_scale\}"):
        serving.load_timing(str(mine))


@pytest.mark.parametrize(("edit", "message"), [
    (("median: 600", "median: -1"), r"reasoning_tokens\.median must be a finite number >= 0"),
    (("name: qwen3.6-35b-a3b\n", "name: qwen3.6-35b-a3b\nharness_s: {default: {median: 1, sigma: 1, max: 60}}\n"),
     r"needs model, reasoning_tokens .*tool time is workload\.tool_time's"),
    (("reasoning_tokens:", "reasoning:"), r"needs model, reasoning_tokens"),
    (("range: [0.36, 4.8]", "range: [4.8, 0.36]"), r"free\.reasoning_scale\.range needs low < high"),
])
def test_a_bad_timing_file_is_refused_naming_the_file_and_key(tmp_path: Path, edit: tuple[str, str],
                                                               message: str) -> None:
    text = serving.timing_path(SHIPPED).read_text()
    assert edit[0] in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(serving.TimingError, match=message) as info:
        serving.load_timing(str(bad), 1.0)
        serving.free_parameters(str(bad))
    assert "bad.yaml" in str(info.value)


def test_scenario_files_take_a_timing_and_refuse_an_unknown_one_or_scales_without_one(tmp_path: Path) -> None:
    base = "name: t\nduration_s: 600\nwarmup_s: 60\nrate: [{from_s: 0, per_min: 3.3}]\n" \
           "goodput_window: {from_s: 0, to_s: 600}\n"
    good = tmp_path / "good.yaml"
    good.write_text(base + f"workload: {{timing: {SHIPPED}, reasoning_scale: 2.0}}\n")
    workload = catalog.load_scenario(str(good)).workload
    assert (workload.timing, workload.reasoning_scale, workload.tool_time) == (SHIPPED, 2.0, "sourced")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(base + "workload: {timing: gpt-9, reasoning_scale: 1.0}\n")
    with pytest.raises(catalog.CatalogError, match=r"unknown\.yaml: workload\.timing: no timing 'gpt-9'.*qwen3\.6"):
        catalog.load_scenario(str(unknown))
    orphan = tmp_path / "orphan.yaml"
    orphan.write_text(base + "workload: {reasoning_scale: 1.0}\n")
    with pytest.raises(catalog.CatalogError, match=r"orphan\.yaml: workload\.reasoning_scale needs a serving timing"):
        catalog.load_scenario(str(orphan))


def test_the_free_parameters_and_their_ranges_come_from_the_file() -> None:
    ranges = serving.free_parameters(SHIPPED)
    assert set(ranges) == {"reasoning_scale"}  # tool time is sourced, not fitted
    low, high = ranges["reasoning_scale"]
    median = serving.load_timing(SHIPPED, 1.0).reasoning.median
    # the range's ends are the measured ends the file cites: 214 and ~2,900 tokens per call
    assert low * median == pytest.approx(214, rel=0.02) and high * median == pytest.approx(2_880, rel=0.02)
    assert math.isfinite(high)

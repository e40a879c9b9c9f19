"""Named synthetic pools (`paper-terminal-bench`, ...) calibrated to published trajectory statistics.

Rules:
- A preset is a synthetic family (synthetic.py) derived from one of FAMILIES, whose session shape it
  keeps: calls per session, completion sizes, task texts, the spread and tail of the growth per call
  (all fitted there on our real sessions). Two scales move the family's first prompt and its tool
  output per call; `calibrate` fits them so that the pool meets the preset's two targets.
- Statistics (`pool_statistics`): median prompt = the median over every call of `prompt_tokens`;
  reuse of call k >= 1 = prompt_{k-1} / prompt_k, the share of its prompt already sent in the previous
  call (each prompt is the previous prompt + the previous completion + new tool output); median reuse
  = the median over those calls.
- Tool gaps are drawn from the preset's tool-time model (tool_time.TOOL_TIME[gap_model]), measured gaps
  of a real corpus, rather than from the base family's log-normal.
- Deterministic: the same name, seed and size give the same sessions; sessions come one after another
  from one stream, so a pool of n is the first n sessions of any larger pool of that seed.
- The scales below are printed by `python -m basin_sim.workload.presets --calibrate NAME`
  (CALIBRATION_SEED, CALIBRATION_SESSIONS); a test checks fresh seeds still meet the targets.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from basin_runtime.session_table import Session
from basin_sim.workload.synthetic import Family, LogNormal, family_named, synthetic_session
from basin_sim.workload.tool_time import TOOL_TIME

DEFAULT_NUM_SESSIONS = 300
CALIBRATION_SEED = 20260417
CALIBRATION_SESSIONS = 2000


class PresetError(ValueError):
    """An unknown preset name or an impossible pool size; the message names the known presets."""


@dataclass(frozen=True)
class Preset:
    """A target pool: a base family, its two calibrated scales and the statistics they were fitted to."""

    name: str
    description: str
    base_family: str  # a synthetic.FAMILIES benchmark whose session shape the preset keeps
    gap_model: str  # a tool_time.TOOL_TIME benchmark its tool gaps are drawn from
    target_median_prompt_tokens: float
    target_median_reuse: float
    first_prompt_scale: float  # x the base family's first prompt (calibrated)
    tool_output_scale: float  # x the base family's tool output per call (calibrated)


@dataclass(frozen=True)
class PoolStatistics:
    """The two statistics a preset is calibrated to (see the rules above)."""

    median_prompt_tokens: float
    median_reuse: float


PRESETS: Mapping[str, Preset] = {
    "paper-terminal-bench": Preset(
        "paper-terminal-bench",
        "the paper's Terminal-Bench trajectories: median prompt 25.6K tokens, 98.2% of each prompt sent in "
        "the previous call; our Terminal-Bench sessions' calls and completions, its measured tool time",
        base_family="synthetic-terminal", gap_model="terminal-bench",
        target_median_prompt_tokens=25_600, target_median_reuse=0.982,
        first_prompt_scale=18.4196, tool_output_scale=1.1244),
}


def preset_named(name: str) -> Preset:
    """The preset of that name, or PresetError naming the known ones."""
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_family(preset: Preset) -> Family:
    """The base family with the preset's name and its first prompt and tool output scaled."""
    base = family_named(preset.base_family)
    first, output = base.first_prompt_tokens, base.tool_output_tokens
    return replace(base, benchmark=preset.name,
                   first_prompt_tokens=LogNormal(first.mu + math.log(preset.first_prompt_scale), first.sigma),
                   tool_output_tokens=LogNormal(output.mu + math.log(preset.tool_output_scale), output.sigma))


def generate_preset(preset: Preset, seed: int, num_sessions: int) -> list[Session]:
    """`num_sessions` sessions of a preset, the same for the same seed."""
    if num_sessions < 1:
        raise PresetError(f"preset {preset.name!r}: num_sessions must be at least 1, got {num_sessions}")
    family, gaps = preset_family(preset), TOOL_TIME[preset.gap_model]
    rng = random.Random(seed)
    return [synthetic_session(rng, family, i, gaps.sample_s) for i in range(num_sessions)]


def preset_pool(name: str, seed: int, num_sessions: int = DEFAULT_NUM_SESSIONS) -> list[Session]:
    """The named preset's pool of `num_sessions` sessions, deterministic by seed."""
    return generate_preset(preset_named(name), seed, num_sessions)


def pool_statistics(sessions: Sequence[Session]) -> PoolStatistics:
    """Median prompt over all calls, and median share of each prompt sent in the previous call."""
    prompts = [c.prompt_tokens for s in sessions for c in s.calls]
    reuse = [a.prompt_tokens / b.prompt_tokens for s in sessions for a, b in zip(s.calls, s.calls[1:], strict=False)]
    if not reuse:
        raise PresetError("no session in the pool has a second call: reuse is undefined")
    return PoolStatistics(float(statistics.median(prompts)), float(statistics.median(reuse)))


def calibrate(preset: Preset, seed: int = CALIBRATION_SEED, num_sessions: int = CALIBRATION_SESSIONS,
              iterations: int = 40) -> Preset:
    """The preset with scales fitted so its pool meets both targets (fixed-point, multiplicative steps)."""
    current = preset
    for _ in range(iterations):
        stats = pool_statistics(generate_preset(current, seed, num_sessions))
        prompt_step = preset.target_median_prompt_tokens / stats.median_prompt_tokens
        growth_step = (1 - preset.target_median_reuse) / (1 - stats.median_reuse)  # new tokens per prompt
        if abs(prompt_step - 1) < 1e-4 and abs(growth_step - 1) < 1e-4:
            break
        current = replace(current, first_prompt_scale=round(current.first_prompt_scale * prompt_step, 4),
                          tool_output_scale=round(current.tool_output_scale * growth_step * prompt_step, 4))
    return current


def main(argv: list[str] | None = None) -> int:
    """Print a preset's calibrated scales and the statistics of its calibration pool."""
    parser = argparse.ArgumentParser(prog="python -m basin_sim.workload.presets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", required=True, metavar="NAME", help=f"one of: {', '.join(sorted(PRESETS))}")
    args = parser.parse_args(argv)
    try:
        fitted = calibrate(preset_named(args.calibrate))
    except PresetError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    stats = pool_statistics(generate_preset(fitted, CALIBRATION_SEED, CALIBRATION_SESSIONS))
    print(f"# {fitted.name}: median prompt {stats.median_prompt_tokens:.0f} tokens "
          f"(target {fitted.target_median_prompt_tokens:.0f}), median reuse {stats.median_reuse:.4f} "
          f"(target {fitted.target_median_reuse})")
    print(f"first_prompt_scale={fitted.first_prompt_scale}, tool_output_scale={fitted.tool_output_scale}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Session timing of the serving model: what each call decodes on top of the recorded answer.

The recorded sessions were run by other models (Terminal-Bench: Claude Sonnet 4's visible answers).
The paper's agents were served by Qwen3.6-35B-A3B, a reasoning model. A *timing* describes that
serving model's calls on top of a recorded (or preset) session's prompt sizes:

- ``timing: recorded`` (the default) replays the recorded completions.
- ``timing: NAME`` reads ``basin_sim/workload/serving/NAME.yaml``. Per call, the engine decodes the
  recorded visible completion plus ``reasoning`` tokens drawn from a log-normal (median x
  ``reasoning_scale``, the file's sigma, capped at the file's ``max``). The next prompt does not carry
  them (the model's chat template drops earlier turns' thinking), so the recorded prompt sizes stay.
- Tool time is not the timing's: it comes from published measurements (workload/tool_time.py,
  ``workload.tool_time``), so the timing has one free parameter, ``reasoning_scale``. Unless a scenario
  sets it, it is the value in ``NAME.fit.yaml`` beside the file, written by
  ``python -m basin_sim.experiments.calibrate.timing_fit`` from the paper's steady 1P1D facts only; a timing without
  a fit file needs the scale given.
- Draws are seeded by the session id (one stream per pool session), so a session's timing, and with
  it its unloaded time, is the same in every run and seed; one draw per call, in call order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from basin_runtime.session_table import Session

SERVING_DIR = Path(__file__).resolve().parent / "serving"
RECORDED = "recorded"
SCALES = ("reasoning_scale",)  # a timing's free parameters


class TimingError(ValueError):
    """A timing file or value that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class CappedLogNormal:
    """A log-normal by its median and sigma, capped at `max`."""

    median: float
    sigma: float
    max: float

    def sample(self, rng: random.Random, scale: float) -> float:
        """One draw with the median multiplied by `scale`."""
        if scale == 0 or self.median == 0:
            rng.random()  # keep the stream's position independent of the scale
            rng.random()
            return 0.0
        z = _normal(rng)
        return min(self.max, self.median * scale * math.exp(self.sigma * z))


def _normal(rng: random.Random) -> float:
    """A standard normal from two uniforms (Box-Muller), so each draw uses exactly two `rng.random()`."""
    u1 = 1.0 - rng.random()  # in (0, 1]
    u2 = rng.random()
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@dataclass(frozen=True)
class Timing:
    """A serving model's per-call reasoning, with its scale resolved."""

    name: str
    model: str
    reasoning: CappedLogNormal
    reasoning_scale: float

    def apply(self, session: Session) -> Session:
        """The session as this serving model runs it (see the module rules)."""
        seed = int.from_bytes(hashlib.sha256(f"timing:{session.session_id}".encode()).digest()[:8], "big")
        rng = random.Random(seed)
        calls = []
        for call in session.calls:
            reasoning = round(self.reasoning.sample(rng, self.reasoning_scale))
            calls.append(dataclasses.replace(call, completion_tokens=call.completion_tokens + reasoning))
        return dataclasses.replace(session, calls=tuple(calls))


def timing_path(name: str) -> Path:
    """The file of a named timing (or `name` itself when it is a .yaml path)."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        return path
    return SERVING_DIR / f"{name}.yaml"


def fit_path(path: Path) -> Path:
    """The fit file beside a timing file."""
    return path.with_name(path.stem + ".fit.yaml")


def known_timings() -> list[str]:
    """The shipped timings' names (and `recorded`)."""
    return [RECORDED, *sorted(p.stem for p in SERVING_DIR.glob("*.yaml") if not p.stem.endswith(".fit"))]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TimingError(f"timing file {path}: cannot be read ({exc}); known timings: {known_timings()}") from exc
    except yaml.YAMLError as exc:
        raise TimingError(f"timing file {path}: not YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise TimingError(f"timing file {path}: must be a mapping, got {type(data).__name__}")
    return data


def _lognormal(path: Path, where: str, raw: object) -> CappedLogNormal:
    needed = {"median", "sigma", "max"}
    if not isinstance(raw, Mapping) or set(raw) - needed - {"source"} or not needed <= set(raw):
        raise TimingError(f"timing file {path}: {where} needs median, sigma, max (and an optional source), got {raw!r}")
    return CappedLogNormal(**{key: check_scale(f"timing file {path}", f"{where}.{key}", raw[key]) for key in needed})


def check_scale(path: Path | str, key: str, value: object) -> float:
    """A finite number >= 0 (a scale, a median, a cap) as a float, or TimingError naming where it came from."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TimingError(f"{path}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


def fitted_scales(path: Path) -> dict[str, float] | None:
    """The scales a fit file holds, or None without one."""
    fit = fit_path(path)
    if not fit.exists():
        return None
    data = _read(fit)
    fitted = data.get("fitted")
    if not isinstance(fitted, Mapping) or set(fitted) != set(SCALES):
        raise TimingError(f"fit file {fit}: needs fitted: {{{', '.join(SCALES)}}}, got {fitted!r}")
    return {key: check_scale(fit, f"fitted.{key}", value) for key, value in fitted.items()}


def load_timing(name: str, reasoning_scale: float | None = None) -> Timing:
    """A named timing with its scale: the given one, else the fit file's (TimingError without either)."""
    if name == RECORDED:
        raise TimingError("`recorded` is the recorded timing itself: nothing to load")
    path = timing_path(name)
    if not path.exists():
        raise TimingError(f"no timing {name!r} (looked for {path}); known timings: {known_timings()}")
    data = _read(path)
    known = {"name", "model", "reasoning_tokens", "free"}
    if set(data) - known or not {"model", "reasoning_tokens"} <= set(data):
        raise TimingError(f"timing file {path}: keys {sorted(data)}; needs model, reasoning_tokens "
                          f"(name and free optional; tool time is workload.tool_time's, not the timing's)")
    if reasoning_scale is None:
        fitted = fitted_scales(path)
        if fitted is None:
            raise TimingError(f"timing {name!r} has no fit file ({fit_path(path)}): give reasoning_scale, or fit "
                              f"it with `python -m basin_sim.experiments.calibrate.timing_fit`")
        reasoning_scale = fitted["reasoning_scale"]
    return Timing(name=str(data.get("name", path.stem)), model=str(data["model"]),
                  reasoning=_lognormal(path, "reasoning_tokens", data["reasoning_tokens"]),
                  reasoning_scale=check_scale(path, "reasoning_scale", reasoning_scale))


def check_timing(name: str, reasoning_scale: float | None = None) -> None:
    """Check a timing as a scenario names it: its file, and its fit file when one is there (a scenario is
    loadable before its timing is fitted: `timing_fit` itself runs one, with the scale given)."""
    if reasoning_scale is None and not fit_path(timing_path(name)).exists():
        load_timing(name, reasoning_scale=1.0)
        return
    load_timing(name, reasoning_scale)


def free_parameters(name: str) -> dict[str, tuple[float, float]]:
    """The free parameters of a timing file and the range each may be fitted in (its `free` block)."""
    path = timing_path(name)
    free = _read(path).get("free")
    if not isinstance(free, Mapping) or set(free) != set(SCALES):
        raise TimingError(f"timing file {path}: free must list {', '.join(SCALES)}, got {free!r}")
    ranges = {}
    for key, raw in free.items():
        if not isinstance(raw, Mapping) or not isinstance(raw.get("range"), list) or len(raw["range"]) != 2:
            raise TimingError(f"timing file {path}: free.{key} needs range: [low, high], got {raw!r}")
        low, high = (check_scale(path, f"free.{key}.range", v) for v in raw["range"])
        if not low < high:
            raise TimingError(f"timing file {path}: free.{key}.range needs low < high, got {raw['range']}")
        ranges[key] = (low, high)
    return ranges

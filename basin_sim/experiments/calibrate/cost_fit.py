"""Fit the cost model's constants to public measurements and the paper's anchors.

`python -m basin_sim.experiments.calibrate.cost_fit`.

Rules:
- The measurements file (profiles/<profile>.measurements.yaml) is checked whole before anything is
  fitted: a missing or unknown field, a wrong kind of value, an unknown model or GPU raises
  `MeasurementError` naming the file, the point's id and the field.
- The formulas are the profile's own (basin_sim/profile.py): a point of another model or GPU is
  evaluated by a Profile carrying that model's architecture (bytes, experts, FLOPs) and that GPU's
  peaks, with the shared hardware constants (`Hardware`). Each prediction is linear in
  x = (prefill_batch_fixed_s, 1/linear_eff, 1/attention_eff, decode_step_fixed_s, 1/hbm_eff), so the
  public fit is a closed-form linear least squares on relative errors; linearity is asserted.
- The paper's anchors need the engine: `simulate_anchors` runs the steady scenario on 1p1d at the
  paper's rate on its benchmark's sessions (one seed unless told). TTFT moves one for one with the
  per-request PD overhead (`Profile.pd_request_overhead_s`, in every request's transfer), so that one
  constant is solved by a few simulated runs (secant steps, exact when the shift is uniform); the
  hit rate and busy share are printed as checks, and with --overload the overload rate (the paper's
  ~6.6 sessions/min; a minute of trials).
- `--write` rewrites only the fitted numbers' lines of the profile yaml (its header is kept; the
  header's per-point table is the fit's printout, to be pasted by hand when the points change).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from basin_runtime.logs import BARE_LINE, configure_logging
from basin_runtime.session_table import Session
from basin_sim.catalog import PROFILES_DIR, CatalogError, load_profile, load_scenario
from basin_sim.experiments.calibrate.overload import find_overload_rate
from basin_sim.profile import Deployment, Profile
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload.pool import PoolError, load_pool, workload_pool
from basin_sim.workload.scenarios import RateStep, WorkloadSpec

log = logging.getLogger(__name__)

PUBLIC_KINDS = ("decode_step", "prefill", "request", "prefill_stream")
PAPER_KINDS = ("paper_ttft_p50", "paper_hit_rate", "paper_prefill_busy", "paper_overload_per_min")
DEFAULT_PROFILE = "h100-qwen3.6-35b-a3b"
GPU_FIELDS = {"hbm_bytes_per_s": float, "bf16_flops": float, "fp8_flops": float}
MODEL_FIELDS = {"weight_dtype": str, "linear_flops_per_token": float, "attention_flops_per_pair": float,
                "dense_weight_bytes": float, "expert_weight_bytes": float, "experts_total": int,
                "experts_per_token": int, "kv_read_bytes_per_token": float, "state_bytes_per_request": float}
POINT_REQUIRED = {"id": str, "kind": str, "model": str, "gpu": str, "engine": str, "value": float, "source": str,
                  "quote": str, "conversion": str, "fit": bool}
POINT_OPTIONAL = {"batch_size": float, "context_tokens": float, "input_tokens": int, "output_tokens": int,
                  "chunk_tokens": int, "tolerance_rel": float, "why_not_fitted": str, "rate_per_min": float,
                  "benchmark": str, "requests": int}
PAPER_NEEDS = ("rate_per_min", "benchmark")
KIND_NEEDS = {"decode_step": ("batch_size", "context_tokens"), "prefill": ("input_tokens",),
              "request": ("input_tokens", "output_tokens"),
              "prefill_stream": ("requests", "input_tokens", "output_tokens"),
              **{kind: PAPER_NEEDS for kind in PAPER_KINDS}}
FITTED_FIELDS = ("prefill_batch_fixed_s", "prefill_token_s", "prefill_attention_pair_s", "decode_step_fixed_s",
                 "hbm_bytes_per_s", "pd_request_overhead_s")


class MeasurementError(ValueError):
    """A measurements file that cannot be used; the message names the file, the point and the field."""


class FitError(RuntimeError):
    """The points do not pin the constants to physical values (the message says which)."""


@dataclass(frozen=True)
class Gpu:
    """Peak HBM bandwidth and dense tensor FLOP/s by dtype (0: the GPU has no such tensor cores)."""

    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float = 0.0


@dataclass(frozen=True)
class Model:
    """What a step of one model costs in FLOPs and bytes (see the measurements file's `models`)."""

    weight_dtype: str
    linear_flops_per_token: float
    attention_flops_per_pair: float
    dense_weight_bytes: float
    expert_weight_bytes: float
    experts_total: int
    experts_per_token: int
    kv_read_bytes_per_token: float
    state_bytes_per_request: float


@dataclass(frozen=True)
class Point:
    """One measured number with what it measured and where it comes from."""

    id: str
    kind: str
    model: str
    gpu: str
    engine: str
    value: float
    source: str
    quote: str
    conversion: str
    fit: bool
    batch_size: float = 0.0
    context_tokens: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    chunk_tokens: int = 8192
    tolerance_rel: float | None = None
    why_not_fitted: str = ""
    rate_per_min: float = 0.0
    benchmark: str = ""
    requests: int = 1


@dataclass(frozen=True)
class Measurements:
    """The whole file: target model and GPU, the tables, the points and the default tolerance."""

    path: Path
    target_model: str
    target_gpu: str
    tolerance_rel: float
    gpus: Mapping[str, Gpu]
    models: Mapping[str, Model]
    points: tuple[Point, ...]

    def tolerance(self, point: Point) -> float:
        """The relative error the shipped profile must stay within at `point`."""
        return self.tolerance_rel if point.tolerance_rel is None else point.tolerance_rel


@dataclass(frozen=True)
class Hardware:
    """What carries over between models and GPUs: fixed times and fractions of peak."""

    prefill_batch_fixed_s: float
    linear_efficiency: float
    attention_efficiency: float
    decode_step_fixed_s: float
    hbm_efficiency: float

    def vector(self) -> np.ndarray:
        """x, in which every prediction is linear."""
        return np.array([self.prefill_batch_fixed_s, 1 / self.linear_efficiency, 1 / self.attention_efficiency,
                         self.decode_step_fixed_s, 1 / self.hbm_efficiency])

    @classmethod
    def of_vector(cls, x: Sequence[float] | np.ndarray) -> Hardware:
        """The constants of a vector x (see `vector`)."""
        return cls(float(x[0]), 1 / float(x[1]), 1 / float(x[2]), float(x[3]), 1 / float(x[4]))


# ---- the file ----------------------------------------------------------------------------------

def _typed(where: str, data: Mapping[str, Any], fields: Mapping[str, type], required: set[str]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise MeasurementError(f"{where}: expected a mapping, got {data!r}")
    missing, unknown = sorted(required - data.keys()), sorted(data.keys() - fields.keys())
    if missing or unknown:
        raise MeasurementError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        kind = fields[key]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = (is_number and (kind is float or float(value).is_integer()) if kind in (int, float)
              else isinstance(value, kind))
        if not ok or (is_number and (not math.isfinite(value) or value < 0)):
            raise MeasurementError(f"{where}: field {key!r} must be {kind.__name__} (finite, >= 0), got {value!r}")
        out[key] = int(value) if kind is int else float(value) if kind is float else value
    return out


def load_measurements(path: Path) -> Measurements:
    """Read and check a measurements file (see the rules above)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MeasurementError(f"{path}: cannot read: {exc}") from exc
    top = _typed(str(path), data, {"schema": int, "tolerance_rel": float, "target": dict, "gpus": dict,
                                   "models": dict, "points": list}, {"schema", "tolerance_rel", "target",
                                                                     "gpus", "models", "points"})
    gpus = {name: Gpu(**_typed(f"{path}: gpus.{name}", spec, GPU_FIELDS, {"hbm_bytes_per_s", "bf16_flops"}))
            for name, spec in top["gpus"].items()}
    models = {name: Model(**_typed(f"{path}: models.{name}", spec, MODEL_FIELDS, set(MODEL_FIELDS)))
              for name, spec in top["models"].items()}
    target = _typed(f"{path}: target", top["target"], {"model": str, "gpu": str}, {"model", "gpu"})
    points: list[Point] = []
    for index, raw in enumerate(top["points"]):
        name = raw.get("id", f"#{index}") if isinstance(raw, Mapping) else f"#{index}"
        where = f"{path}: point {name}"
        fields = _typed(where, raw, {**POINT_REQUIRED, **POINT_OPTIONAL}, set(POINT_REQUIRED))
        point = Point(**fields)
        if point.kind not in KIND_NEEDS:
            raise MeasurementError(f"{where}: field 'kind' must be one of {sorted(KIND_NEEDS)}, got {point.kind!r}")
        for field in KIND_NEEDS[point.kind]:
            if field not in fields:
                raise MeasurementError(f"{where}: kind {point.kind!r} needs field {field!r}")
        for field, table in (("model", models), ("gpu", gpus)):
            if getattr(point, field) not in table:
                raise MeasurementError(f"{where}: field {field!r}: unknown {getattr(point, field)!r}, "
                                       f"known: {sorted(table)}")
        if point.value <= 0 or point.chunk_tokens <= 0:
            raise MeasurementError(f"{where}: field 'value' and 'chunk_tokens' must be > 0")
        if any(p.id == point.id for p in points):
            raise MeasurementError(f"{where}: field 'id' repeats an earlier point's")
        points.append(point)
    for field, table in (("model", models), ("gpu", gpus)):
        if target[field] not in table:
            raise MeasurementError(f"{path}: target: field {field!r}: unknown {target[field]!r}")
    return Measurements(path, target["model"], target["gpu"], top["tolerance_rel"], gpus, models, tuple(points))


# ---- the physics: a Profile per (model, GPU) ------------------------------------------------------

def peak_flops(gpu: Gpu, dtype: str) -> float:
    """The GPU's dense tensor peak for a weight dtype (bf16 or fp8)."""
    peak = {"bf16": gpu.bf16_flops, "fp8": gpu.fp8_flops}.get(dtype, 0.0)
    if peak <= 0:
        raise MeasurementError(f"no {dtype!r} peak for this GPU ({gpu})")
    return peak


def profile_for(base: Profile, hardware: Hardware, model: Model, gpu: Gpu) -> Profile:
    """`base` with `model`'s architecture on `gpu` at the shared hardware constants."""
    linear_flops_per_s = hardware.linear_efficiency * peak_flops(gpu, model.weight_dtype)
    return dataclasses.replace(
        base, prefill_batch_fixed_s=hardware.prefill_batch_fixed_s,
        prefill_token_s=model.linear_flops_per_token / linear_flops_per_s,
        prefill_attention_pair_s=model.attention_flops_per_pair / (hardware.attention_efficiency * gpu.bf16_flops),
        decode_step_fixed_s=hardware.decode_step_fixed_s, hbm_bytes_per_s=hardware.hbm_efficiency * gpu.hbm_bytes_per_s,
        dense_weight_bytes=model.dense_weight_bytes, expert_weight_bytes=model.expert_weight_bytes,
        experts_total=model.experts_total, experts_per_token=model.experts_per_token,
        kv_read_bytes_per_token=model.kv_read_bytes_per_token, state_bytes_per_request=model.state_bytes_per_request)


def hardware_of(profile: Profile, model: Model, gpu: Gpu) -> Hardware:
    """The hardware constants a profile of `model` on `gpu` holds (the inverse of `profile_for`)."""
    return Hardware(profile.prefill_batch_fixed_s,
                    model.linear_flops_per_token / (profile.prefill_token_s * peak_flops(gpu, model.weight_dtype)),
                    model.attention_flops_per_pair / (profile.prefill_attention_pair_s * gpu.bf16_flops),
                    profile.decode_step_fixed_s, profile.hbm_bytes_per_s / gpu.hbm_bytes_per_s)


def prefill_alone_s(profile: Profile, input_tokens: int, chunk_tokens: int) -> float:
    """One prompt alone on an idle instance, in chunks: the sum of its batches."""
    total, done = 0.0, 0
    while done < input_tokens:
        tokens = min(chunk_tokens, input_tokens - done)
        total += profile.prefill_batch_s(tokens, tokens * (done + tokens / 2), 0)
        done += tokens
    return total


def predict_s(point: Point, profile: Profile) -> float:
    """The model's value of a public point, by the profile's own formulas."""
    if point.kind == "decode_step":
        return profile.decode_step_s(max(1, round(point.batch_size)), point.batch_size * point.context_tokens)
    prefill = prefill_alone_s(profile, point.input_tokens, point.chunk_tokens)
    if point.kind == "prefill":
        return prefill
    mean_context = point.input_tokens + (point.output_tokens - 1) / 2  # decode is linear in the context
    if point.kind == "request":
        return prefill + point.output_tokens * profile.decode_step_s(1, mean_context)
    if point.kind == "prefill_stream":
        return point.requests * prefill + point.output_tokens * profile.decode_step_s(1, mean_context)
    raise MeasurementError(f"point {point.id}: kind {point.kind!r} is not a public point")


# ---- the public fit ------------------------------------------------------------------------------

def design(points: Sequence[Point], measurements: Measurements, base: Profile) -> np.ndarray:
    """Row i: the coefficients of point i's prediction in x (exactly linear; checked)."""
    x0 = Hardware(0.01, 0.3, 0.3, 0.005, 0.7).vector()
    rows = []
    for point in points:
        model, gpu = measurements.models[point.model], measurements.gpus[point.gpu]

        def value(x: np.ndarray, point: Point = point, model: Model = model, gpu: Gpu = gpu) -> float:
            return predict_s(point, profile_for(base, Hardware.of_vector(x), model, gpu))

        at0 = value(x0)
        row = np.array([(value(x0 + np.eye(5)[j] * x0[j]) - at0) / x0[j] for j in range(5)])
        if not math.isclose(float(row @ x0), at0, rel_tol=1e-6):
            raise FitError(f"point {point.id}: the prediction is not linear in the fitted constants")
        rows.append(row)
    return np.array(rows)


def fit_public(measurements: Measurements, base: Profile) -> Hardware:
    """Least squares on relative errors over the fitted public points."""
    points = [p for p in measurements.points if p.fit and p.kind in PUBLIC_KINDS]
    if len(points) < 5:
        raise FitError(f"{measurements.path}: {len(points)} fitted public points cannot pin 5 constants")
    values = np.array([p.value for p in points])
    x, *_ = np.linalg.lstsq(design(points, measurements, base) / values[:, None], np.ones(len(points)), rcond=None)
    names = ("prefill_batch_fixed_s", "1/linear_efficiency", "1/attention_efficiency", "decode_step_fixed_s",
             "1/hbm_efficiency")
    for name, value, low in zip(names, x, (0.0, 1.0, 1.0, 0.0, 1.0), strict=True):
        if not value > low:
            raise FitError(f"{measurements.path}: the fit puts {name} at {value:.4g}, not > {low} (unphysical)")
    return Hardware.of_vector(x)


# ---- the paper's anchors: simulated --------------------------------------------------------------

def simulate_anchors(profile: Profile, pool: Sequence[Session], rate_per_min: float,
                     seeds: Sequence[int] = (1,)) -> dict[str, float]:
    """The steady scenario on 1p1d at `rate_per_min`: mean over seeds of TTFT p50, hit rate, busy share."""
    scenario = dataclasses.replace(load_scenario("steady"), rate=(RateStep(0.0, per_min=rate_per_min),))
    deployment = Deployment.of("1p1d", profile, 1, 1, "gpu")
    runs = [run_scenario(RunSpec(scenario, deployment, "sglang", seed, 0.0), pool).summary for seed in seeds]
    return {"paper_ttft_p50": statistics.fmean(r["ttft_p50_post_s"] for r in runs),
            "paper_hit_rate": statistics.fmean(r["hit_rate_post"] for r in runs),
            "paper_prefill_busy": statistics.fmean(r["prefill_busy_fraction"] for r in runs)}


def fit_pd_overhead(profile: Profile, pool: Sequence[Session], point: Point, seeds: Sequence[int] = (1,),
                    steps: int = 4, rel_tol: float = 0.01) -> tuple[Profile, dict[str, float]]:
    """Set `pd_request_overhead_s` so the simulated TTFT p50 is the paper's (secant steps on the shift)."""
    anchors = simulate_anchors(profile, pool, point.rate_per_min, seeds)
    for _ in range(steps):
        error = point.value - anchors["paper_ttft_p50"]
        if abs(error) <= rel_tol * point.value:
            break
        overhead = profile.pd_request_overhead_s + error
        if overhead < 0:
            raise FitError(f"point {point.id}: the simulated TTFT p50 {anchors['paper_ttft_p50']:.3f} s exceeds "
                           f"the paper's {point.value} s even with no PD overhead: prefill is too slow")
        profile = dataclasses.replace(profile, pd_request_overhead_s=overhead)
        anchors = simulate_anchors(profile, pool, point.rate_per_min, seeds)
    return profile, anchors


def simulate_overload_per_min(profile: Profile, pool: Sequence[Session]) -> float:
    """The 1p1d overload rate (sessions/min) by calibrate/overload.py's steady trials (about a minute)."""
    return 60 * find_overload_rate(Deployment.of("1p1d", profile, 1, 1, "gpu"), "sglang", pool).overload_rate_per_s


# ---- the report and the profile file ---------------------------------------------------------------

def table(measurements: Measurements, base: Profile, hardware: Hardware,
          anchors: Mapping[str, float] | None) -> list[tuple[Point, float | None, float | None]]:
    """(point, model value, relative error) for every point; paper points need `anchors`."""
    rows: list[tuple[Point, float | None, float | None]] = []
    for point in measurements.points:
        if point.kind in PUBLIC_KINDS:
            model = measurements.models[point.model]
            value: float | None = predict_s(point, profile_for(base, hardware, model, measurements.gpus[point.gpu]))
        else:
            value = None if anchors is None else anchors.get(point.kind)
        rows.append((point, value, None if value is None else value / point.value - 1))
    return rows


def format_table(rows: Sequence[tuple[Point, float | None, float | None]]) -> str:
    """One line per point: id, measured, model, relative error, fitted or not."""
    lines = [f"{'point':34} {'measured':>10} {'model':>10} {'error':>7}  fit"]
    for point, value, error in rows:
        shown = "-" if value is None else f"{value:10.4g}"
        err = "-" if error is None else f"{error:+7.1%}"
        lines.append(f"{point.id:34} {point.value:10.4g} {shown:>10} {err:>7}  {'yes' if point.fit else 'no'}")
    return "\n".join(lines)


def yaml_number(value: float) -> str:
    """Four significant digits that YAML reads back as a float (its floats need a '.')."""
    text = f"{value:.4g}"
    mantissa, _, exponent = text.partition("e")
    return (mantissa if "." in mantissa else f"{mantissa}.0") + (f"e{exponent}" if exponent else "")


def write_profile(path: Path, profile: Profile) -> None:
    """Rewrite the fitted fields' lines of a profile yaml, keeping every other line as it is."""
    text = path.read_text()
    for name in FITTED_FIELDS:
        text, count = re.subn(rf"^{name}: .*$", f"{name}: {yaml_number(getattr(profile, name))}", text, flags=re.M)
        if count != 1:
            raise MeasurementError(f"{path}: expected one line '{name}: ...', found {count}")
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    """Fit, print every point, and with --write update the profile's numbers."""
    parser = argparse.ArgumentParser(prog="python -m basin_sim.experiments.calibrate.cost_fit",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="profile name (its .measurements.yaml beside it)")
    parser.add_argument("--sessions", type=Path, default=Path("data/sessions.parquet"))
    parser.add_argument("--seeds", type=int, default=1, help="seeds per simulated run of the paper's anchors")
    parser.add_argument("--no-paper", action="store_true", help="skip the simulated paper anchors")
    parser.add_argument("--overload", action="store_true", help="also measure the overload rate (a minute)")
    parser.add_argument("--write", action="store_true", help="write the fitted numbers into the profile yaml")
    args = parser.parse_args(argv)
    configure_logging(line=BARE_LINE)
    profile_path = PROFILES_DIR / f"{args.profile}.yaml"
    try:
        measurements = load_measurements(PROFILES_DIR / f"{args.profile}.measurements.yaml")
        base = load_profile(args.profile)
        model, gpu = measurements.models[measurements.target_model], measurements.gpus[measurements.target_gpu]
        hardware = fit_public(measurements, base)
        profile = profile_for(base, hardware, model, gpu)
        anchors = None
        if not args.no_paper:
            profile, anchors = _paper(profile, measurements, args.sessions, tuple(range(1, args.seeds + 1)),
                                      args.overload)
    except (MeasurementError, FitError, CatalogError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(table(measurements, base, hardware, anchors)))
    print(f"\nhardware: {hardware}")
    for name in FITTED_FIELDS:
        print(f"{name}: {getattr(profile, name):.4g}")
    if args.write:
        write_profile(profile_path, profile)
        log.info("wrote %s", profile_path)
    return 0


def _paper(profile: Profile, measurements: Measurements, sessions: Path, seeds: tuple[int, ...],
           with_overload: bool) -> tuple[Profile, dict[str, float]]:
    ttft = next(p for p in measurements.points if p.kind == "paper_ttft_p50")
    if not sessions.exists():
        raise MeasurementError(f"the paper's anchors need the real session table, not found at {sessions}")
    try:
        pool = workload_pool(load_pool(sessions, False)[0], WorkloadSpec(benchmarks=(ttft.benchmark,)))
    except PoolError as exc:
        raise MeasurementError(f"point {ttft.id}: field 'benchmark': {exc}") from exc
    profile, anchors = fit_pd_overhead(profile, pool, ttft, seeds)
    if with_overload:
        anchors["paper_overload_per_min"] = simulate_overload_per_min(profile, pool)
    return profile, anchors


if __name__ == "__main__":
    raise SystemExit(main())

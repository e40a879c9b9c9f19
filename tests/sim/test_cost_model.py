"""The cost model against its sources: the shipped profile reproduces the measurements it was fitted to."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from basin_runtime.session_table import Session, read_sessions
from basin_sim.catalog import PROFILES_DIR, load_profile
from basin_sim.experiments.calibrate.cost_fit import (
    FITTED_FIELDS,
    PAPER_KINDS,
    PUBLIC_KINDS,
    FitError,
    Hardware,
    MeasurementError,
    Measurements,
    fit_public,
    hardware_of,
    load_measurements,
    main,
    predict_s,
    profile_for,
    simulate_anchors,
    write_profile,
    yaml_number,
)
from basin_sim.profile import Profile
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.scenarios import WorkloadSpec
from tests.conftest import ROOT
from tests.sim.builders import TINY

PROFILE = "h100-qwen3.6-35b-a3b"
MEASUREMENTS = PROFILES_DIR / f"{PROFILE}.measurements.yaml"


@pytest.fixture(scope="module")
def measurements() -> Measurements:
    return load_measurements(MEASUREMENTS)


@pytest.fixture(scope="module")
def shipped() -> Profile:
    return load_profile(PROFILE)


def _target_hardware(measurements: Measurements, profile: Profile) -> Hardware:
    return hardware_of(profile, measurements.models[measurements.target_model],
                       measurements.gpus[measurements.target_gpu])


def test_the_target_model_is_the_profile_s_architecture(measurements: Measurements, shipped: Profile) -> None:
    model = measurements.models[measurements.target_model]
    for field in ("dense_weight_bytes", "expert_weight_bytes", "experts_total", "experts_per_token",
                  "kv_read_bytes_per_token", "state_bytes_per_request"):
        assert getattr(model, field) == getattr(shipped, field), field


def test_the_shipped_profile_reproduces_every_fitted_public_point(measurements: Measurements,
                                                                   shipped: Profile) -> None:
    hardware = _target_hardware(measurements, shipped)
    checked = 0
    for point in measurements.points:
        if point.kind not in PUBLIC_KINDS or not point.fit:
            continue
        profile = profile_for(shipped, hardware, measurements.models[point.model], measurements.gpus[point.gpu])
        error = predict_s(point, profile) / point.value - 1
        assert abs(error) <= measurements.tolerance(point), f"{point.id}: model off by {error:+.1%}"
        checked += 1
    assert checked >= 15


def test_the_shipped_numbers_are_the_fit_of_the_file(measurements: Measurements, shipped: Profile) -> None:
    fitted = profile_for(shipped, fit_public(measurements, shipped), measurements.models[measurements.target_model],
                         measurements.gpus[measurements.target_gpu])
    for field in FITTED_FIELDS[:-1]:  # the PD overhead needs the simulator: see the paper test below
        assert getattr(shipped, field) == pytest.approx(getattr(fitted, field), rel=1e-3), field


@pytest.fixture(scope="module")
def terminal_bench(measurements: Measurements, request: pytest.FixtureRequest) -> list[Session]:
    """The paper's sessions: data/sessions.parquet (built by `make repro`), else the real corpora ingested."""
    table = ROOT / "data" / "sessions.parquet"
    if not table.exists():
        table = request.getfixturevalue("real_session_table")
    benchmark = next(p.benchmark for p in measurements.points if p.kind in PAPER_KINDS)
    return workload_pool(read_sessions(table), WorkloadSpec(benchmarks=(benchmark,)))


@pytest.mark.real_data
def test_the_shipped_profile_reproduces_the_paper_s_anchors(measurements: Measurements, shipped: Profile,
                                                            terminal_bench: list[Session]) -> None:
    paper = [p for p in measurements.points if p.kind in PAPER_KINDS]
    anchors = simulate_anchors(shipped, terminal_bench, paper[0].rate_per_min)
    assert set(anchors) == {"paper_ttft_p50", "paper_hit_rate", "paper_prefill_busy"}
    for point in (p for p in paper if p.kind in anchors):
        error = anchors[point.kind] / point.value - 1
        assert abs(error) <= measurements.tolerance(point), f"{point.id}: simulated off by {error:+.1%}"


def test_the_fit_recovers_known_constants_from_synthetic_points(measurements: Measurements,
                                                                shipped: Profile) -> None:
    truth = Hardware(prefill_batch_fixed_s=0.031, linear_efficiency=0.27, attention_efficiency=0.61,
                     decode_step_fixed_s=0.0073, hbm_efficiency=0.66)
    points = []
    for point in measurements.points:
        if point.kind in PUBLIC_KINDS:
            profile = profile_for(shipped, truth, measurements.models[point.model], measurements.gpus[point.gpu])
            points.append(dataclasses.replace(point, value=predict_s(point, profile), fit=True))
    fitted = fit_public(dataclasses.replace(measurements, points=tuple(points)), shipped)
    for field in dataclasses.fields(Hardware):
        assert getattr(fitted, field.name) == pytest.approx(getattr(truth, field.name), rel=1e-6), field.name


def test_the_fit_refuses_points_that_cannot_pin_the_constants(measurements: Measurements, shipped: Profile) -> None:
    decode_only = tuple(p for p in measurements.points if p.kind == "decode_step")
    with pytest.raises(FitError, match=r"unphysical|cannot pin"):
        fit_public(dataclasses.replace(measurements, points=decode_only[:4]), shipped)
    slower_with_less = [dataclasses.replace(p, value=p.value * (1e-3 if p.kind == "prefill_stream" else 1))
                        for p in measurements.points]
    with pytest.raises(FitError, match="unphysical"):
        fit_public(dataclasses.replace(measurements, points=tuple(slower_with_less)), shipped)


def _raw() -> dict[str, Any]:
    data = yaml.safe_load(MEASUREMENTS.read_text())
    assert isinstance(data, dict)
    return copy.deepcopy(data)


def _broken(tmp_path: Path, edit: Any) -> Path:
    data = _raw()
    edit(data)
    path = tmp_path / "broken.measurements.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _point(data: dict[str, Any], point_id: str) -> dict[str, Any]:
    point = next(p for p in data["points"] if p["id"] == point_id)
    assert isinstance(point, dict)
    return point


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: _point(d, "mlenergy-h100-itl-b8").pop("value"),
     r"point mlenergy-h100-itl-b8: missing fields \['value'\]"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").update(value="fast"),
     r"point mlenergy-h100-itl-b8: field 'value' must be float"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").update(value=-1.0), r"point mlenergy-h100-itl-b8: field 'value'"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").update(batch=8), r"unknown fields \['batch'\]"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").pop("batch_size"),
     r"point mlenergy-h100-itl-b8: kind 'decode_step' needs field 'batch_size'"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").update(kind="itl"), r"point mlenergy-h100-itl-b8: field 'kind'"),
    (lambda d: _point(d, "mlenergy-h100-itl-b8").update(gpu="b200"),
     r"point mlenergy-h100-itl-b8: field 'gpu': unknown 'b200'"),
    (lambda d: _point(d, "millstone-h200-itl-1k").update(id="mlenergy-h100-itl-b8"), r"field 'id' repeats"),
    (lambda d: d["models"]["qwen3-30b-a3b-bf16"].pop("experts_total"),
     r"models.qwen3-30b-a3b-bf16: missing fields \['experts_total'\]"),
    (lambda d: d.pop("tolerance_rel"), r"missing fields \['tolerance_rel'\]"),
])
def test_a_bad_measurements_file_names_the_point_and_the_field(tmp_path: Path, edit: Any, message: str) -> None:
    path = _broken(tmp_path, edit)
    with pytest.raises(MeasurementError, match=message) as caught:
        load_measurements(path)
    assert str(path) in str(caught.value)


def test_a_bf16_point_on_a_gpu_without_fp8_has_no_fp8_peak(measurements: Measurements, shipped: Profile) -> None:
    a100 = measurements.gpus["a100-sxm-80gb"]
    hardware = _target_hardware(measurements, shipped)
    with pytest.raises(MeasurementError, match="no 'fp8' peak"):
        profile_for(shipped, hardware, measurements.models["qwen3-30b-a3b-fp8"], a100)


@pytest.mark.parametrize(("computed", "loaded"), [(600, 1_500), (600, 1_000_000), (0, 5_000), (4_000, 0)])
def test_a_load_back_overlaps_the_batch_s_compute(computed: int, loaded: int) -> None:
    compute = TINY.prefill_batch_s(computed, 0.0, 0)
    load = TINY.load_back_s(loaded)
    assert TINY.prefill_batch_s(computed, 0.0, loaded) == pytest.approx(max(compute, load))
    assert TINY.prefill_batch_s(computed, 0.0, loaded) < compute + load or loaded == 0


def test_the_pd_overhead_delays_every_transfer_but_not_a_write_back() -> None:
    slow = dataclasses.replace(TINY, pd_request_overhead_s=0.1)
    assert slow.transfer_s(1_000) == pytest.approx(TINY.transfer_s(1_000) + 0.1)
    assert slow.write_back_s(1_000) == TINY.write_back_s(1_000)


def test_writing_the_profile_changes_only_the_fitted_numbers(tmp_path: Path, shipped: Profile) -> None:
    path = tmp_path / f"{PROFILE}.yaml"
    original = (PROFILES_DIR / f"{PROFILE}.yaml").read_text()
    path.write_text(original)
    changed = dataclasses.replace(shipped, prefill_token_s=1e-05, hbm_bytes_per_s=2.0e12, pd_request_overhead_s=0.25)
    write_profile(path, changed)
    assert load_profile(str(path)) == changed
    different = [(a, b) for a, b in zip(original.splitlines(), path.read_text().splitlines(), strict=True) if a != b]
    assert {b.split(":")[0] for _, b in different} == {"prefill_token_s", "hbm_bytes_per_s", "pd_request_overhead_s"}


@pytest.mark.parametrize("value", [1e-05, 3.122e12, 0.123, 7.0, 4.1e-10])
def test_numbers_are_written_so_yaml_reads_floats(value: float) -> None:
    read = yaml.safe_load(f"x: {yaml_number(value)}")["x"]
    assert isinstance(read, float) and math.isclose(read, value, rel_tol=1e-3)


def test_the_command_prints_every_point_and_the_constants(measurements: Measurements,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-paper"]) == 0
    out = capsys.readouterr().out
    assert all(point.id in out for point in measurements.points)
    assert all(f"{field}: " in out for field in FITTED_FIELDS)
    assert main(["--profile", "no-such-profile", "--no-paper"]) == 2
    assert "no-such-profile" in capsys.readouterr().err


def test_the_h200_profile_is_the_h100_fit_on_the_h200_s_peaks_with_its_own_memory(measurements: Measurements,
                                                                                  shipped: Profile) -> None:
    h200 = load_profile("h200-qwen3.6-35b-a3b")
    model = measurements.models[measurements.target_model]
    hardware = hardware_of(shipped, model, measurements.gpus[measurements.target_gpu])
    expected = profile_for(shipped, hardware, model, measurements.gpus["h200-sxm"])
    for name in FITTED_FIELDS:
        assert getattr(h200, name) == pytest.approx(getattr(expected, name), rel=1e-3), name
    assert h200.hbm_bytes_per_s > 1.4 * shipped.hbm_bytes_per_s  # 4.8 vs 3.35 TB/s
    # the KV pool from the header's arithmetic: 0.85 x 141 GB - 36 GB of weights, at 24.7 KB per cached token
    assert h200.kv_pool_tokens == pytest.approx((0.85 * 141e9 - 36e9) / 24.7e3, rel=0.01)
    same = {f.name for f in dataclasses.fields(Profile)} - set(FITTED_FIELDS) - {"name", "kv_pool_tokens"}
    assert {name: getattr(h200, name) for name in same} == {name: getattr(shipped, name) for name in same}

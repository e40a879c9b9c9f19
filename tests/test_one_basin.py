"""One Basin, two clocks: the gateway and the simulator build the same policy from one calibration file.

Both sides go through their own real construction path (the gateway's `build_gateway` from its
command line, the simulator's `RunSpec` -> `policy_context` -> registered policy -> `Engine`), and
must end with equal `PolicyConfig`s, equal budgets, and hit-rate windows that answer alike.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from basin_runtime.calibration import load_calibration
from basin_runtime.clock import ManualClock
from basin_runtime.gateway.app import build_gateway
from basin_runtime.gateway.config import build_parser, load_config
from basin_runtime.gateway.gateway import Gateway
from basin_runtime.policy.hit_rate import HitRateWindow
from basin_sim import catalog
from basin_sim.engine import Engine
from basin_sim.policies import BasinPolicy, make_policy
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import policy_context

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "peak_predictor.onnx"
MEASURED = {"knee_tokens": 1_500_000, "cache_capacity_tokens": 2_000_000, "hit_rate_plateau": 0.82,
            "peak_completion_rate_per_s": 0.07, "reservation_ratio": 1.6, "notes": "one file for both"}
# (time, prompt tokens, cached tokens) of ended calls; sparse at first (too little evidence), then dense
SAMPLES = [(1.0, 300, 280), (2.0, 400, 100), (30.0, 5_000, 4_500), (65.0, 2_000, 200), (100.0, 8_000, 7_000),
           (170.0, 500, 500)]
PROBES = [0.5, 2.0, 31.0, 64.0, 70.0, 95.0, 125.0, 160.5, 175.0, 300.0]


def _gateway(calibration: Path, tmp_path: Path, mode: str) -> Gateway:
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(f"policy: {{mode: {mode}}}\n", encoding="utf-8")
    argv = ["--config", str(config_file), "--upstream", "http://127.0.0.1:9", "--model", str(MODEL),
            "--calibration", str(calibration)]
    return build_gateway(load_config(vars(build_parser().parse_args(argv))), clock=ManualClock())


def _engine(calibration: Path, policy_name: str) -> Engine:
    spec = catalog.load_deployment("1p3d-h100")
    deployment = spec.build("gpu")
    run = RunSpec(catalog.load_scenario("steady"), deployment, policy_name, 1, 0.4,
                  predicted_peak_tokens={"s": 10_000.0}, calibration=load_calibration(calibration))
    return Engine(deployment, make_policy(policy_name, policy_context(run)))


def _rates(window: HitRateWindow) -> list[float | None]:
    rates: list[float | None] = []
    samples = iter(SAMPLES)
    pending = next(samples, None)
    for probe in PROBES:
        while pending is not None and pending[0] <= probe:
            window.record(*pending)
            pending = next(samples, None)
        rates.append(window.rate(probe))
    return rates


@pytest.mark.parametrize(("mode", "policy_name"), [("basin", "basin"), ("prototype", "basin-proto")])
def test_the_gateway_and_the_simulator_build_the_same_policy_from_one_calibration_file(
        tmp_path: Path, mode: str, policy_name: str) -> None:
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(MEASURED), encoding="utf-8")
    gateway = _gateway(calibration, tmp_path, mode)
    try:
        engine = _engine(calibration, policy_name)
        assert isinstance(engine.policy, BasinPolicy)
        served, simulated = gateway.room.policy, engine.policy.core
        assert served.config == simulated.config
        assert served.config.mode == mode
        # the measured plateau and completion rate reach both (the simulator used to drop the plateau)
        assert (served.config.hit_rate_plateau, served.config.peak_completion_rate_per_s) == (0.82, 0.07)
        expected_budget = round(1.6 * 0.9 * 1_500_000) if mode == "basin" else round(0.9 * 1_500_000)
        assert served.snapshot().budget_tokens == simulated.snapshot().budget_tokens == expected_budget
        served_window, simulated_window = gateway.telemetry.hit_window, engine.hit_window
        assert type(served_window) is type(simulated_window) is HitRateWindow
        assert (served_window.window_s, served_window.min_prompt_tokens) == (
            simulated_window.window_s, simulated_window.min_prompt_tokens)
        served_rates, simulated_rates = _rates(served_window), _rates(simulated_window)
        assert served_rates == simulated_rates
        assert None in served_rates and any(r is not None for r in served_rates)  # both regimes are exercised
    finally:
        asyncio.run(gateway.upstream.client.aclose())

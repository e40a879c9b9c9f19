"""A tiny `basin-sim compare` grid for the executor tests: one short surge on a 1P1D deployment, the synthetic
corpus, the overload rate seeded (nothing calibrates it), a few runs of a second or so each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from basin_sim.catalog import load_deployment, load_scenario
from basin_sim.experiments.calibrate.rates import RateCache, rate_key
from basin_sim.workload.pool import workload_pool
from basin_sim.workload.synthetic import generate_corpus
from tests.sim.test_cli import DEPLOYMENT, SCENARIO

MODEL = Path(__file__).resolve().parents[2] / "models" / "peak_predictor.onnx"


@dataclass(frozen=True)
class TinyGrid:
    """The files of a tiny grid; `argv` runs it (--executor and --jobs left to the caller)."""

    scenario: Path
    deployment: Path
    rates: Path
    policies: tuple[str, ...]
    seeds: tuple[int, ...]

    def argv(self, out: Path) -> list[str]:
        """`basin-sim compare` options writing `out`, with a calibrations file of its own beside it."""
        return ["--scenarios", str(self.scenario), "--deployments", str(self.deployment), "--policies",
                *self.policies, "--seeds", *map(str, self.seeds), "--model", str(MODEL), "--predictions",
                "in-sample", "--synthetic", "--sessions", str(self.rates.parent / "absent.parquet"),
                "--rates-file", str(self.rates), "--calibrations-file", str(out.with_suffix(".knees.json")),
                "--out", str(out)]


def tiny_grid(folder: Path, scenario_name: str, policies: tuple[str, ...] = ("sglang", "basin"),
              seeds: tuple[int, ...] = (1, 2)) -> TinyGrid:
    """Write the grid's scenario (named `scenario_name`), deployment and seeded rates into `folder`."""
    scenario_file, deployment_file = folder / f"{scenario_name}.yaml", folder / "tiny.yaml"
    scenario_file.write_text(SCENARIO.replace("name: tiny-surge", f"name: {scenario_name}"))
    deployment_file.write_text(DEPLOYMENT)
    scenario = load_scenario(str(scenario_file))
    pool = workload_pool(generate_corpus(7, 300), scenario.workload)  # the synthetic corpus --synthetic reads
    rates = RateCache(folder / "rates.json")
    rates.put(rate_key(load_deployment(str(deployment_file)).build("gpu"), scenario.workload, scenario.clients, pool),
              0.1, {"command": "seeded by the test"})
    return TinyGrid(scenario_file, deployment_file, rates.path, policies, seeds)

"""The engine's results, pinned: whole runs whose summaries and per-session outcomes must not drift.

Each cell is a short run on a small deployment with the synthetic corpus, chosen so that together they
take every path of the event model: the three KV tiers (none, decode-memory, storage-offload), the host
tier, pins (continuum), suspensions (budgeter), admission (basin-proto, basin), a burst that is killed,
clients that time out, retry and give up, and a closed population. The golden file was written by the
engine before it was split into parts (issue 37); a change that moves any number here changes the
simulator's behaviour and must say so. Rewrite the file only on purpose:

    python -m tests.sim.test_engine_golden --write
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from basin_runtime.policy.lending import LendingKind
from basin_sim.catalog import load_profile
from basin_sim.clients import ClientPolicy
from basin_sim.profile import Deployment
from basin_sim.run_spec import RunSpec
from basin_sim.simulate import run_scenario
from basin_sim.workload.scenarios import BurstSpec, PopulationSpec, RateStep, Scenario
from basin_sim.workload.synthetic import generate_corpus

GOLDEN = Path(__file__).parent / "golden" / "engine_runs.json"
POOL = generate_corpus(3, 40)
PEAKS = {s.session_id: 1.2 * s.peak_prompt_tokens for s in POOL}  # a stand-in predictor: 1.2 x the true peak
PROFILE = load_profile("h100-qwen3.6-35b-a3b")
IMPATIENT = ClientPolicy(call_timeout_s=30.0, max_retries=1, harness_attempts=2, session_time_limit_s=900.0)


def deployment(lending: LendingKind, host_tokens: int = 0) -> Deployment:
    """One prefill, two decode instances, a cache of 150k tokens: a surge overflows it."""
    return Deployment("golden", PROFILE, 1, 2, 150_000, 300_000, host_tokens, lending=lending)


SURGE = Scenario("golden-surge", duration_s=1_800.0, warmup_s=300.0, goodput_from_s=600.0, goodput_to_s=1_800.0,
                 rate=(RateStep(0.0, 0.5), RateStep(300.0, 1.5), RateStep(900.0, 0.5)),
                 bursts=(BurstSpec(300.0, 600.0, 2.0, 600.0, kill_at_s=600.0),), clients=IMPATIENT)
CLOSED = Scenario("golden-closed", duration_s=1_200.0, warmup_s=300.0, goodput_from_s=300.0, goodput_to_s=1_200.0,
                  population=PopulationSpec(24, 5.0), clients=IMPATIENT)


@dataclass(frozen=True)
class Cell:
    """One pinned run."""

    name: str
    scenario: Scenario
    deployment: Deployment
    policy: str
    seed: int

    def run(self) -> dict[str, Any]:
        """The run's summary and a digest of every session's outcome."""
        peaks = PEAKS if self.policy == "basin" else {}
        # Basin as it ran when the file was written: recovery at tool boundaries (issue 49) came later and has
        # its own engine test (tests/sim/test_basin_recovery.py)
        overrides = {"recovery": False} if self.policy == "basin" else {}
        spec = RunSpec(self.scenario, self.deployment, self.policy, self.seed, 0.06, max_drain_s=600.0,
                       predicted_peak_tokens=peaks, policy_overrides=overrides)
        result = run_scenario(spec, POOL)
        outcomes = json.dumps([dataclasses.astuple(o) for o in result.outcomes])
        return {"summary": result.summary, "outcomes_sha256": hashlib.sha256(outcomes.encode()).hexdigest(),
                "sessions": len(result.outcomes)}


CELLS = (
    Cell("sglang-none", SURGE, deployment("none"), "sglang", 1),
    Cell("continuum-decode-memory", SURGE, deployment("decode-memory"), "continuum", 2),
    Cell("budgeter-storage-offload", SURGE, deployment("storage-offload"), "budgeter", 3),
    Cell("basin-proto-host", SURGE, deployment("none", host_tokens=150_000), "basin-proto", 4),
    Cell("basin-decode-memory", SURGE, deployment("decode-memory"), "basin", 5),
    Cell("continuum-closed-storage-offload", CLOSED, deployment("storage-offload"), "continuum", 6),
)


def golden() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(GOLDEN.read_text())
    return loaded


@pytest.mark.parametrize("cell", CELLS, ids=lambda cell: cell.name)
def test_a_run_gives_exactly_the_recorded_summary_and_outcomes(cell: Cell) -> None:
    expected = golden()[cell.name]
    got = json.loads(json.dumps(cell.run()))  # the JSON a user reads: floats compare exactly
    assert got["summary"] == expected["summary"]
    assert (got["sessions"], got["outcomes_sha256"]) == (expected["sessions"], expected["outcomes_sha256"])


def test_the_cells_take_every_path_they_are_there_for() -> None:
    """Each feature the cells are meant to cover did happen in the recorded runs (else they pin nothing)."""
    runs = {name: cell["summary"] for name, cell in golden().items()}
    assert set(runs) == {cell.name for cell in CELLS}
    assert all(run["timeouts"] > 0 and run["retries"] > 0 for run in runs.values())
    assert all(run["sessions_abandoned"] > 0 for name, run in runs.items() if "closed" not in name)
    assert runs["sglang-none"]["sessions_killed"] > 0
    assert runs["continuum-decode-memory"]["written_back_tokens"] > 0
    assert runs["continuum-decode-memory"]["pin_answers"] > 0
    assert runs["budgeter-storage-offload"]["suspensions"] > 0
    assert runs["basin-decode-memory"]["sessions_admitted"] is not None


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.sim.test_engine_golden --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({cell.name: cell.run() for cell in CELLS}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")

"""Small, hand-checkable profiles, deployments and sessions for the simulator tests.

TINY: prefill 10 ms per batch + 0.1 ms per computed token, no attention term; decode 20 ms per step
whatever the batch; transfer 5 ms + 1 us per token; load-back 1 us per token.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from basin_runtime.policy.lending import LendingKind
from basin_runtime.session_table import Call, Session, write_sessions
from basin_sim.engine import Engine
from basin_sim.lifecycle import SessionSpec
from basin_sim.profile import Deployment, Profile

# Round numbers so that expected times can be computed by hand in the tests.
TINY = Profile(
    name="tiny", kv_pool_tokens=100_000, kv_bytes_per_token=1_000.0, state_bytes_per_request=0.0,
    prefill_batch_fixed_s=0.01, prefill_token_s=1e-4, prefill_attention_pair_s=0.0, chunked_prefill_tokens=4_096,
    decode_step_fixed_s=0.02, dense_weight_bytes=0.0, expert_weight_bytes=0.0, experts_total=8,
    experts_per_token=1, kv_read_bytes_per_token=0.0, hbm_bytes_per_s=1e12, transfer_fixed_s=0.005,
    transfer_bytes_per_s=1e9, host_load_bytes_per_s=1e9, host_cache_ratio=2.0,
)


def deployment(profile: Profile = TINY, *, cache_tokens: int = 100_000, decode_tokens: int = 100_000,
               host_tokens: int = 0, num_decode: int = 1, num_prefill: int = 1, reserved_tokens: int = 100,
               clip_tokens: int = 1_000, lending: LendingKind = "none") -> Deployment:
    """A mP-nD deployment (1P1D by default) of the tiny profile with the given memories; decode keeps
    `reserved_tokens` of headroom per active request and estimates a completion as `clip_tokens`."""
    return Deployment("tiny", profile, num_prefill, num_decode, cache_tokens, decode_tokens, host_tokens,
                      decode_reserved_tokens=reserved_tokens, decode_clip_max_new_tokens=clip_tokens, lending=lending)


def session(session_id: str, prompts: list[int], completion: int = 100, gap_s: float = 1.0,
            benchmark: str = "bench") -> Session:
    """A session whose calls have these prompt sizes and a fixed completion and gap."""
    calls = tuple(Call(p, completion, None, None, gap_s if k + 1 < len(prompts) else None)
                  for k, p in enumerate(prompts))
    return Session(session_id, benchmark, "test", "agent", "model", f"task-{session_id}", "a task", "", "t", calls)


def spec(s: Session, arrival_s: float = 0.0, shared_tokens: int = 500, is_burst: bool = False) -> SessionSpec:
    """A replayable session with a shared prefix of `shared_tokens`."""
    gaps = tuple(c.gap_s if c.gap_s is not None else 0.0 for c in s.calls[:-1])
    return SessionSpec(s.session_id, s, arrival_s, s.benchmark, shared_tokens, gaps, is_burst)


def with_profile(**changes: float) -> Profile:
    """The tiny profile with some fields changed."""
    return replace(TINY, **changes)


def seeded_files(tmp_path: Path, deployment_yaml: str, rate_per_s: float = 0.1) -> dict[str, str]:
    """A deployment file, a small synthetic session table and a rates cache holding the steady workload's
    overload rate on that deployment, as if measured before (so no test calibrates)."""
    from basin_sim.catalog import load_deployment, load_scenario
    from basin_sim.experiments.calibrate.rates import RateCache, rate_key
    from basin_sim.workload.pool import workload_pool
    from basin_sim.workload.synthetic import generate_corpus

    (tmp_path / "d.yaml").write_text(deployment_yaml)
    pool = generate_corpus(2, 10)
    write_sessions(tmp_path / "sessions.parquet", pool)
    rates = RateCache(tmp_path / "rates.json")
    shape = load_deployment(str(tmp_path / "d.yaml")).build("gpu")
    steady = load_scenario("steady")
    rates.put(rate_key(shape, steady.workload, steady.clients, workload_pool(pool, steady.workload)), rate_per_s,
              {"command": "seeded by the test"})
    return {"deployment": str(tmp_path / "d.yaml"), "sessions": str(tmp_path / "sessions.parquet"),
            "rates": str(rates.path), "dir": str(tmp_path)}


def until_answered(engine: Engine, session_id: str, calls: int, step: float = 0.01) -> float:
    """Run the engine in `step`s until the session has sent `calls` calls; the time it stopped at."""
    t = engine.now
    while engine.runs[session_id].next_call < calls:
        t += step
        engine.run_until(t)
    return t

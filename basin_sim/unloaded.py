"""Each session's unloaded time: its end-to-end time alone on an empty deployment (memoized).

The reference of goodput's "within 4x" rule. Computed by the engine itself (same cost model), with no
other session, no policy hold, no ticks, no clients and no lending (the same reference whatever the
deployment's lending switch); memoized per (session id, number of calls) for one deployment.
"""

from __future__ import annotations

import math
from dataclasses import replace

from basin_sim.engine import Engine
from basin_sim.lifecycle import SessionSpec
from basin_sim.policies.fcfs import FcfsPolicy
from basin_sim.profile import Deployment


class UnloadedTimes:
    """Unloaded end-to-end times on one deployment."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self._cache: dict[tuple[str, int], float] = {}

    def of(self, spec: SessionSpec) -> float:
        """Seconds from arrival to last answer for this session alone."""
        key = (spec.session.session_id, spec.session.n_calls)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        engine = Engine(replace(self.deployment, lending="none"), FcfsPolicy("alone"), tick_s=None)
        engine.add(replace(spec, session_id="alone", arrival_s=0.0))
        engine.run_until(math.inf)
        ended = engine.runs["alone"].ended_s
        assert ended is not None, f"session {spec.session_id!r} did not finish alone"
        self._cache[key] = ended
        return ended

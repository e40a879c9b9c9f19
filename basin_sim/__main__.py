"""`python -m basin_sim`: the same as `basin-sim` (basin_sim/experiments/cli.py)."""

from __future__ import annotations

from basin_sim.experiments.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

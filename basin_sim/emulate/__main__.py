"""`python -m basin_sim.emulate`: the same as `basin-emulate`."""

from __future__ import annotations

from basin_sim.emulate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

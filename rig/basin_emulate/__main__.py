"""`python -m basin_emulate`: the same as `basin-emulate`."""

from __future__ import annotations

from basin_emulate.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

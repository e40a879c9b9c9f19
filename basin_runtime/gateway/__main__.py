"""`python -m basin_runtime.gateway`: the same as `basin-gateway`."""

from __future__ import annotations

from basin_runtime.gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m basin_sim`: see basin_sim/cli.py."""

from __future__ import annotations

import sys

from basin_sim.cli import main

sys.exit(main())

"""The experiments that run the model: the `basin-sim` CLI, run and compare set-ups, the compare grid, ablations,
calibration (knee, rates, ramps, timing fit), predictions for a pool, executors (local, Ray) and plots.

Rules:
- The model (basin_sim outside this package) never imports from here; tests/test_package_imports.py checks it.
"""

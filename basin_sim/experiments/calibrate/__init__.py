"""Measuring a simulated deployment the way an operator measures a real one.

Modules, one job each:
  overload.py    the overload rate: steady-load trials (doubling, then bisection)
  rates.py       the overload-rate cache (data/sim/overload_rates.json), measured on first use
  ramp.py        the stepped load ramp, its knee, the gateway's calibration record, and which limit
                 (cache knee, decode memory) a ramp hits first
  knee_ramp.py   the knee ramp's fractions and step, and the calibration record it yields
  knee_cache.py  the knee-calibration cache (data/sim/calibrations.json), measured on first use
  knee.py        knee detection on a hit-rate-vs-working-set curve
  fluid.py       the fluid model dN/dt = lambda - X(N)/K and the cache-first / decode-first test
  cost_fit.py    the profile's cost constants fitted to public measurements and the paper's anchors
  timing_fit.py  a serving model's timing scales fitted to measured sessions (workload/serving.py)
  commands.py    the `calibrate`, `knee`, `risk` and `ramp` subcommands of `basin-sim`
"""

# Measuring a simulated deployment the way an operator measures a real one.
#
# Modules, one job each:
#   overload.py   the overload rate: steady-load trials (doubling, then bisection)
#   ramp.py       the stepped load ramp, its knee, the gateway's calibration record, and which limit
#                 (cache knee, decode memory) a ramp hits first
#   knee.py       knee detection on a hit-rate-vs-working-set curve
#   fluid.py      the fluid model dN/dt = lambda - X(N)/K and the cache-first / decode-first test
#   cost_fit.py   the profile's cost constants fitted to public measurements and the paper's anchors
#   commands.py   the `calibrate`, `knee`, `risk` and `ramp` subcommands of `basin-sim`
"""Calibration and analysis of simulated deployments: overload rate, knee, fluid model, risk test."""

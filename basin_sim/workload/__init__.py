# What the simulated deployment is asked to serve.
#
# Modules, one job each:
#   scenarios.py  scenarios (steady, surges, kill-bursts) and the session arrivals they generate
#   synthetic.py  the deterministic synthetic corpus fitted to the real session table
#   pool.py       the session pool a run draws from: the session table, or the synthetic corpus
"""Workloads of the simulator: scenarios, the session pool, the synthetic corpus."""

"""Workloads of the simulator: what the simulated deployment is asked to serve.

Modules, one job each:
  scenarios.py  scenarios (steady, surges, kill-bursts, closed populations) and the arrivals they generate
  pool.py       the session pool a run draws from: the session table, or the synthetic corpus
  synthetic.py  the deterministic synthetic corpus fitted to the real session table
  presets.py    paper-sized synthetic pools (`preset:` in a scenario's workload)
  tool_time.py  tool time (the gaps between calls) fitted to the recorded sessions
  serving.py    a serving model's timing of the sessions (`timing:`), fitted scales in serving/
"""

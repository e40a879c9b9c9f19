"""Basin's load generator: the session replayer and the live knee ramp.

The load generator: drives any OpenAI-compatible endpoint (the gateway, smg, SGLang, the emulator)
with replayed agent sessions, and measures what a client sees.

Modules, one job each:
  replay.py          deterministic conversations sized to recorded token counts; seeded arrival plans
  replay_client.py   the replayer (official `openai` client), its CLI `python -m basin_loadgen.replay_client`
  replay_summary.py  per-call and per-session records, goodput, hit rates, the timeline
  replay_plots.py    the timeline PNG of a replay
  metrics_scrape.py  cached / total prompt-token counters from the engines' Prometheus text
  live_ramp.py       the stepped load ramp on a live deployment; the knee and the calibration file
"""


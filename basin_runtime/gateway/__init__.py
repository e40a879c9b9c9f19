# The Basin gateway: an OpenAI-compatible HTTP front for the SGLang router that admits agent
# sessions by predicted peak context, queues the rest at the door, and hands every call the
# session's fixed priority. The policy itself is `basin_runtime.policy` (pure); this package is
# the asynchronous, I/O-doing shell around it.
#
# Modules, one job each:
#   config.py       options: command line, config file, defaults (`GatewayConfig`, `ConfigError`)
#   predictors.py   peak predictors per workload
#   clock.py        the injectable clock (real or scripted)
#   calls.py        parsing and validating an inference call
#   measure.py      prompt tokens and task text, as ingest counts them
#   sessions.py     session identity, per-session records, the registry
#   waiting.py      the waiting room: the policy under a lock, waiting, withdrawal, timers
#   priority.py     bounded engine priority levels, the routing key, request ids
#   upstream.py     the upstream HTTP client protocol: aiohttp (default) and httpx implementations
#   proxy.py        forwarding upstream and streaming the answer back (and reading its usage)
#   signals.py      per-call usage from the upstream's answers, and the windowed prefix hit rate
#   engine_metrics.py  the windowed hit rate scraped from the engines' /metrics counters (when configured)
#   metrics.py      the Prometheus metrics, in a registry per app
#   lending.py      what engines report per session: the decode instance that served, cached tiers
#   session_log.py  the durable, rotating session-log writer (a thread fed by a queue)
#   admin.py        /basin/ state, sessions, budget, reloads, shadow mode
#   errors.py       the error tree and the one mapping to HTTP status codes
#   gateway.py      the request path tying the above together
#   app.py          Starlette routes, lifespan, building the app from the configuration
#   cli.py          `basin-gateway` / `python -m basin_runtime.gateway`
"""The Basin session gateway in front of SGLang's router.

Nothing is imported here eagerly: importing one module (say `basin_runtime.gateway.config`) must
not start the whole app's import graph. Import from the modules themselves.
"""

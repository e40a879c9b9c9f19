"""The Basin session gateway in front of SGLang's router.

An OpenAI-compatible HTTP front for the SGLang router that admits agent sessions by predicted peak
context, queues the rest at the door, and hands every call the session's priority. The policy itself is
`basin_runtime.policy` (pure); this package is the asynchronous, I/O-doing shell around it.

Modules, one job each (a test keeps this list complete):
  config.py          the options, each declared once on `GatewayConfig`, read and resolved (`ConfigError`)
  options.py         how an option is declared, and the flags derived from the declarations
  options_doc.py     the option reference as Markdown, rendered from those declarations
  cli.py             `basin-gateway` / `python -m basin_runtime.gateway` (`__main__.py`)
  capacity.py        start-up: the engines' cache capacity (SGLang's max_total_num_tokens) against the calibration's
  server.py          uvicorn with the gateway's protocol (slow clients, connection caps) and drain on SIGTERM
  app.py             the edge: Starlette routes, the lifespan (the gateway's own), the app from the configuration
  edge.py            a Starlette request read into the plain data the gateway takes
  build.py           building the gateway whole: every part made once, in order, given what it needs
  admin.py           /basin/ state, sessions, budget, reloads, shadow mode
  gateway.py         the request path: identify, admit or queue, stamp, forward, record; its settings, its lifecycle
  inbound.py         one call as the edge hands it down: headers read, body chunks, the client's disconnect
  paths.py           the request targets passed through
  limits.py          input limits: body size, bodies in flight, JSON depth and values, session ids
  json_scan.py       scanning JSON bytes without parsing them
  calls.py           parsing and validating an inference call
  resend.py          reading a resent conversation from its new part on
  memo.py            what a session keeps of its last prompt (prefix, counts)
  measure.py         prompt tokens and task text, as ingest counts them
  predictors.py      peak predictors per workload
  sessions.py        session identity, per-session records, the registry
  identity.py        which conversation a session id names: first-call head and API key, foreign calls
  restart.py         the live-sessions file and adoption after a restart
  waiting.py         the waiting room: the policy under a lock, waiting, withdrawal, timers
  recovery_holds.py  a live session held by recovery: its next call waits until it is resumed
  priority.py        bounded engine priority levels, the routing key, request ids
  upstream.py        the `UpstreamClient` protocol (the seam tests put a double behind)
  http1.py           the one upstream client: HTTP/1.1 on asyncio protocols and httptools
  proxy.py           forwarding upstream and streaming the answer back (and reading its usage)
  sse.py             framing server-sent events and what the relay learns from them
  signals.py         per-call usage from the upstream's answers
  engine_metrics.py  the windowed hit rate scraped from the engines' /metrics counters (when configured)
  engine_sessions.py /close_session to every engine at a session's end (engine_session_cache)
  lending.py         what engines report per session: the decode instance that served, cached tiers
  metrics.py         the Prometheus metrics, in a registry per app
  telemetry.py       metrics, hit-rate and latency signals, lending and the session log: the room's listener
  session_log.py     the durable, rotating session-log writer (a thread fed by a queue)
  task_memory.py     the memory of finished tasks: first-call predictions shrunk toward their task's peaks
  errors.py          the error tree and the one mapping to HTTP status codes

Nothing is imported here eagerly: importing one module (say `basin_runtime.gateway.config`) must
not start the whole app's import graph. Import from the modules themselves.
"""

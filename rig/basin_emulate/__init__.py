"""basin-emulate: an SGLang-compatible HTTP server (prefill or decode role of a PD deployment) whose
work is modeled by basin_sim in real time, on CPU. The real router (smg) accepts it in PD mode.

The engines drive basin_sim's instances with the simulator's own steps (`DecodeInstance.grant` and
`withdraw`, `PrefillInstance.start_batch` and `finish_batch`, `storage.plan_prefetch` and
`Prefetches`), timed by the model clock instead of the simulator's event loop.

Modules, one job each:
  config.py          options (SGLang's flag names and defaults), `EmulatorConfig`, `ConfigError`
  clock.py           model time vs the wall clock (--time-scale), timed events, their lag window
  ordering.py        the queue key of a request's priority (FCFS, or priority scheduling)
  identity.py        token counts (memoized per message) and which cache chain a prompt continues
  prefill_engine.py  basin_sim's PrefillInstance + RadixCache driven in real time, KV transfer
  decode_engine.py   basin_sim's DecodeInstance driven in real time, tokens as they are emitted
  session_refs.py    SGLang's session references on the prefix cache: which session tag holds which chain
  bootstrap.py       the rendezvous of a request's two halves on the prefill's bootstrap port
  storage.py         the HiCache storage tier as SGLang's file backend: a folder emulators share
  calls.py           parsing an inference request as SGLang does
  responses.py       answers and stream chunks in SGLang's shapes, synthetic text
  metrics.py         Prometheus metrics under SGLang's names, plus the emulator's lag
  errors.py          the error tree and its HTTP responses
  context.py         what both roles share; awaiting work unless the client leaves
  prefill_server.py  the prefill role's request path
  decode_server.py   the decode role's request path
  server.py          routes, info endpoints, lifespan; building the app from the config
  cli.py             `basin-emulate` / `python -m basin_emulate`
"""

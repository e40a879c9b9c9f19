"""`basin-emulate`: parse the options, build the server, serve it with uvicorn.

Rules:
- A bad option or value ends start-up with one line on stderr naming it, and exit status 2; never a
  traceback (argparse's usage text included: the line says what was wrong).
- Logging is configured here and only here.
- The event loop is asyncio's own, not uvloop (which uvicorn would pick): uvloop's `loop.time()` is
  cached per loop iteration at millisecond resolution, which at --time-scale 20 blurs model time by
  20 ms; asyncio's is `time.monotonic()`. (HTTP parsing still uses httptools when installed.)
"""

from __future__ import annotations

import sys

import uvicorn

from basin_emulate.config import ConfigError, parse_config
from basin_emulate.server import build_app
from basin_runtime.logs import TIMED_LINE, configure_logging


def main(argv: list[str] | None = None) -> int:
    """Serve one emulated prefill or decode server until interrupted; 2 if it cannot start."""
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"basin-emulate: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, TIMED_LINE)
    app = build_app(config)
    uvicorn.run(app, host=config.host, port=config.port, loop="asyncio", log_config=None, access_log=False,
                lifespan="on")
    return 0

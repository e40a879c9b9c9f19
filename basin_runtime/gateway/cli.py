# `basin-gateway`: parse the options, load everything, serve with uvicorn.
#
# Rules:
# - A bad option, config, model or calibration file ends start-up with one line on stderr naming
#   the file or option, and exit status 2; never a traceback.
# - Logging is configured here and only here. Binding beyond loopback without an admin token is
#   allowed but warned about: anyone who can reach the port could end sessions.
# - SIGTERM (or Ctrl-C) drains before uvicorn's own graceful shutdown: the gateway stops admitting
#   (queued calls get 503 `shutting_down` at once), uvicorn closes the listener and lets live calls
#   finish for up to `drain_timeout_s` (then cuts them), and the app's lifespan logs every session
#   still held as `shutdown` and lists it for the next run to adopt. A second Ctrl-C forces the exit.
"""Command-line entry point of the gateway."""

from __future__ import annotations

import logging
import math
import socket
import sys
from collections.abc import Awaitable, Callable

import uvicorn

from basin_runtime.gateway.app import build_app
from basin_runtime.gateway.config import ConfigError, build_parser, load_config

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
CHATTY_LOGGERS = ("httpx", "httpcore")  # a line per upstream request at INFO; only worth it when debugging


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until interrupted; 2 if it cannot start."""
    args = build_parser().parse_args(argv)
    try:
        config = load_config(vars(args))
        _configure_logging(config.log_level)
        app = build_app(config)
    except ConfigError as exc:
        print(f"basin-gateway: error: {exc}", file=sys.stderr)
        return 2
    if config.admin_token is None and not (config.host in LOOPBACK_HOSTS or config.host.startswith("127.")):
        logger.warning("binding %s without an admin token: anyone who can reach it can end sessions "
                       "(set --admin-token or admin_token in the config file)", config.host)
    logger.info("basin-gateway on http://%s:%d in front of %s", config.host, config.port, config.upstream)
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                           access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=max(1, math.ceil(config.drain_timeout_s))),
                            drain=app.state.gateway.drain)
    server.run()
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the gateway before its graceful shutdown starts."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await self._drain()
        except Exception:  # the shutdown itself must go on
            logger.exception("draining the gateway failed")
        await super().shutdown(sockets)


def _configure_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(level if level == logging.DEBUG else logging.WARNING)

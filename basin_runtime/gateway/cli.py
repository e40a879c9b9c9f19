"""Command-line entry point of the gateway.

Rules:
- A bad option, config, model or calibration file ends start-up with one line on stderr naming
  the file or option, and exit status 2; never a traceback.
- Logging is configured here and only here.
- With `--state`, a replica whose policy configuration differs from the shared state's is refused like
  a bad option (one line naming the fields); an unreachable Redis is not (it starts, answering new
  sessions 503 `state_unavailable` until Redis can be reached).
- Binding beyond loopback (127.0.0.0/8, ::1, localhost; `0.0.0.0` and `::` are every address)
  without an admin token ends start-up like a bad option: every /basin/ endpoint would be open to
  whoever reaches the port. `--insecure-admin` (`insecure_admin: true`) starts anyway, with a
  warning naming them.
- SIGTERM (or Ctrl-C) drains (`server.DrainingServer`): the gateway keeps listening and answers every new
  call 503 `shutting_down` (queued ones at once), lets the calls in flight finish for up to `drain_timeout_s`
  (then cuts them with a JSON answer or error event), then uvicorn's own shutdown closes the listener and the
  app's lifespan logs every session still held as `shutdown` and lists it for the next run to adopt. A second
  Ctrl-C forces the exit.
- uvicorn keeps an idle client connection `keep_alive_s` (its own default, 5 s, is what the httpx and
  openai pools wait before reusing one, so the two race and the client gets a reset).
- uvicorn's proxy-headers middleware is off: the gateway reads no client address (a layer per request).
- uvicorn runs with the gateway's own HTTP protocol and options (`server.server_config`).
- With a calibration, start-up reads the engines' cache capacity through the upstream (`capacity.py`) and
  refuses, like a bad option, a calibration more than 25% off it (unless `--allow-calibration-mismatch`);
  engines that cannot tell are a warning. Start-up logs the budget and its source, the model and the
  calibration file, and how far the adaptive budget may rise (to the calibration's completion peak, or,
  a file without one, max_fraction x B as before, said so).
"""

from __future__ import annotations

import ipaddress
import logging
import sys

import httpx

from basin_runtime.calibration import Calibration
from basin_runtime.gateway.app import build_app
from basin_runtime.gateway.capacity import CapacityMismatch, CapacityUnknown, check_capacity, read_capacity
from basin_runtime.gateway.config import ConfigError, GatewayConfig, build_parser, load_config, read_calibration
from basin_runtime.gateway.server import DrainingServer, server_config
from basin_runtime.logs import TIMED_LINE, configure_logging
from basin_runtime.policy import PolicyConfig

logger = logging.getLogger(__name__)

OPEN_ENDPOINTS = ("GET /basin/state", "GET /basin/sessions", "PUT /basin/budget", "POST /basin/reload",
                  "PUT /basin/shadow", "POST /basin/sessions/{id}/end (ending any session)")
CHATTY_LOGGERS = ("httpx", "httpcore")  # a line per upstream request at INFO; only worth it when debugging


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until interrupted; 2 if it cannot start."""
    args = build_parser().parse_args(argv)
    try:
        config = load_config(vars(args))
        configure_logging(config.log_level, TIMED_LINE, CHATTY_LOGGERS)
        check_admin_exposure(config)
        app = build_app(config)
        check_shared_state(config, app.state.gateway.room.policy.config)
        calibration = None if config.calibration is None else read_calibration(config.calibration, config)
        with httpx.Client(timeout=config.upstream_connect_timeout_s) as client:
            check_engine_capacity(config, calibration, client)
    except ConfigError as exc:
        print(f"basin-gateway: error: {exc}", file=sys.stderr)
        return 2
    logger.info("basin-gateway on http://%s:%d in front of %s", config.host, config.port, config.upstream)
    logger.info("%s", startup_summary(config, calibration, app.state.gateway.room.policy.config))
    server = DrainingServer(server_config(app, host=config.host, port=config.port, keep_alive_s=config.keep_alive_s,
                                          limits=config.connection_limits),
                            app.state.gateway, drain_timeout_s=config.drain_timeout_s,
                            clock=app.state.gateway.room.clock)
    server.run()
    return 0


def is_loopback(host: str) -> bool:
    """True if `host` binds only the loopback interface (127.0.0.0/8, ::1, localhost)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def check_admin_exposure(config: GatewayConfig) -> None:
    """`ConfigError` if the admin endpoints would be open beyond loopback; a warning if told to allow it."""
    if config.admin_token is not None or is_loopback(config.host):
        return
    endpoints = ", ".join(OPEN_ENDPOINTS)
    if not config.insecure_admin:
        raise ConfigError(f"host {config.host}: binding beyond loopback without an admin token would leave every "
                          f"/basin/ endpoint open to whoever reaches the port ({endpoints}); set --admin-token "
                          f"(or admin_token: in the config file), or pass --insecure-admin (insecure_admin: true) "
                          f"to run it open anyway")
    logger.warning("--insecure-admin: binding %s without an admin token; whoever reaches the port can use %s",
                   config.host, endpoints)


def check_shared_state(config: GatewayConfig, policy_config: PolicyConfig) -> None:
    """With `--state`: `ConfigError` if the other replicas run another policy configuration (each would then
    decide differently from the same steps)."""
    if config.state is None:
        return
    from basin_runtime.state.redis_backend import StateConfigError, check_config

    try:
        check_config(config.state, policy_config)
    except StateConfigError as exc:
        raise ConfigError(f"--state {config.state}: {exc}") from None


def check_engine_capacity(config: GatewayConfig, calibration: Calibration | None, client: httpx.Client) -> None:
    """With a calibration: its cache capacity against the engines' (`capacity.py`); `ConfigError` if more than
    25% apart (unless allowed), a warning if the engines cannot tell."""
    if calibration is None:
        return
    try:
        capacity = read_capacity(client, config.upstream)
    except CapacityUnknown as exc:
        logger.warning("cannot read the engines' cache capacity (%s): calibration %s (cache %s tokens) is not "
                       "checked against them", exc, config.calibration, f"{calibration.cache_capacity_tokens:,.0f}")
        return
    try:
        logger.info("%s", check_capacity(calibration.cache_capacity_tokens, capacity, str(config.calibration),
                                         config.allow_calibration_mismatch))
    except CapacityMismatch as exc:
        raise ConfigError(str(exc)) from None


def startup_summary(config: GatewayConfig, calibration: Calibration | None, policy: PolicyConfig) -> str:
    """One line: the budget and where it comes from, the model file, the calibration file."""
    if config.budget_tokens is not None:
        budget = "--budget-tokens"
    elif calibration is not None:
        budget = (f"from the calibration: knee {calibration.knee_tokens:,.0f}, cache "
                  f"{calibration.cache_capacity_tokens:,.0f} tokens")
    else:
        budget = "no calibration"
    workloads = f" (+{len(config.workload_models)} workload models)" if config.workload_models else ""
    return (f"budget {policy.budget_tokens:,} tokens ({budget}); model {config.default_model}{workloads}; "
            f"calibration {config.calibration or 'none'}; reservation quantile {config.reservation_quantile}; "
            f"{ceiling_summary(calibration, policy)}{'; SHADOW mode: no call is held' if config.shadow else ''}")


def ceiling_summary(calibration: Calibration | None, policy: PolicyConfig) -> str:
    """How far the adaptive budget may rise: to the completion peak's ceiling, or (old behaviour) max_fraction x B."""
    knee_bound = f"up to {policy.budget_max_fraction:g} x the reference budget"
    if not policy.completion_budget:
        return f"budget moves {knee_bound} (completion_budget off)"
    if policy.budget_ceiling_tokens is not None:
        peak = "" if calibration is None or calibration.completion_peak_tokens is None else \
            f", completion peak {calibration.completion_peak_tokens:,.0f} working-set tokens"
        return f"budget may rise to {policy.budget_ceiling_tokens:,} tokens while the hit rate holds{peak}"
    if calibration is not None:
        return f"budget moves {knee_bound}: the calibration has no completion_peak_tokens (re-measure to add it)"
    return f"budget moves {knee_bound}"

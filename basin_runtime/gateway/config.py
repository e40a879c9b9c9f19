"""The gateway's options, each declared once on its `GatewayConfig` field, read and resolved.

The parser (`options.py`), the config file's checks and the option reference (`options_doc.py`) are derived
from those declarations.

Rules:
- Every option can come from the command line or the config file (YAML or JSON, keys spelled as the long
  options with `_` or `-`); the command line wins, then the file, then the defaults. Policy tuning (any
  `PolicyConfig` field but the budget) lives in the file's `policy:` section, which has no flag.
- An option is a field of `GatewayConfig` made by `options.option(...)`: its check
  (`basin_runtime.schema`), unit, help, and how the command line takes it. Values from either source pass
  the same check.
- `model` is a list of `PATH` (the default model; exactly one) and `WORKLOAD=PATH` entries, kept as
  `default_model` and `workload_models`. Paths in the file are relative to the file; paths on the command
  line to the working directory.
- The budget is `budget_tokens` if given, else computed from the `calibration` file; one of the two is
  required (checked where the calibration is read, `calibration.py`).
- Any bad key or value raises `ConfigError` naming where it came from, the key and the value.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from basin_runtime.calibration import Calibration, CalibrationError, load_calibration
from basin_runtime.gateway.identity import FOREIGN_CALLS
from basin_runtime.gateway.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
    DEFAULT_MAX_CONTENT_PARTS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_JSON_ITEMS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_SESSION_ID_CHARS,
    DEFAULT_MAX_TOOLS,
    MAX_JSON_DEPTH_CEILING,
    Limits,
)
from basin_runtime.gateway.options import (
    COUNT,
    HEADER_NAME,
    HTTP_URL,
    PATH,
    POSITIVE,
    SECONDS,
    STATE_URL,
    CallNumbers,
    PolicySection,
    add_options,
    declared_options,
    option,
)
from basin_runtime.gateway.priority import (
    DEFAULT_NUM_LEVELS,
    DEFAULT_PREEMPTION_THRESHOLD,
    MAX_NUM_LEVELS,
    ROUTING_KEY_HEADER,
)
from basin_runtime.gateway.resend import DEFAULT_MAX_PREFIX_BYTES
from basin_runtime.gateway.server import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_IDLE_CONNECTIONS_PER_CLIENT,
    ConnectionLimits,
)
from basin_runtime.model_files import file_sha256
from basin_runtime.policy import PolicyConfig, PolicyError
from basin_runtime.policy.calibrated import check_serves, policy_config
from basin_runtime.policy.hit_rate import DEFAULT_MIN_PROMPT_TOKENS, DEFAULT_WINDOW_S
from basin_runtime.predictor import reservation_quantile_arg
from basin_runtime.schema import BadKeys, BadValue, Flag, ListOf, Maybe, Number, OneOf, Text, Whole, read_keys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_REVISE_AT_CALLS: tuple[int, ...] | None = None  # the online model's slots; () never (the paper's Basin)
MIN_HEADER_BYTES = 1024


class ConfigError(ValueError):
    """An option, config file, model or calibration file the gateway cannot start with."""


# --- the options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway is started with; each option declared once, here (see the rules)."""

    upstream: str = option(check=HTTP_URL, metavar="URL",
                           help="SGLang router (or server) base URL, e.g. http://127.0.0.1:8000")
    default_model: Path = option(
        check=ListOf(Text(), min_items=1, one_ok=True, says="PATH or WORKLOAD=PATH entries"), name="model",
        cli="append", metavar="[WORKLOAD=]PATH", is_path=True,
        help="peak predictor (.onnx); one plain PATH is the default model; repeat with WORKLOAD=PATH")
    workload_models: Mapping[str, Path] = field(default_factory=dict)  # from `model`'s WORKLOAD=PATH entries
    reservation_quantile: float | None = option(
        0.9, Maybe(Number(gt=0, lt=1), says="a quantile in (0, 1), or null for the bare prediction"),
        "reserve m(Q) x the predicted peak, m from the model file (`basin_runtime/predictor.py`), so a share Q of "
        "sessions fit their reservation ('none' reserves the bare prediction)", metavar="Q",
        text=reservation_quantile_arg)
    revise_at_calls: tuple[int, ...] | None = option(
        DEFAULT_REVISE_AT_CALLS,
        Maybe(CallNumbers(Whole(min=2, says="a call number >= 2 (the first call is predicted, not revised)"),
                          one_ok=True, says="call numbers >= 2 (the first call is predicted, not revised)"),
              says="call numbers >= 2, [] for never, or null for the online model's own calls"),
        "re-estimate a session's peak at these calls with the online model beside the model file (e.g. 3 5; "
        "the flag with no number, or [] in a file, never revises, as the paper's Basin)", cli="list",
        metavar="K", default_text="the calls the online model is trained for, its slots 2 3 4 5 7 10")
    budget_tokens: int | None = option(None, Maybe(COUNT), "reference cache budget in tokens (wins over "
                                       "--calibration)", unit="tokens", metavar="N")
    calibration: Path | None = option(
        None, PATH, "JSON: knee_tokens, cache_capacity_tokens [, hit_rate_plateau, peak_completion_rate_per_s, "
        "reservation_ratio], measured for these engines (`basin-sim knee --out` for a modelled deployment, "
        "`basin-live-ramp` against live ones)", metavar="FILE", is_path=True)
    task_memory: Path | None = option(
        None, PATH, "the memory of finished tasks: shrink each new session's predicted peak toward the peaks of "
        "its task's sessions that ended here, by the k in this file (`metrics/task_memory.json`, stage "
        "task_memory); with --state the peaks are in the shared Redis, every replica's sessions for every replica",
        metavar="FILE", is_path=True, default_text="off")
    allow_calibration_mismatch: bool = option(
        False, Flag(), "start with a calibration whose cache_capacity_tokens is more than 25% off the engines' own "
        "(max_total_num_tokens of the prefill engines, read at start-up through the upstream; refused otherwise)")
    host: str = option("127.0.0.1", Text(), "address to bind")
    port: int = option(8080, COUNT, "port to bind", metavar="PORT")
    always_engaged: bool = option(False, Flag(), "queue every arrival, even while under the budget")
    latency_gate: bool = option(
        False, Flag(), "beyond the paper: the working set engages admission only while the engines' first-token "
        "latency reaches the calibration's gate (plateau latency + 3 call cycles)")
    session_header: str = option("X-Session-ID", Text(), "header holding the session id", metavar="NAME")
    foreign_call: str = option(
        "new-session", OneOf(FOREIGN_CALLS, says=f"one of {', '.join(FOREIGN_CALLS)}"),
        "a call under a held session's id that does not continue its conversation (other first messages, or "
        "another API key; `identity.py`): 'new-session' admits it as a session of its own, 'refuse' answers a "
        "JSON 409 session_id_in_use", metavar="|".join(FOREIGN_CALLS))
    workload_header: str = option("X-Basin-Workload", Text(), "header naming the workload's model", metavar="NAME")
    idle_timeout_s: float = option(600.0, SECONDS, "end a session after this long without calls", unit="s")
    tick_interval_s: float = option(1.0, SECONDS, "policy tick period", unit="s")
    upstream_timeout_s: float = option(900.0, SECONDS, "longest wait for upstream bytes", unit="s")
    upstream_connect_timeout_s: float = option(10.0, SECONDS, "longest wait to connect upstream", unit="s")
    # uvicorn's own default, 5 s, equals the idle time of the httpx / openai pools, so a client reusing a
    # connection at 5 s races the close and gets a reset: 90 s is above every common client pool (httpx and
    # openai 5 s, aiohttp 15 s) and load balancer (60 s), as smg's own.
    keep_alive_s: float = option(90.0, SECONDS, "how long an idle client connection is kept open (keep it above "
                                 "the idle time of the clients' pools and of any proxy in front)", unit="s")
    retry_after_s: float = option(60.0, SECONDS, "Retry-After of a shed session's 503", unit="s")
    admin_token: str | None = option(
        None, Maybe(Text()), "bearer token required on /basin/ endpoints, and the secret of the sessions' end keys "
        "(prefer the config file: the command line is visible to other local users)", metavar="TOKEN",
        default_text="none")
    insecure_admin: bool = option(False, Flag(), "bind beyond loopback without an admin token, every /basin/ "
                                  "endpoint open to whoever reaches the port (refused otherwise)")
    tokenizer: str = option("qwen3.6", Text(), "serving tokenizer", metavar="NAME")
    task_text_pattern: str | None = option(None, Maybe(Text()), "regex narrowing the task text in the first user "
                                           "message", metavar="REGEX", default_text="the whole message")
    log_level: str = option("info", OneOf(LOG_LEVELS, says=f"one of {', '.join(LOG_LEVELS)}"),
                            "how much the gateway logs")
    policy: Mapping[str, Any] = option(check=PolicySection(), factory=dict, flag=None,
                                       help="policy tuning: PolicyConfig fields but budget_tokens and always_engaged")
    shadow: bool = option(False, Flag(), "decide and report everything but hold no call (safe rollout)")
    hit_rate_window_s: float = option(DEFAULT_WINDOW_S, SECONDS, "window of the prefix hit rate fed to the policy",
                                      unit="s")
    hit_rate_min_prompt_tokens: int = option(DEFAULT_MIN_PROMPT_TOKENS, COUNT, "prompt tokens the window needs "
                                             "before the hit rate counts", unit="tokens", metavar="N")
    engine_metrics_urls: Sequence[str] = option(
        (), ListOf(HTTP_URL, one_ok=True, says="a list of http(s):// URLs"),
        "an engine's Prometheus /metrics URL (repeat per engine); when given, the hit rate fed to the policy comes "
        "from their counters (the upstream's usage only while they have no evidence)", flag="--engine-metrics",
        cli="append", metavar="URL", default_text="none")
    engine_metrics_interval_s: float = option(5.0, SECONDS, "engine /metrics scrape period", unit="s")
    engine_session_cache: bool = option(
        False, Flag(), "the engines run SGLang's --enable-session-radix-cache: every forwarded call carries its "
        "session's routing key as top-level `session_id` (a client's own is replaced), and at the session's end "
        "the gateway POSTs /close_session to each engine URL in the background (smg routes no /close_session); "
        "a failed close is counted in basin_engine_session_close_failures_total and logged, never seen by a call")
    engine_urls: Sequence[str] = option(
        (), ListOf(HTTP_URL, one_ok=True, says="a list of http(s):// URLs"),
        "an engine's base URL (repeat per prefill and decode engine) that engine_session_cache closes sessions on",
        flag="--engine-url", cli="append", metavar="URL",
        default_text="the engine_metrics URLs without their /metrics path")
    engine_close_timeout_s: float = option(5.0, SECONDS, "longest wait for one engine's /close_session answer",
                                           unit="s")
    session_log: Path | None = option(None, PATH, "append each finished session to this JSONL file",
                                      metavar="PATH", is_path=True, default_text="none")
    session_log_max_bytes: int = option(256 << 20, POSITIVE, "rotate the session log past this size", unit="bytes",
                                        metavar="N")
    session_log_keep_files: int = option(20, COUNT, "rotated session-log files kept", metavar="N")
    session_log_keep_text: bool = option(
        False, Flag(), "keep the raw task text (users' code and prompts) in the session log, which retraining from "
        "the log needs", cli="yes-no", metavar="yes|no", default_text="no: only lengths and token counts")
    live_sessions_file: Path | None = option(
        None, PATH, "where the live sessions are listed for the next run to adopt after a restart", metavar="PATH",
        is_path=True, default_text="beside the session log as <stem>.live.json; without either, no session is "
                                   "adopted")
    adoption_window_s: float = option(600.0, SECONDS, "how long after start-up a listed session may resume "
                                      "without queueing", unit="s")
    drain_timeout_s: float = option(30.0, SECONDS, "on SIGTERM, how long live calls may run to their end before "
                                    "they are cut", unit="s")
    engine_priority_levels: int = option(
        DEFAULT_NUM_LEVELS, Whole(min=1, max=MAX_NUM_LEVELS), "distinct priority values sent to the engines: a "
        "session's rank among live and queued sessions, bucketed (`priority.py`)", metavar="N")
    engine_preemption_threshold: int = option(
        DEFAULT_PREEMPTION_THRESHOLD, COUNT, "the engines' --priority-scheduling-preemption-threshold; levels are "
        "spaced one past it so a more urgent level may preempt", metavar="N")
    routing_key_header: str = option(ROUTING_KEY_HEADER, HEADER_NAME, "header carrying the session's routing key "
                                     "to the router, smg's --routing-key-headers (sticky sessions)", metavar="NAME")
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, POSITIVE, "largest request body accepted, refused with "
                                 "413 while it is read", unit="bytes", metavar="N")
    max_json_depth: int = option(DEFAULT_MAX_JSON_DEPTH, Whole(min=3, max=MAX_JSON_DEPTH_CEILING),
                                 "deepest JSON nesting accepted in a request body (a chat body is 3 deep)",
                                 metavar="N")
    max_session_id_chars: int = option(DEFAULT_MAX_SESSION_ID_CHARS, POSITIVE, "longest session id accepted, from "
                                       "the header or `user`", unit="chars", metavar="N")
    max_json_items: int = option(DEFAULT_MAX_JSON_ITEMS, POSITIVE, "most JSON values a request body may hold, "
                                 "counted before it is parsed, refused with 413", metavar="N")
    max_messages: int = option(DEFAULT_MAX_MESSAGES, POSITIVE, "most messages in a chat call, refused with 413",
                               metavar="N")
    max_tools: int = option(DEFAULT_MAX_TOOLS, POSITIVE, "most tools in a chat call, refused with 413", metavar="N")
    max_content_parts: int = option(DEFAULT_MAX_CONTENT_PARTS, POSITIVE, "most content parts in all of a chat "
                                    "call's messages, refused with 413", metavar="N")
    max_body_bytes_in_flight: int = option(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, POSITIVE, "bytes of large request bodies (1 MiB or more) read and handled "
        "at once; a body past it is refused with 503 and Retry-After (at least max_body_bytes)", unit="bytes",
        metavar="N")
    max_header_bytes: int = option(
        DEFAULT_MAX_HEADER_BYTES, Whole(min=MIN_HEADER_BYTES, says=f"a whole number of bytes >= {MIN_HEADER_BYTES} "
                                        f"(a request line and a few ordinary headers)"),
        "largest request head (request line and headers), refused with 431; also the largest answer head taken "
        "from the upstream", unit="bytes", metavar="N")
    max_headers: int = option(DEFAULT_MAX_HEADERS, POSITIVE, "most headers in a request, refused with 431",
                              metavar="N")
    header_timeout_s: float = option(
        DEFAULT_HEADER_TIMEOUT_S, SECONDS, "longest wait for a request head, from the connection's opening (or a "
        "kept-alive connection's next byte); past it a head begun gets a JSON 408 and the connection is closed",
        unit="s")
    body_timeout_s: float = option(
        DEFAULT_BODY_TIMEOUT_S, SECONDS, "longest wait for a request body, from the end of its head; past it the "
        "request gets a JSON 408 and the connection is closed", unit="s")
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS, POSITIVE, "most client connections open at once; one more closes the oldest idle "
        "one (or itself, if none is idle); keep it below the process's open-file limit (ulimit -n)", metavar="N")
    max_idle_connections_per_client: int = option(
        DEFAULT_MAX_IDLE_CONNECTIONS_PER_CLIENT, POSITIVE, "most idle connections (no request under way) one client "
        "address keeps open; one more closes its oldest idle one", metavar="N")
    resend_memo_bytes: int = option(
        DEFAULT_MAX_PREFIX_BYTES, COUNT, "bytes of the sessions' last request bodies kept, so that a resent "
        "conversation is read from its new messages on (0: read every body in full; `resend.py`)", unit="bytes",
        metavar="N")
    state: str | None = option(
        None, Maybe(STATE_URL), "share the admission state with other gateway replicas through Redis or Valkey, "
        "redis://HOST:PORT/DB (`basin_runtime/state/`)", metavar="URL", default_text="in this process only")
    state_lease_s: float = option(5.0, Number(ge=0.5, says="a lease of at least 0.5 s"), "with --state: a replica "
                                  "silent this long is dead, and its sessions' reservations return to the budget "
                                  "(within two beats more: 0.5 s at most)", unit="s")

    @property
    def limits(self) -> Limits:
        """The input limits (`limits.py`)."""
        return Limits(self.max_body_bytes, self.max_json_depth, self.max_session_id_chars, self.max_json_items,
                      self.max_messages, self.max_tools, self.max_content_parts, self.max_body_bytes_in_flight)

    @property
    def connection_limits(self) -> ConnectionLimits:
        """What the server holds each client connection to (`server.py`)."""
        return ConnectionLimits(self.max_header_bytes, self.max_headers, self.header_timeout_s, self.body_timeout_s,
                                self.max_connections, self.max_idle_connections_per_client)

    def __post_init__(self) -> None:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ConfigError(f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                              f"max_body_bytes ({self.max_body_bytes}): the largest body accepted could never be read")
        if self.engine_session_cache and not self.session_close_urls:
            raise ConfigError("engine_session_cache: no engine to close sessions on; give each prefill and decode "
                              "engine as --engine-url URL (or engine_metrics URLs ending in /metrics)")

    @property
    def session_close_urls(self) -> tuple[str, ...]:
        """The engines `engine_session_cache` closes sessions on: `engine_urls`, else the engine_metrics URLs that
        end in /metrics, without it."""
        if self.engine_urls:
            return tuple(self.engine_urls)
        return tuple(url.removesuffix("/metrics") for url in self.engine_metrics_urls if url.endswith("/metrics"))


OPTIONS = declared_options(GatewayConfig)
CONFIG_KEYS = frozenset(OPTIONS)


# --- the command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The `basin-gateway` argument parser (options left out stay unset, so the file can supply them)."""
    parser = argparse.ArgumentParser(
        prog="basin-gateway", argument_default=argparse.SUPPRESS,
        description="Session gateway in front of an SGLang router: admits agent sessions by predicted peak context.",
    )
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML or JSON file with any of these options "
                        "(the command line wins); policy tuning goes in its `policy:` section")
    add_options(parser, OPTIONS.values())
    return parser


# --- reading and resolving -----------------------------------------------------------------------


def load_config(options: Mapping[str, Any]) -> GatewayConfig:
    """Resolve parsed command-line options (and the config file they may name) into a `GatewayConfig`."""
    values: dict[str, Any] = {}
    config_path = options.get("config")
    if config_path is not None:
        values.update(_read_file(Path(config_path)))
    values.update(_checked("command line", {k: v for k, v in options.items() if k != "config"}))
    return _resolve(values)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: a config file must hold a mapping of options, not {type(raw).__name__}")
    keys = {str(raw_key).replace("-", "_"): raw_key for raw_key in raw}
    unknown = [raw_key for key, raw_key in keys.items() if key not in OPTIONS]
    if unknown:
        raise ConfigError(f"{path}: unknown option {unknown[0]!r}; known: {', '.join(sorted(OPTIONS))}")
    values = _checked(str(path), {key: raw[raw_key] for key, raw_key in keys.items()})
    return {key: _relative_to(path.parent, key, value) for key, value in values.items()}


def _checked(source: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against their options' declarations; `ConfigError` naming `source`, key and value."""
    try:
        return read_keys(values, {name: declared.option for name, declared in OPTIONS.items()})
    except BadValue as exc:
        raise ConfigError(f"{source}: {exc.key}: expected {exc.expected}, got {exc.value!r}") from None
    except BadKeys as exc:  # the policy section (the top level's keys were matched before)
        raise ConfigError(f"{source}: {exc.where}: unknown field(s) {exc.unknown}; known: {exc.known}") from None


def _relative_to(base: Path, key: str, value: Any) -> Any:
    if not OPTIONS[key].option.is_path or value is None:
        return value
    if key == "model":
        return tuple(_rebase_model(entry, base) for entry in value)
    return str(base / value)


def _rebase_model(entry: str, base: Path) -> str:
    workload, sep, path = entry.partition("=")
    return f"{workload}={base / path}" if sep else str(base / entry)


def _resolve(values: dict[str, Any]) -> GatewayConfig:
    if "upstream" not in values:
        raise ConfigError("no upstream: give --upstream URL (the SGLang router) or `upstream:` in the config file")
    default_model, workload_models = _split_models(values.pop("model", ()))
    for key, declared in OPTIONS.items():
        if declared.option.is_path and values.get(key) is not None:  # `model`'s entries were split above
            values[key] = Path(values[key])
    session_log = values.get("session_log")
    if values.get("live_sessions_file") is None and session_log is not None:
        values["live_sessions_file"] = session_log.with_name(f"{session_log.stem}.live.json")
    return GatewayConfig(default_model=default_model, workload_models=workload_models, **values)


def _split_models(entries: Sequence[str]) -> tuple[Path, dict[str, Path]]:
    defaults: list[Path] = []
    by_workload: dict[str, Path] = {}
    for entry in entries:
        workload, sep, path = entry.partition("=")
        if not sep:
            defaults.append(Path(entry))
        elif not workload or not path:
            raise ConfigError(f"model: {entry!r} is not PATH or WORKLOAD=PATH")
        elif workload in by_workload:
            raise ConfigError(f"model: workload {workload!r} is given twice")
        else:
            by_workload[workload] = Path(path)
    if len(defaults) != 1:
        raise ConfigError(f"model: give exactly one default model (a plain PATH), got {len(defaults)}: "
                          f"{[str(p) for p in defaults]}")
    return defaults[0], by_workload


def read_calibration(path: Path, config: GatewayConfig) -> Calibration:
    """The calibration file at `path`, measured for the default model file and quantile `config` serves (when
    the file says what it was measured for); `ConfigError` naming the file, key and value."""
    try:
        calibration = load_calibration(path)
    except CalibrationError as exc:
        raise ConfigError(str(exc)) from exc
    if config.policy.get("mode", "basin") == "prototype":
        return calibration  # reservations are contexts: r does not apply, whatever it was measured for
    try:
        sha = "none" if calibration.predictor_sha256 is None else file_sha256(config.default_model)
        check_serves(calibration, sha, config.reservation_quantile)
    except OSError as exc:
        raise ConfigError(f"{config.default_model}: cannot read the model file: {exc}") from exc
    except PolicyError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return calibration


def gateway_policy_config(config: GatewayConfig, calibration: Calibration | None) -> PolicyConfig:
    """The policy's configuration: `policy_config` over the calibration, the `policy:` section and the budget."""
    if config.budget_tokens is None and calibration is None:
        raise ConfigError("no budget: give --budget-tokens N or --calibration FILE")
    try:
        return policy_config(calibration, {"always_engaged": config.always_engaged, **config.policy},
                             budget_tokens=config.budget_tokens, latency_gate=config.latency_gate)
    except (PolicyError, TypeError) as exc:
        raise ConfigError(f"policy configuration: {exc}") from exc

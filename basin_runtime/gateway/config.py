# The gateway's options: command line, config file, defaults.
#
# Rules:
# - Every option can come from the command line or the config file (YAML or JSON, keys spelled as
#   the long options with `_` or `-`); the command line wins, then the file, then the defaults.
#   Policy tuning (any `PolicyConfig` field but the budget) lives in the file's `policy:` section.
# - `model` is a list of `PATH` (the default model; exactly one) and `WORKLOAD=PATH` entries. Paths
#   in the file are relative to the file; paths on the command line to the working directory.
# - The budget is `budget_tokens` if given, else computed from the `calibration` file; one of the
#   two is required (checked where the calibration is read, `calibration.py`).
# - Any bad key or value raises `ConfigError` naming where it came from, the key and the value.
"""Gateway options: the argument parser, the config file, and the resolved `GatewayConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from basin_runtime.calibration import Calibration, CalibrationError, load_calibration
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
from basin_runtime.gateway.priority import (
    DEFAULT_NUM_LEVELS,
    DEFAULT_PREEMPTION_THRESHOLD,
    MAX_NUM_LEVELS,
    ROUTING_KEY_HEADER,
)
from basin_runtime.gateway.resend import DEFAULT_MAX_PREFIX_BYTES
from basin_runtime.model_files import file_sha256
from basin_runtime.policy import PolicyConfig, PolicyError
from basin_runtime.policy.calibrated import check_serves, policy_config
from basin_runtime.policy.hit_rate import DEFAULT_MIN_PROMPT_TOKENS, DEFAULT_WINDOW_S
from basin_runtime.predictor import reservation_quantile_arg

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_REVISE_AT_CALLS: tuple[int, ...] = ()  # the paper's Basin never revises (beyond it: --revise-at-calls 3 5)
MIN_HEADER_BYTES = 1024


class ConfigError(ValueError):
    """An option, config file, model or calibration file the gateway cannot start with."""


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway is started with."""

    upstream: str
    default_model: Path
    workload_models: Mapping[str, Path] = field(default_factory=dict)
    # reserve multiplier(q) x predicted peak (the model file's m(q), `basin_runtime/predictor.py`); None: the
    # bare prediction (for files exported before multipliers existed)
    reservation_quantile: float | None = 0.9
    # re-estimate a session's peak at these calls with the model file's online model (empty: never)
    revise_at_calls: tuple[int, ...] = DEFAULT_REVISE_AT_CALLS
    budget_tokens: int | None = None
    calibration: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    always_engaged: bool = False
    latency_gate: bool = False
    session_header: str = "X-Session-ID"
    workload_header: str = "X-Basin-Workload"
    idle_timeout_s: float = 600.0
    tick_interval_s: float = 1.0
    upstream_timeout_s: float = 900.0
    upstream_connect_timeout_s: float = 10.0
    # Idle client connections are kept this long (uvicorn's own default, 5 s, equals the idle time of the
    # httpx / openai pools, so a client reusing one at 5 s races the close and gets a reset): above every
    # common client pool (httpx and openai 5 s, aiohttp 15 s) and load balancer (60 s), as smg's own 90 s.
    keep_alive_s: float = 90.0
    retry_after_s: float = 60.0
    admin_token: str | None = None
    insecure_admin: bool = False  # serve /basin/ without a token beyond loopback (`cli.py` refuses otherwise)
    tokenizer: str = "qwen3.6"
    task_text_pattern: str | None = None
    log_level: str = "info"
    policy: Mapping[str, Any] = field(default_factory=dict)
    shadow: bool = False
    hit_rate_window_s: float = DEFAULT_WINDOW_S
    hit_rate_min_prompt_tokens: int = DEFAULT_MIN_PROMPT_TOKENS
    engine_metrics_urls: Sequence[str] = ()
    engine_metrics_interval_s: float = 5.0
    session_log: Path | None = None
    session_log_max_bytes: int = 256 << 20
    session_log_keep_files: int = 20
    session_log_keep_text: bool = False
    live_sessions_file: Path | None = None  # default: beside the session log, `<stem>.live.json`
    adoption_window_s: float = 600.0
    drain_timeout_s: float = 30.0
    # engine priority: a session's rank bucketed into this many levels, spaced one past SGLang's
    # --priority-scheduling-preemption-threshold (`priority.py`)
    engine_priority_levels: int = DEFAULT_NUM_LEVELS
    engine_preemption_threshold: int = DEFAULT_PREEMPTION_THRESHOLD
    routing_key_header: str = ROUTING_KEY_HEADER  # smg's --routing-key-headers (sticky sessions)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_session_id_chars: int = DEFAULT_MAX_SESSION_ID_CHARS
    max_json_items: int = DEFAULT_MAX_JSON_ITEMS
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_content_parts: int = DEFAULT_MAX_CONTENT_PARTS
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a request head; also an upstream answer's head
    max_headers: int = DEFAULT_MAX_HEADERS
    # bytes of the sessions' last bodies kept to read a resent conversation's new part only (`resend.py`)
    resend_memo_bytes: int = DEFAULT_MAX_PREFIX_BYTES
    # replicas sharing one admission state (`basin_runtime/state/`): redis://HOST:PORT/DB; None: in process
    state: str | None = None
    state_lease_s: float = 5.0  # a dead replica's reservations return within this (plus two beats: 0.5 s at most)

    @property
    def limits(self) -> Limits:
        """The input limits (`limits.py`)."""
        return Limits(self.max_body_bytes, self.max_json_depth, self.max_session_id_chars, self.max_json_items,
                      self.max_messages, self.max_tools, self.max_content_parts, self.max_body_bytes_in_flight)

    def __post_init__(self) -> None:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ConfigError(f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least "
                              f"max_body_bytes ({self.max_body_bytes}): the largest body accepted could never be read")


def _str(key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: expected a whole number >= 0, got {value!r}")
    return value


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{key}: expected a number of seconds > 0, got {value!r}")
    return float(value)


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _upstream(key: str, value: object) -> str:
    url = _str(key, value).rstrip("/")
    if not re.match(r"^https?://[^/]+", url):
        raise ConfigError(f"{key}: expected an http(s):// URL, got {value!r}")
    return url


def _urls(key: str, value: object) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise ConfigError(f"{key}: expected a list of http(s):// URLs, got {value!r}")
    return [_upstream(key, item) for item in items]


def _log_level(key: str, value: object) -> str:
    if value not in LOG_LEVELS:
        raise ConfigError(f"{key}: expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return str(value)


def _policy(key: str, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a mapping of PolicyConfig fields, got {value!r}")
    allowed = {f.name for f in dataclasses.fields(PolicyConfig)} - {"budget_tokens", "always_engaged"}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ConfigError(f"{key}: unknown field(s) {unknown}; known: {sorted(allowed)}")
    return dict(value)


def _levels(key: str, value: object) -> int:
    levels = _int(key, value)
    if not 1 <= levels <= MAX_NUM_LEVELS:
        raise ConfigError(f"{key}: expected a whole number from 1 to {MAX_NUM_LEVELS}, got {value!r}")
    return levels


def _header_name(key: str, value: object) -> str:
    name = _str(key, value)
    if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name):
        raise ConfigError(f"{key}: expected an HTTP header name, got {value!r}")
    return name


def _positive_int(key: str, value: object) -> int:
    number = _int(key, value)
    if number == 0:
        raise ConfigError(f"{key}: expected a whole number > 0, got {value!r}")
    return number


def _head_bytes(key: str, value: object) -> int:
    number = _int(key, value)
    if number < MIN_HEADER_BYTES:
        raise ConfigError(f"{key}: expected a whole number of bytes >= {MIN_HEADER_BYTES} (a request line and a "
                          f"few ordinary headers), got {value!r}")
    return number


def _quantile(key: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{key}: expected a quantile in (0, 1), or null for the bare prediction, got {value!r}")
    return float(value)


def _calls(key: str, value: object) -> tuple[int, ...]:
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 2 for v in items):
        raise ConfigError(f"{key}: expected call numbers >= 2 (the first call is predicted, not revised), got "
                          f"{value!r}")
    return tuple(sorted(set(items)))


def _state_url(key: str, value: object) -> str:
    url = _str(key, value)
    if not re.match(r"^(redis|rediss|unix)://", url):
        raise ConfigError(f"{key}: expected redis://HOST:PORT/DB (or rediss://, unix://), got {value!r}")
    return url


def _lease(key: str, value: object) -> float:
    seconds = _seconds(key, value)
    if seconds < 0.5:
        raise ConfigError(f"{key}: expected a lease of at least 0.5 s, got {value!r}")
    return seconds


def _json_depth(key: str, value: object) -> int:
    depth = _int(key, value)
    if not 3 <= depth <= MAX_JSON_DEPTH_CEILING:  # a chat body is 3 deep; Python recurses per level
        raise ConfigError(f"{key}: expected a whole number from 3 to {MAX_JSON_DEPTH_CEILING}, got {value!r}")
    return depth


def _models(key: str, value: object) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v for v in items):
        raise ConfigError(f"{key}: expected PATH or WORKLOAD=PATH entries, got {value!r}")
    return list(items)


_CHECKS: dict[str, Callable[[str, object], object]] = {
    "upstream": _upstream, "model": _models, "reservation_quantile": _quantile, "revise_at_calls": _calls,
    "budget_tokens": _int,
    "calibration": _str, "host": _str,
    "port": _int, "always_engaged": _bool, "latency_gate": _bool, "session_header": _str, "workload_header": _str,
    "idle_timeout_s": _seconds, "tick_interval_s": _seconds, "upstream_timeout_s": _seconds,
    "upstream_connect_timeout_s": _seconds, "retry_after_s": _seconds,
    "keep_alive_s": _seconds, "admin_token": _str, "insecure_admin": _bool,
    "tokenizer": _str, "task_text_pattern": _str, "log_level": _log_level, "policy": _policy,
    "shadow": _bool, "hit_rate_window_s": _seconds, "hit_rate_min_prompt_tokens": _int,
    "engine_metrics_urls": _urls, "engine_metrics_interval_s": _seconds, "session_log": _str,
    "session_log_max_bytes": _positive_int, "session_log_keep_files": _int, "session_log_keep_text": _bool,
    "live_sessions_file": _str, "adoption_window_s": _seconds, "drain_timeout_s": _seconds,
    "engine_priority_levels": _levels, "engine_preemption_threshold": _int, "routing_key_header": _header_name,
    "max_body_bytes": _positive_int, "max_json_depth": _json_depth, "max_session_id_chars": _positive_int,
    "max_json_items": _positive_int, "max_messages": _positive_int, "max_tools": _positive_int,
    "max_content_parts": _positive_int, "max_body_bytes_in_flight": _positive_int, "max_header_bytes": _head_bytes,
    "max_headers": _positive_int,
    "resend_memo_bytes": _int, "state": _state_url, "state_lease_s": _lease,
}

CONFIG_KEYS = frozenset(_CHECKS)


def _default(name: str) -> object:
    """The `GatewayConfig` default of an option, for the help text."""
    return GatewayConfig.__dataclass_fields__[name].default


def build_parser() -> argparse.ArgumentParser:
    """The `basin-gateway` argument parser (options left out stay unset, so the file can supply them)."""
    parser = argparse.ArgumentParser(
        prog="basin-gateway", argument_default=argparse.SUPPRESS,
        description="Session gateway in front of an SGLang router: admits agent sessions by predicted peak context.",
    )
    add = parser.add_argument
    add("--config", type=Path, metavar="FILE", help="YAML or JSON file with any of these options (the command "
        "line wins); policy tuning goes in its `policy:` section")
    add("--upstream", metavar="URL", help="SGLang router (or server) base URL, e.g. http://127.0.0.1:8000")
    add("--host", help=f"address to bind (default {_default('host')})")
    add("--port", type=int, help=f"port to bind (default {_default('port')})")
    add("--model", action="append", metavar="[WORKLOAD=]PATH",
        help="peak predictor (.onnx); one plain PATH is the default model; repeat with WORKLOAD=PATH")
    add("--reservation-quantile", type=reservation_quantile_arg, metavar="Q",
        help=f"reserve m(Q) x the predicted peak, m from the model file, so a share Q of sessions fit their "
             f"reservation (default {_default('reservation_quantile')}; 'none' reserves the bare prediction)")
    add("--revise-at-calls", type=int, nargs="*", metavar="K",
        help="beyond the paper: re-estimate a session's peak at these calls with the online model beside the model "
             "file (default: never, as the paper's Basin; e.g. 3 5)")
    add("--budget-tokens", type=int, metavar="N", help="reference cache budget in tokens (wins over --calibration)")
    add("--calibration", metavar="FILE",
        help="JSON: knee_tokens, cache_capacity_tokens [, hit_rate_plateau, peak_completion_rate_per_s, "
             "reservation_ratio]")
    add("--always-engaged", action="store_true", help="queue every arrival, even while under the budget")
    add("--latency-gate", action="store_true",
        help="beyond the paper: the working set engages admission only while the engines' first-token latency "
             "reaches the calibration's gate (plateau latency + 3 call cycles; off by default)")
    add("--session-header", metavar="NAME",
        help=f"header holding the session id (default {_default('session_header')})")
    add("--workload-header", metavar="NAME",
        help=f"header naming the workload's model (default {_default('workload_header')})")
    add("--idle-timeout-s", type=float, metavar="S",
        help=f"end a session after this long without calls (default {_default('idle_timeout_s'):g})")
    add("--tick-interval-s", type=float, metavar="S",
        help=f"policy tick period (default {_default('tick_interval_s'):g})")
    add("--upstream-timeout-s", type=float, metavar="S",
        help=f"longest wait for upstream bytes (default {_default('upstream_timeout_s'):g})")
    add("--upstream-connect-timeout-s", type=float, metavar="S",
        help=f"longest wait to connect upstream (default {_default('upstream_connect_timeout_s'):g})")
    add("--keep-alive-s", type=float, metavar="S",
        help=f"how long an idle client connection is kept open (default {_default('keep_alive_s'):g}; keep it above "
             f"the idle time of the clients' pools and of any proxy in front)")
    add("--retry-after-s", type=float, metavar="S",
        help=f"Retry-After of a shed session's 503 (default {_default('retry_after_s'):g})")
    add("--admin-token", metavar="TOKEN", help="bearer token required on /basin/ endpoints, and the secret of "
        "the sessions' end keys (default: none; "
        "prefer the config file, the command line is visible to other local users)")
    add("--insecure-admin", action="store_true", help="bind beyond loopback without an admin token, every "
        "/basin/ endpoint open to whoever reaches the port (refused otherwise)")
    add("--tokenizer", metavar="NAME", help=f"serving tokenizer (default {_default('tokenizer')})")
    add("--task-text-pattern", metavar="REGEX", help="regex narrowing the task text in the first user message")
    add("--log-level", choices=LOG_LEVELS, help=f"(default {_default('log_level')})")
    add("--shadow", action="store_true", help="decide and report everything but hold no call (safe rollout)")
    add("--hit-rate-window-s", type=float, metavar="S",
        help=f"window of the prefix hit rate fed to the policy (default {_default('hit_rate_window_s'):g})")
    add("--engine-metrics", action="append", dest="engine_metrics_urls", metavar="URL",
        help="an engine's Prometheus /metrics URL (repeat per engine); when given, the hit rate fed to the "
             "policy comes from their counters (the upstream's usage only while they have no evidence)")
    add("--engine-metrics-interval-s", type=float, metavar="S",
        help=f"engine /metrics scrape period (default {_default('engine_metrics_interval_s'):g})")
    add("--session-log", metavar="PATH", help="append each finished session to this JSONL file (default: none)")
    add("--session-log-keep-text", type=_yes_no, metavar="yes|no",
        help="keep the raw task text (users' code and prompts) in the session log, which retraining from "
             "the log needs (default no: only lengths and token counts)")
    add("--live-sessions-file", metavar="PATH",
        help="where the live sessions are listed for the next run to adopt after a restart (default: beside "
             "the session log as <stem>.live.json; without either, no session is adopted)")
    add("--adoption-window-s", type=float, metavar="S",
        help=f"how long after start-up a listed session may resume without queueing "
             f"(default {_default('adoption_window_s'):g})")
    add("--drain-timeout-s", type=float, metavar="S",
        help=f"on SIGTERM, how long live calls may run to their end before they are cut "
             f"(default {_default('drain_timeout_s'):g})")
    add("--hit-rate-min-prompt-tokens", type=int, metavar="N",
        help=f"prompt tokens the window needs before the hit rate counts "
             f"(default {_default('hit_rate_min_prompt_tokens')})")
    add("--session-log-max-bytes", type=int, metavar="N",
        help=f"rotate the session log past this size (default {_default('session_log_max_bytes')})")
    add("--session-log-keep-files", type=int, metavar="N",
        help=f"rotated session-log files kept (default {_default('session_log_keep_files')})")
    add("--engine-priority-levels", type=int, metavar="N",
        help=f"distinct priority values sent to the engines: a session's rank among live and queued sessions, "
             f"bucketed (1..{MAX_NUM_LEVELS}, default {_default('engine_priority_levels')})")
    add("--engine-preemption-threshold", type=int, metavar="N",
        help=f"the engines' --priority-scheduling-preemption-threshold; levels are spaced one past it so a more "
             f"urgent level may preempt (default {_default('engine_preemption_threshold')})")
    add("--routing-key-header", metavar="NAME",
        help=f"header carrying the session's routing key to the router, smg's --routing-key-headers "
             f"(default {_default('routing_key_header')})")
    add("--max-body-bytes", type=int, metavar="N",
        help=f"largest request body accepted, refused with 413 while it is read (default {_default('max_body_bytes')})")
    add("--max-json-depth", type=int, metavar="N",
        help=f"deepest JSON nesting accepted in a request body, 3..{MAX_JSON_DEPTH_CEILING} "
             f"(default {_default('max_json_depth')})")
    add("--max-session-id-chars", type=int, metavar="N",
        help=f"longest session id accepted, from the header or `user` (default {_default('max_session_id_chars')})")
    add("--max-json-items", type=int, metavar="N",
        help=f"most JSON values a request body may hold, counted before it is parsed, refused with 413 "
             f"(default {_default('max_json_items')})")
    add("--max-messages", type=int, metavar="N",
        help=f"most messages in a chat call, refused with 413 (default {_default('max_messages')})")
    add("--max-tools", type=int, metavar="N",
        help=f"most tools in a chat call, refused with 413 (default {_default('max_tools')})")
    add("--max-content-parts", type=int, metavar="N",
        help=f"most content parts in all of a chat call's messages, refused with 413 "
             f"(default {_default('max_content_parts')})")
    add("--max-body-bytes-in-flight", type=int, metavar="N",
        help=f"bytes of large request bodies (1 MiB or more) read and handled at once; a body past it is refused "
             f"with 503 and Retry-After (default {_default('max_body_bytes_in_flight')})")
    add("--max-header-bytes", type=int, metavar="N",
        help=f"largest request head (request line and headers), refused with 431; also the largest answer head "
             f"taken from the upstream (default {_default('max_header_bytes')})")
    add("--max-headers", type=int, metavar="N",
        help=f"most headers in a request, refused with 431 (default {_default('max_headers')})")
    add("--resend-memo-bytes", type=int, metavar="N",
        help=f"bytes of the sessions' last request bodies kept, so that a resent conversation is read from its "
             f"new messages on (0: read every body in full; default {_default('resend_memo_bytes')})")
    add("--state", metavar="URL",
        help="share the admission state with other gateway replicas through Redis or Valkey, "
             "redis://HOST:PORT/DB (default: in this process only; README \"Replicas\")")
    add("--state-lease-s", type=float, metavar="S",
        help=f"with --state: a replica silent this long is dead, and its sessions' reservations return to the "
             f"budget (default {_default('state_lease_s'):g})")
    return parser


def _yes_no(value: str) -> bool:
    if value.lower() in ("yes", "true", "1"):
        return True
    if value.lower() in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {value!r}")


def load_config(options: Mapping[str, Any]) -> GatewayConfig:
    """Resolve parsed command-line options (and the config file they may name) into a `GatewayConfig`."""
    values: dict[str, Any] = {}
    config_path = options.get("config")
    if config_path is not None:
        values.update(_read_file(Path(config_path)))
    for key, value in options.items():
        if key != "config":
            values[key] = _checked("command line", key, value)
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
    values = {}
    for raw_key, value in raw.items():
        key = str(raw_key).replace("-", "_")
        if key not in _CHECKS:
            raise ConfigError(f"{path}: unknown option {raw_key!r}; known: {', '.join(sorted(_CHECKS))}")
        values[key] = _relative_paths(key, _checked(str(path), key, value), path.parent)
    return values


def _checked(source: str, key: str, value: object) -> object:
    try:
        return _CHECKS[key](key, value)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _relative_paths(key: str, value: Any, base: Path) -> Any:
    if key in ("calibration", "session_log", "live_sessions_file"):
        return str(base / value)
    if key == "model":
        return [_rebase_model(entry, base) for entry in value]
    return value


def _rebase_model(entry: str, base: Path) -> str:
    workload, sep, path = entry.partition("=")
    return f"{workload}={base / path}" if sep else str(base / entry)


def _resolve(values: dict[str, Any]) -> GatewayConfig:
    if "upstream" not in values:
        raise ConfigError("no upstream: give --upstream URL (the SGLang router) or `upstream:` in the config file")
    default_model, workload_models = _split_models(values.pop("model", []))
    calibration = values.pop("calibration", None)
    session_log = None if (log := values.pop("session_log", None)) is None else Path(log)
    live_file = values.pop("live_sessions_file", None)
    live_sessions_file = Path(live_file) if live_file is not None else (
        None if session_log is None else session_log.with_name(f"{session_log.stem}.live.json"))
    return GatewayConfig(default_model=default_model, workload_models=workload_models,
                         calibration=None if calibration is None else Path(calibration),
                         session_log=session_log, live_sessions_file=live_sessions_file, **values)


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

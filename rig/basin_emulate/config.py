"""The emulator's options, validated into an `EmulatorConfig`: SGLang's flag names and defaults where it has them.

Rules:
- `--role` is SGLang's `--disaggregation-mode` (prefill or decode), required here.
- `--max-total-tokens` replaces the profile's `kv_pool_tokens` (the KV pool: the prefix cache on
  prefill, decode memory on decode); `--enable-hierarchical-cache` adds the host tier of
  `--hicache-ratio` x the pool (the profile's ratio by default) to the prefix cache.
- `--time-scale X`: the model runs X times faster than the wall clock.
- `--bootstrap-timeout` (wall seconds; SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and
  WAITING_TIMEOUT play this part): how long either half waits for the other.
- HiCache storage and lending (sglang 0.5.23's flags; basin_sim/storage.py has the rules):
  `--hicache-storage-backend file` (the only backend emulated; any other is refused) stores in the
  folder SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR names (SGLang's default /tmp/hicache), shared by
  every process that names it; on prefill it needs --enable-hierarchical-cache (the storage tier sits
  under the host tier). `--hicache-storage-prefetch-policy` best_effort | wait_complete | timeout.
  `--disaggregation-decode-enable-offload-kvcache` is decode-only and needs a storage backend (SGLang
  refuses both the same way); its stride is SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE. `--page-size`
  (default 1) aligns what is stored. `--disaggregation-decode-enable-radix-cache` is decode-only.
- Session radix cache (SGLang's `--enable-session-radix-cache`, field-sources.md section 2; off by
  default): SGLang refuses it unless `--radix-eviction-policy priority`, with the same words here.
  `--radix-eviction-policy` takes SGLang's default `lru` and `priority`; any other SGLang policy is refused
  as not emulated. `--session-radix-cache-mode faithful|true` is basin's own (the simulator's
  `session_radix_cache` key): `faithful` (the default) takes no reference on prefill, as SGLang's PD
  prefill runs `cache_finished_req` before it sets a finish reason; `true` takes one at each normal finish
  (the intended semantics, hypothetical under PD). It needs the flag.
- Assumption: with `priority` the emulator's prefix cache still evicts in LRU order (request priorities
  do not reach its cache model); the policy is accepted so the flag combination SGLang requires starts.
- Any bad option or value raises `ConfigError` with one line naming it (the CLI exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from basin_runtime.tokenizer import DEFAULT_TOKENIZER, available_tokenizers
from basin_sim.catalog import CatalogError, load_profile
from basin_sim.profile import Profile, ProfileError
from basin_sim.storage import PREFETCH_POLICIES, PrefetchPolicy, offload_stride_tokens

DEFAULT_PROFILE = "h100-qwen3.6-35b-a3b"
EVICTION_POLICIES = ("lru", "priority")  # SGLang's --radix-eviction-policy values the emulator accepts
SESSION_CACHE_MODES = ("faithful", "true")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
STORAGE_BACKENDS = ("file",)  # SGLang's --hicache-storage-backend values the emulator implements
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_STORAGE_DIR = "/tmp/hicache"  # HiCacheFile's default file_path (mem_cache/hicache_storage.py)
OFFLOAD_STRIDE_ENV = "SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE"


class ConfigError(ValueError):
    """An option the emulator cannot start with."""


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything one emulated SGLang server is started with."""

    role: str
    profile: Profile  # with kv_pool_tokens (and host_cache_ratio) as overridden
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998
    time_scale: float = 1.0
    enable_metrics: bool = False
    enable_cache_report: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    enable_hierarchical_cache: bool = False
    preemption_threshold: int = 10
    page_size: int = 1
    storage_dir: str | None = None  # --hicache-storage-backend file: the shared folder; None: no storage tier
    prefetch_policy: PrefetchPolicy = "timeout"
    enable_offload_kvcache: bool = False  # decode: offload finished requests' KV to storage
    offload_stride_tokens: int = 1
    enable_decode_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    enable_session_radix_cache: bool = False
    session_radix_cache_mode: str = "faithful"  # with the flag: faithful (no prefill reference) or true
    served_model_name: str = ""  # empty: the profile's name
    tokenizer: str = DEFAULT_TOKENIZER
    bootstrap_timeout_s: float = 300.0
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        """The model name the server answers with."""
        return self.served_model_name or self.profile.name

    @property
    def max_total_tokens(self) -> int:
        """The KV pool in tokens."""
        return self.profile.kv_pool_tokens

    @property
    def host_cache_tokens(self) -> int:
        """The prefix cache's host tier (0 without --enable-hierarchical-cache)."""
        return self.profile.host_tier_tokens() if self.enable_hierarchical_cache else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (errors raise `ConfigError` instead of exiting)."""
    p = _Parser(prog="basin-emulate", description="An SGLang-compatible prefill or decode server whose work "
                                                  "is modeled by basin_sim in real time (CPU only).")
    p.add_argument("--role", required=True, choices=("prefill", "decode"),
                   help="which half of a PD deployment to emulate (SGLang's --disaggregation-mode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, dest="bootstrap_port",
                   help="prefill: where the decode half meets it (default 8998)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="a profile in basin_sim/profiles (or a .yaml path)")
    p.add_argument("--time-scale", type=float, default=1.0, help="model seconds per wall second (default 1)")
    p.add_argument("--max-total-tokens", type=int, help="KV pool size in tokens (default: the profile's)")
    p.add_argument("--enable-hierarchical-cache", action="store_true", help="prefill: a host tier below the cache")
    p.add_argument("--hicache-ratio", type=float, help="host tier size as a multiple of the pool")
    p.add_argument("--page-size", type=int, default=1, help="tokens per KV page (storage keys whole pages)")
    p.add_argument("--hicache-storage-backend",
                   help=f"the storage tier under the host tier: {', '.join(STORAGE_BACKENDS)} (a folder from "
                        f"{STORAGE_DIR_ENV}, default {DEFAULT_STORAGE_DIR})")
    p.add_argument("--hicache-storage-prefetch-policy", default="timeout",
                   help=f"when prefill stops waiting for a storage prefetch: {', '.join(PREFETCH_POLICIES)}")
    p.add_argument("--disaggregation-decode-enable-offload-kvcache", action="store_true", dest="offload_kvcache",
                   help="decode: write each finished request's KV to the storage tier")
    p.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true", dest="decode_radix_cache",
                   help="decode: keep finished KV and tell prefill how much it holds (only missing pages move)")
    p.add_argument("--radix-eviction-policy", default="lru",
                   help=f"SGLang's radix eviction policy: {', '.join(EVICTION_POLICIES)} (default lru)")
    p.add_argument("--enable-session-radix-cache", action="store_true",
                   help="per-session references on cached KV (session_id on requests, /close_session): eviction "
                        "consumes unreferenced entries before referenced ones; needs --radix-eviction-policy priority")
    p.add_argument("--session-radix-cache-mode", choices=SESSION_CACHE_MODES,
                   help="basin's own: faithful (default; SGLang's PD prefill takes no reference) or true (it takes "
                        "one at each normal finish, hypothetical)")
    p.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics on /metrics")
    p.add_argument("--enable-cache-report", action="store_true", help="report cached tokens in OpenAI usage")
    p.add_argument("--enable-priority-scheduling", action="store_true", help="order queues by request priority")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with priority scheduling: lower values first (default: higher first)")
    p.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10, dest="preemption_threshold",
                   help="accepted and reported; no emulated role preempts (a PD prefill keeps no running batch)")
    p.add_argument("--served-model-name", default="", help="the model name to answer with (default: the profile)")
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                   help=f"token counting: one of {', '.join(available_tokenizers())}")
    p.add_argument("--bootstrap-timeout", type=float, default=300.0, dest="bootstrap_timeout_s", metavar="SECONDS",
                   help="wall seconds either half waits for the other (default 300)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    return p


def _storage(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The storage and lending options, checked as SGLang checks them."""
    if args.preemption_threshold < 0:
        raise ConfigError(f"--priority-scheduling-preemption-threshold must be >= 0, got {args.preemption_threshold}")
    if args.page_size < 1:
        raise ConfigError(f"--page-size must be a whole number >= 1, got {args.page_size}")
    if args.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        raise ConfigError(f"--hicache-storage-prefetch-policy {args.hicache_storage_prefetch_policy!r} is not one of "
                          f"{', '.join(PREFETCH_POLICIES)}")
    backend = args.hicache_storage_backend
    if backend is not None and backend not in STORAGE_BACKENDS:
        raise ConfigError(f"--hicache-storage-backend {backend!r} is not emulated; the emulator implements "
                          f"{', '.join(STORAGE_BACKENDS)} (SGLang's file backend: a folder every process shares)")
    if backend is not None and args.role == "prefill" and not args.enable_hierarchical_cache:
        raise ConfigError("--hicache-storage-backend on prefill needs --enable-hierarchical-cache (the storage tier "
                          "sits under HiCache's host tier)")
    for flag, is_set in (("--disaggregation-decode-enable-offload-kvcache", args.offload_kvcache),
                         ("--disaggregation-decode-enable-radix-cache", args.decode_radix_cache)):
        if is_set and args.role != "decode":
            raise ConfigError(f"{flag} is only supported for decode side (--role decode)")
    if args.offload_kvcache and backend is None:
        raise ConfigError("--disaggregation-decode-enable-offload-kvcache is only supported when "
                          "--hicache-storage-backend is provided")
    stride_text = environ.get(OFFLOAD_STRIDE_ENV, "").strip()
    try:
        stride = int(stride_text) if stride_text else None
    except ValueError:
        raise ConfigError(f"{OFFLOAD_STRIDE_ENV} must be a whole number, got {stride_text!r}") from None
    return {"preemption_threshold": args.preemption_threshold, "page_size": args.page_size,
            "prefetch_policy": args.hicache_storage_prefetch_policy,
            "storage_dir": None if backend is None else environ.get(STORAGE_DIR_ENV) or DEFAULT_STORAGE_DIR,
            "enable_offload_kvcache": args.offload_kvcache, "enable_decode_radix_cache": args.decode_radix_cache,
            "offload_stride_tokens": offload_stride_tokens(args.page_size, stride)}


def _session_cache(args: argparse.Namespace) -> dict[str, Any]:
    """The session radix cache options, checked as SGLang checks them."""
    if args.radix_eviction_policy not in EVICTION_POLICIES:
        raise ConfigError(f"--radix-eviction-policy {args.radix_eviction_policy!r} is not emulated; the emulator "
                          f"implements {', '.join(EVICTION_POLICIES)}")
    if args.enable_session_radix_cache and args.radix_eviction_policy != "priority":
        raise ConfigError("--enable-session-radix-cache requires --radix-eviction-policy priority")
    if args.session_radix_cache_mode is not None and not args.enable_session_radix_cache:
        raise ConfigError("--session-radix-cache-mode needs --enable-session-radix-cache")
    return {"radix_eviction_policy": args.radix_eviction_policy,
            "enable_session_radix_cache": args.enable_session_radix_cache,
            "session_radix_cache_mode": args.session_radix_cache_mode or "faithful"}


def parse_config(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> EmulatorConfig:
    """The validated configuration from the command line (and SGLang's environment variables)."""
    args = build_parser().parse_args(argv)
    storage = _storage(args, os.environ if environ is None else environ)
    storage.update(_session_cache(args))
    for name, flag in (("port", "--port"), ("bootstrap_port", "--disaggregation-bootstrap-port")):
        if not 0 < getattr(args, name) < 65536:
            raise ConfigError(f"{flag} must be a port number (1-65535), got {getattr(args, name)}")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise ConfigError(f"--time-scale must be a finite number > 0, got {args.time_scale}")
    if not (math.isfinite(args.bootstrap_timeout_s) and args.bootstrap_timeout_s > 0):
        raise ConfigError(f"--bootstrap-timeout must be a finite number > 0, got {args.bootstrap_timeout_s}")
    if args.tokenizer not in available_tokenizers():
        raise ConfigError(f"--tokenizer {args.tokenizer!r} is unknown; known: {', '.join(available_tokenizers())}")
    try:
        profile = load_profile(args.profile)
    except CatalogError as exc:
        raise ConfigError(f"--profile: {exc}") from exc
    overrides: dict[str, object] = {}
    if args.max_total_tokens is not None:
        overrides["kv_pool_tokens"] = args.max_total_tokens
    if args.hicache_ratio is not None:
        overrides["host_cache_ratio"] = args.hicache_ratio
    try:
        profile = dataclasses.replace(profile, **overrides)  # type: ignore[arg-type]
    except ProfileError as exc:
        flag = "--max-total-tokens" if "kv_pool_tokens" in str(exc) else "--hicache-ratio"
        raise ConfigError(f"{flag}: {exc}") from exc
    return EmulatorConfig(
        role=args.role, profile=profile, host=args.host, port=args.port, bootstrap_port=args.bootstrap_port,
        time_scale=args.time_scale, enable_metrics=args.enable_metrics, enable_cache_report=args.enable_cache_report,
        enable_priority_scheduling=args.enable_priority_scheduling,
        schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        enable_hierarchical_cache=args.enable_hierarchical_cache, served_model_name=args.served_model_name,
        tokenizer=args.tokenizer, bootstrap_timeout_s=args.bootstrap_timeout_s, log_level=args.log_level, **storage)

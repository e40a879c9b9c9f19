"""The flags of the storage-offload lending recipe, for SGLang (or basin-emulate), smg and the gateway.

The lending recipe's flags in one place: what SGLang prefill and decode, smg and the gateway run with
so that stock SGLang lends decode KV through the HiCache storage tier (deploy/sglang-pd-lending.md
gives each flag's reason). The loopback stack, `make demo --lending storage-offload`, the GPU check
(deploy/gpu_lending_check.py) and the tests use these, so the recipe that is tested is the one that
is written down.

Rules:
- Engine flags are SGLang's own names; basin-emulate accepts every one of them.
- The storage folder reaches the engines through SGLang's environment variable
  (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR), never a flag.
- `with_offload=False` keeps everything but decode's offload flag: the "lending off" arm of a
  comparison differs from the "on" arm by that one flag.
"""

from __future__ import annotations

from pathlib import Path

PAGE_SIZE = 64  # whole pages are stored: 64 tokens of KV per file of the file backend
# priority: smaller values first, levels spaced one past the preemption threshold (gateway priority.py)
PRIORITY_ARGS = ("--enable-priority-scheduling", "--schedule-low-priority-values-first",
                 "--priority-scheduling-preemption-threshold", "10")
PREFILL_ARGS = ("--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-storage-backend", "file",
                "--hicache-storage-prefetch-policy", "timeout", "--page-size", str(PAGE_SIZE))
DECODE_ARGS = ("--hicache-storage-backend", "file", "--page-size", str(PAGE_SIZE))
DECODE_OFFLOAD_ARG = "--disaggregation-decode-enable-offload-kvcache"
SMG_ARGS = ("--sticky-sessions", "--routing-key-headers", "x-smg-routing-key", "--retry-max-retries", "1",
            "--health-check-interval-secs", "5")
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"


def prefill_args() -> list[str]:
    """Flags a prefill engine adds for lending (beyond its model, ports, PD mode and PRIORITY_ARGS)."""
    return list(PREFILL_ARGS)


def decode_args(with_offload: bool = True) -> list[str]:
    """Flags a decode engine adds for lending (beyond PRIORITY_ARGS); without the offload flag it lends nothing."""
    return [*DECODE_ARGS, *([DECODE_OFFLOAD_ARG] if with_offload else [])]


def storage_env(folder: Path) -> dict[str, str]:
    """The engines' environment entry naming the shared storage folder."""
    return {STORAGE_DIR_ENV: str(folder)}

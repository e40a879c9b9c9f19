"""deploy/gpu_lending_check.py's --dry-run: every command printed with the recipe's flags, arguments checked."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from basin_stack import lending

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "gpu_lending_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_the_dry_run_prints_prefill_two_decodes_smg_and_the_gateway_with_the_recipes_flags(tmp_path: Path) -> None:
    done = _run("--model-path", "Qwen/Qwen2.5-0.5B-Instruct", "--storage-dir", str(tmp_path), "--dry-run")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 5
    prefill, decode0, decode1, router, gateway = (shlex.split(line) for line in lines)
    for engine in (prefill, decode0, decode1):
        assert engine[0] == f"{lending.STORAGE_DIR_ENV}={tmp_path}" and "sglang.launch_server" in engine
        assert all(flag in engine for flag in lending.PRIORITY_ARGS)
    assert all(flag in prefill for flag in lending.prefill_args()) and lending.DECODE_OFFLOAD_ARG not in prefill
    for decode in (decode0, decode1):
        assert lending.DECODE_OFFLOAD_ARG in decode and decode[decode.index("--disaggregation-mode") + 1] == "decode"
    assert "smg.launch_router" in router and all(flag in router for flag in lending.SMG_ARGS)
    assert router.count("--decode") == 2 and "basin_runtime.gateway" in gateway
    assert gateway[gateway.index("--engine-priority-levels") + 1] == "4"


def test_bad_arguments_are_refused_naming_the_option() -> None:
    done = _run("--model-path", "m", "--gpus", "0", "0", "1", "--mem-fraction-static", "0.6", "--priority-levels",
                "0", "--dry-run")
    assert done.returncode == 2 and done.stdout == ""
    assert "--mem-fraction-static <= 0.3" in done.stderr and "--priority-levels must be 1..64" in done.stderr

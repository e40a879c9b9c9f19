"""Check the lending recipe on a real GPU: SGLang prefill + two decodes + smg + basin-gateway, on loopback.

Given an SGLang install and a small dense model (decode offload refuses hybrid linear-attention models in
sglang 0.5.23: "Unsupported KV cache type for decode offload"), it starts every process with the recipe's
flags (rig/basin_stack/lending.py, deploy/sglang-pd-lending.md), replays a few sessions with the official
`openai` client through the gateway and asserts what tests/e2e/test_lending_e2e.py asserts of the
emulators: after a prefill /flush_cache a session's next call reports storage hits covering its last
answer (`cache_source="storage"` on prefill's /metrics), every session stays on one decode instance, and
the engines saw at most --priority-levels priority values. Exit 0 when all hold, 1 when one fails, 2 on a
bad argument.

    python deploy/gpu_lending_check.py --model-path Qwen/Qwen2.5-0.5B-Instruct --dry-run   # print, check args
    python deploy/gpu_lending_check.py --model-path Qwen/Qwen2.5-0.5B-Instruct --gpus 0 1 2

Needs one GPU per engine (--gpus: prefill, decode, decode; a GPU may repeat with --mem-fraction-static
small enough) and `--disaggregation-transfer-backend` available (mooncake by default, as SGLang's).
`--dry-run` prints every command it would run and validates its own arguments, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from basin_stack import lending  # noqa: E402  (the recipe's flags, shared with the emulated stack)

TRANSFER_BACKENDS = ("mooncake", "nixl", "mori")


@dataclass(frozen=True)
class Launch:
    """One process to start: name, command, extra environment, readiness URL."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ready_url: str


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model-path", required=True, help="a small dense model (path or hub name SGLang can load)")
    p.add_argument("--gpus", nargs=3, type=int, default=[0, 1, 2], metavar=("PREFILL", "DECODE0", "DECODE1"),
                   help="CUDA device of each engine (default 0 1 2)")
    p.add_argument("--base-port", type=int, default=31000, help="first of the loopback ports used (default 31000)")
    p.add_argument("--storage-dir", type=Path, help="the shared storage folder (default: a fresh temporary one)")
    p.add_argument("--transfer-backend", default="mooncake", choices=TRANSFER_BACKENDS)
    p.add_argument("--mem-fraction-static", type=float, default=0.6)
    p.add_argument("--gateway-model", type=Path, default=ROOT / "models" / "peak_predictor.onnx")
    p.add_argument("--priority-levels", type=int, default=4)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--dry-run", action="store_true", help="print every command and check the arguments only")
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, each naming the option (empty: fine)."""
    problems = []
    if not 1024 <= args.base_port <= 65535 - 16:
        problems.append(f"--base-port must leave 16 ports below 65536 and be >= 1024, got {args.base_port}")
    if any(g < 0 for g in args.gpus):
        problems.append(f"--gpus must be CUDA device numbers >= 0, got {args.gpus}")
    if not 0 < args.mem_fraction_static < 1:
        problems.append(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if len(set(args.gpus)) < 3 and args.mem_fraction_static > 0.3:
        problems.append(f"--gpus {args.gpus} shares a GPU between engines: give --mem-fraction-static <= 0.3")
    if not 1 <= args.priority_levels <= 64:
        problems.append(f"--priority-levels must be 1..64, got {args.priority_levels}")
    if args.sessions < 1:
        problems.append(f"--sessions must be >= 1, got {args.sessions}")
    if not args.gateway_model.is_file():
        problems.append(f"--gateway-model {args.gateway_model} is not a file")
    return problems


def plan(args: argparse.Namespace, storage: Path) -> list[Launch]:
    """Every process, in start order: prefill, two decodes, smg, the gateway."""
    port = iter(range(args.base_port, args.base_port + 16))
    engine_env = lending.storage_env(storage)
    launches: list[Launch] = []
    common = ["--model-path", args.model_path, "--host", "127.0.0.1", "--enable-metrics", "--enable-cache-report",
              "--mem-fraction-static", str(args.mem_fraction_static),
              "--disaggregation-transfer-backend", args.transfer_backend, *lending.PRIORITY_ARGS]
    prefill_port, bootstrap_port = next(port), next(port)
    launches.append(Launch("prefill", [sys.executable, "-m", "sglang.launch_server", *common, "--port",
                                       str(prefill_port), "--disaggregation-mode", "prefill",
                                       "--disaggregation-bootstrap-port", str(bootstrap_port), *lending.prefill_args()],
                           {**engine_env, "CUDA_VISIBLE_DEVICES": str(args.gpus[0])},
                           f"http://127.0.0.1:{prefill_port}/health"))
    router_port = next(port)
    router = [sys.executable, "-m", "smg.launch_router", "--pd-disaggregation", "--prefill",
              f"http://127.0.0.1:{prefill_port}", str(bootstrap_port)]
    for k in range(2):
        decode_port = next(port)
        launches.append(Launch(f"decode{k}", [sys.executable, "-m", "sglang.launch_server", *common, "--port",
                                              str(decode_port), "--disaggregation-mode", "decode",
                                              *lending.decode_args()],
                               {**engine_env, "CUDA_VISIBLE_DEVICES": str(args.gpus[1 + k])},
                               f"http://127.0.0.1:{decode_port}/health"))
        router += ["--decode", f"http://127.0.0.1:{decode_port}"]
    router += ["--host", "127.0.0.1", "--port", str(router_port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(next(port)), *lending.SMG_ARGS]
    launches.append(Launch("router", router, {}, f"http://127.0.0.1:{router_port}/readiness"))
    gateway_port = next(port)
    launches.append(Launch("gateway", [sys.executable, "-m", "basin_runtime.gateway", "--upstream",
                                       f"http://127.0.0.1:{router_port}", "--port", str(gateway_port),
                                       "--model", str(args.gateway_model), "--budget-tokens", "1000000000",
                                       "--engine-priority-levels", str(args.priority_levels)],
                           {}, f"http://127.0.0.1:{gateway_port}/health"))
    return launches


def _wait_ready(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in time")


async def replay(gateway: str, prefill: str, model: str, sessions: int) -> list[str]:
    """Replay `sessions` two-call sessions, flushing prefill between the calls; the failed checks."""
    import httpx
    import openai

    failures: list[str] = []
    api = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="check", max_retries=0, timeout=300)

    def storage_tokens() -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{prefill}/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "sglang:cached_tokens_total" and s.labels.get("cache_source") == "storage")

    async def call(session: str, messages: list[dict[str, Any]]) -> tuple[str, str, int]:
        raw = await api.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=256, extra_headers={"X-Session-ID": session})  # type: ignore[arg-type]
        reply = raw.parse()
        details = reply.usage.prompt_tokens_details if reply.usage is not None else None
        return reply.choices[0].message.content or "", raw.headers.get("x-smg-routed-worker-id", ""), \
            (details.cached_tokens or 0) if details is not None else 0

    for k in range(sessions):
        session = f"gpu-check-{k}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Session {k}: explain page tables. " * 60}]
        answer, first, _ = await call(session, messages)
        if httpx.post(f"{prefill}/flush_cache", timeout=30).status_code != 200:
            failures.append(f"{session}: prefill refused /flush_cache")
        before = storage_tokens()
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now summarise."}]
        _, second, cached = await call(session, messages)
        if second != first:
            failures.append(f"{session}: served by {first}, then {second} (not sticky)")
        if storage_tokens() - before <= 0 or cached <= 0:
            failures.append(f"{session}: no storage hit after the flush (cached {cached})")
    await api.close()
    return failures


def priority_labels(urls: list[str]) -> set[str]:
    """The `priority` label values on every engine's request counters."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values = set()
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
            values |= {s.labels["priority"] for s in family.samples if s.labels.get("priority")}
    return values


def main(argv: list[str] | None = None) -> int:
    """Run the check (or print it with --dry-run); 0 pass, 1 fail, 2 bad arguments."""
    args = build_parser().parse_args(argv)
    problems = check_args(args)
    if problems:
        for problem in problems:
            print(f"gpu_lending_check: error: {problem}", file=sys.stderr)
        return 2
    storage = args.storage_dir or Path(tempfile.mkdtemp(prefix="hicache-"))
    launches = plan(args, storage)
    for launch in launches:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
        print(f"{env + ' ' if env else ''}{shlex.join(launch.argv)}")
    if args.dry_run:
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + args.startup_timeout_s
        for launch in launches:
            procs.append(subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, cwd=ROOT,
                                          start_new_session=True))
            _wait_ready(launch.ready_url, procs[-1], deadline)
        prefill = launches[0].ready_url.removesuffix("/health")
        gateway = launches[-1].ready_url.removesuffix("/health")
        failures = asyncio.run(replay(gateway, prefill, args.model_path, args.sessions))
        labels = priority_labels([launch.ready_url.removesuffix("/health") for launch in launches[:3]])
        if len(labels) > args.priority_levels:
            failures.append(f"engines saw {len(labels)} priority values {sorted(labels)} > {args.priority_levels}")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
            proc.wait(timeout=60)
    for failure in failures:
        print(f"FAIL {failure}")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

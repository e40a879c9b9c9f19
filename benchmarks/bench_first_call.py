"""Where a new session's first call spends its added time: the gateway's steps, timed inside it.

`bench_gateway.py`'s one-at-a-time phase (each call a new session's first call, through the real smg in PD
mode in front of two stand-in workers, directly and through the gateway in turns) with timing probes in
the gateway process: wall time from the call's arrival to reading its body, parsing it, measuring the
conversation (`Meter.first_call`: task text, exact token counts), the ONNX prediction, the policy's
arrival, forwarding, the upstream's answer head, and the first body bytes passed on. The probes wrap the
gateway's own functions (this file starts the gateway with them in place: `--serve-probed`); they cost
a few microseconds each, so the sum runs a little above the unprobed gateway's added time, printed
beside it (the difference of the two paths' medians).

    .venv/bin/python benchmarks/bench_first_call.py [--calls 300]

Loopback only; the processes started are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# (what happens from this probe to the next one, the probe), in the order a first call passes them
STEPS = [("read the body", "t0"), ("parse it, identify the session", "read_in"), ("(to the measure)", "read_out"),
         ("measure: task text, exact token counts", "measure_in"), ("ONNX prediction", "measure_out"),
         ("policy arrival (admission)", "arrive_in"), ("stamp the body", "arrive_out"),
         ("send the request", "forward_in"), ("upstream answer head (smg, workers)", "send_in"),
         ("pass the head on", "head_in"), ("first body bytes passed on", "head_out"), ("", "first")]


def serve_probed(argv: list[str], out: Path) -> None:
    """Run the gateway (its own command line, `argv`) with timing probes; timings land in `out`."""
    from basin_runtime.gateway import app as app_module
    from basin_runtime.gateway import gateway as gateway_module
    from basin_runtime.gateway import http1, measure, proxy, waiting
    from basin_runtime.gateway.cli import main

    current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("probe", default=None)
    rows: list[dict[str, float]] = []

    def timed(cls: Any, name: str, start: str, end: str) -> None:
        original = getattr(cls, name)
        if asyncio.iscoroutinefunction(original):
            async def probe(*args: Any, **kwargs: Any) -> Any:
                row = current.get()
                if row is not None:
                    row.setdefault(start, time.perf_counter())
                try:
                    return await original(*args, **kwargs)
                finally:
                    if row is not None:
                        row.setdefault(end, time.perf_counter())
            setattr(cls, name, probe)
            return

        def sync_probe(*args: Any, **kwargs: Any) -> Any:
            row = current.get()
            if row is not None:
                row.setdefault(start, time.perf_counter())
            try:
                return original(*args, **kwargs)
            finally:
                if row is not None:
                    row.setdefault(end, time.perf_counter())
        setattr(cls, name, sync_probe)

    serve = app_module._InferencePath.__call__

    async def inference_path(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if not str(scope.get("path", "")).startswith("/v1/"):
            await serve(self, scope, receive, send)
            return
        row = {"t0": time.perf_counter()}
        current.set(row)

        async def probed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                row.setdefault("head_out", time.perf_counter())
            elif message.get("body"):
                row.setdefault("first", time.perf_counter())
            await send(message)

        try:
            await serve(self, scope, receive, probed_send)
        finally:
            rows.append(row)
            if len(rows) % 25 == 0:
                out.write_text(json.dumps(rows))

    setattr(app_module._InferencePath, "__call__", inference_path)  # noqa: B010
    timed(gateway_module.Gateway, "_read", "read_in", "read_out")
    timed(measure.Meter, "first_call", "measure_in", "measure_out")
    timed(waiting.WaitingRoom, "arrive", "arrive_in", "arrive_out")
    timed(proxy.Upstream, "forward", "forward_in", "forward_out")
    timed(http1.Http1UpstreamClient, "send", "send_in", "head_in")
    sys.exit(main(argv))


def medians(rows: list[dict[str, float]]) -> Iterator[tuple[str, float]]:
    """The median milliseconds of each step (the time from its probe to the next one's)."""
    for (label, start), (_, end) in itertools.pairwise(STEPS):
        spans = [row[end] - row[start] for row in rows if start in row and end in row]
        if spans:
            yield label, statistics.median(spans) * 1000


async def bench(args: argparse.Namespace) -> None:
    import bench_gateway as bg

    with tempfile.TemporaryDirectory() as log_dir:
        out = Path(log_dir) / "probes.json"
        start = bg.process

        def probed(command: list[str]) -> Any:
            if "basin_runtime.gateway" in command:  # the same gateway command, with the probes in place
                at = command.index("-m")
                command = [*command[:at], __file__, "--serve-probed", str(out), *command[at + 2:]]
            return start(command)

        setattr(bg, "process", probed)  # noqa: B010
        options = argparse.Namespace(via_smg=True, state="memory", gateway="basin")
        async with bg.servers(log_dir, options, "probe-token") as deployment:
            await bg.run_sessions(deployment.gateway, 10**6, 50, 2, 50, True, [], True)  # warm-up
            direct: list[float] = []
            via: list[float] = []
            for k in range(args.calls):
                await bg.run_sessions(deployment.direct, 2 * 10**6 + k, 1, 1, 1, False, direct, True)
                await bg.run_sessions(deployment.gateway, 2 * 10**6 + k, 1, 1, 1, True, via, True)
            await asyncio.sleep(0.2)
            rows: list[dict[str, float]] = json.loads(out.read_text())[-args.calls:]
    print(f"machine: {os.cpu_count()} cpus; {args.calls} calls one at a time, each a new session's first call, "
          f"streamed, through smg (PD) and stand-in workers; load average {bg.load_average()}")
    print(f"added time to the first chunk (via minus direct, medians): "
          f"{(statistics.median(via) - statistics.median(direct)) * 1000:.2f} ms")
    print("the gateway's steps, median ms from the step's start to the next one's:")
    total = 0.0
    for label, ms in medians(rows):
        total += ms
        print(f"  {label:<40} {ms:7.3f}")
    print(f"  {'sum (arrival to the first bytes out)':<40} {total:7.3f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-probed"]:
        serve_probed(argv[2:], Path(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    asyncio.run(bench(parser.parse_args(argv)))
    return 0

if __name__ == "__main__":
    sys.exit(main())

"""Start and stop a loopback PD stack: basin-emulate engines, smg, and the Basin gateway.

A local PD deployment on loopback: emulated SGLang engines (basin-emulate), the real SGLang router
(smg, PD mode) and optionally the Basin gateway, each a subprocess in its own process group.

Rules:
- Every port is a free loopback port; every process logs to `<logs>/<name>.log`; nothing binds
  beyond 127.0.0.1 (smg's Prometheus listener included).
- Start-up order: engines (ready on /health), the router (ready on /readiness: every worker
  registered and healthy), then the gateway (ready on /health). A process that exits or is not ready
  within `startup_timeout_s` stops the start with `StackError` naming it, its URL and its log's tail.
- The gateway runs on the wall clock while the engines run `time_scale` times faster, so every time
  constant of the gateway (tick, windows, timeouts, the priority's tokens per second, shedding's waits
  and rates) is scaled by the time scale in the config file the stack writes (`gateway_config`).
- `stop()` kills every process group (SIGKILL: smg takes seconds to stop on SIGTERM) and waits for
  it; it runs on context exit, at interpreter exit and on SIGTERM, so no process outlives the stack.
- `kill(name)` / `restart(name)` stop and start one process on the same ports (fault tests). smg
  drops a dead worker and re-admits a restarted one only on its health checks (default every 60 s)
  and its circuit breaker (60 s): pass `router_args` to shorten them.
- A gateway with `engine_session_cache` closes sessions on every engine (`engine_urls`: prefill and
  decode, unless the spec's gateway options name them).
- Emulator lag: `lag()` reads each engine's /server_info `basin_emulate.lag` (wall seconds).
- Role-specific engine flags (`prefill_args`, `decode_args`: the lending recipe, rig/basin_stack/lending.py)
  follow the common ones; `engine_env` adds environment variables to the engines only (SGLang's
  storage folder).
- The gateway's admin token, when its config sets one, is the operator's (`admin_headers`); agents
  end their own sessions with the end keys the gateway hands them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


class StackError(RuntimeError):
    """A process of the stack could not start or died; the message names it and quotes its log."""


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: never given twice
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


# "LOW-HIGH": pick ports in [LOW, HIGH) only (the test suite gives each of its workers its own range)
PORT_RANGE_ENV = "BASIN_PORT_RANGE"


def port_range() -> tuple[int, int] | None:
    """[low, high) to pick ports from: $BASIN_PORT_RANGE, else 10000 up to the kernel's ephemeral range; None
    when there is no room below that range."""
    given = os.environ.get(PORT_RANGE_ENV)
    if given:
        try:
            low, high = (int(part) for part in given.split("-"))
        except ValueError:
            raise StackError(f"${PORT_RANGE_ENV} must be LOW-HIGH (two port numbers), got {given!r}") from None
        if not 1024 <= low < high <= 65536:
            raise StackError(f"${PORT_RANGE_ENV} must satisfy 1024 <= LOW < HIGH <= 65536, got {given!r}")
        return low, high
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (10_000, ephemeral_low) if ephemeral_low > 11_000 else None


def free_port() -> int:
    """A loopback port nobody listens on now, below the kernel's ephemeral range when it can be.

    Every port of the stack is picked before its server starts, while the servers started before it open
    connections; a port from the ephemeral range could meanwhile become one of those connections' local
    port, and its server then fails to bind (a demo run hit `address already in use`). A port below the
    range is never given to an outgoing connection. Processes picking at the same time (the test suite's
    workers) are kept apart by giving each its own $BASIN_PORT_RANGE."""
    low, high = port_range() or (0, 0)
    rng = random.Random()
    for _ in range(200 if high else 0):
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # no room below the range: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


@dataclass
class Proc:
    """One subprocess of the stack."""

    name: str
    argv: list[str]
    log: Path
    ready_url: str
    popen: subprocess.Popen[bytes] | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # added to the inherited environment

    def start(self) -> None:
        """Start it in its own process group, output to its log (appended)."""
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                          start_new_session=True, env={**os.environ, **self.env})

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        text = self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL its process group and reap it."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)


@dataclass(frozen=True)
class StackSpec:
    """What to run."""

    logs: Path
    num_prefill: int = 1
    num_decode: int = 3
    time_scale: float = 1.0
    max_total_tokens: int | None = None  # every engine's KV pool (prefill: the prefix cache)
    profile: str | None = None
    gateway: Mapping[str, Any] | None = None  # gateway config keys (unscaled, model seconds); None: no gateway
    emulator_args: Sequence[str] = ()
    prefill_args: Sequence[str] = ()  # after emulator_args, prefill engines only
    decode_args: Sequence[str] = ()  # after emulator_args, decode engines only
    engine_env: Mapping[str, str] = field(default_factory=dict)  # the engines' extra environment
    router_args: Sequence[str] = ()  # e.g. smg's --health-check-interval-secs 1 --cb-timeout-duration-secs 2
    startup_timeout_s: float = 60.0


_GATEWAY_SECONDS = ("idle_timeout_s", "tick_interval_s", "retry_after_s", "hit_rate_window_s",
                    "engine_metrics_interval_s")
_POLICY_SECONDS = ("shed_wait_s", "arrival_window_s", "budget_move_interval_s")
_POLICY_RATES = ("tokens_per_s", "peak_completion_rate_per_s")


def gateway_config(options: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """The gateway's config with every time constant (given, or the default) in wall seconds for engines
    running `time_scale` x faster than the wall clock."""
    from basin_runtime.gateway.config import GatewayConfig
    from basin_runtime.policy import PolicyConfig

    gateway_defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    policy_defaults = {f.name: f.default for f in dataclasses.fields(PolicyConfig)}
    scaled = dict(options)
    for key in _GATEWAY_SECONDS:
        scaled[key] = scaled.get(key, gateway_defaults[key]) / time_scale
    policy = dict(scaled.get("policy", {}))
    for key in _POLICY_SECONDS:
        policy[key] = policy.get(key, policy_defaults[key]) / time_scale
    for key in _POLICY_RATES:
        value = policy.get(key, policy_defaults[key])
        if value is not None:
            policy[key] = value * time_scale
    scaled["policy"] = policy
    return scaled


@dataclass
class LocalStack:
    """The running stack; use as a context manager."""

    spec: StackSpec
    procs: dict[str, Proc] = field(default_factory=dict)
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    router_url: str = ""
    gateway_url: str | None = None

    def __enter__(self) -> LocalStack:
        self.spec.logs.mkdir(parents=True, exist_ok=True)
        _register(self)
        try:
            self._plan()
            self._start([p for p in self.procs.values() if p.name.startswith(("prefill", "decode"))])
            self._start([self.procs["router"]])
            if "gateway" in self.procs:
                self._start([self.procs["gateway"]])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        """Where clients go: the gateway if there is one, else the router."""
        return self.gateway_url or self.router_url

    @property
    def admin_headers(self) -> dict[str, str]:
        """The operator's credential for the gateway's /basin/ endpoints (none unless its config sets admin_token)."""
        token = (self.spec.gateway or {}).get("admin_token")
        return {} if token is None else {"Authorization": f"Bearer {token}"}

    @property
    def engine_urls(self) -> list[str]:
        """Every engine's base URL, prefill first."""
        return [*self.prefill_urls, *self.decode_urls]

    def stop(self) -> None:
        """Kill every process (gateway first, engines last)."""
        for proc in reversed(list(self.procs.values())):
            proc.kill()
        _unregister(self)

    def kill(self, name: str) -> None:
        """Kill one process (e.g. "decode1")."""
        self.procs[name].kill()

    def restart(self, name: str) -> None:
        """Start a killed process again on its ports and wait until it is ready."""
        self._start([self.procs[name]])

    def lag(self) -> dict[str, dict[str, Any]]:
        """Each live engine's scheduler lag (wall seconds) from /server_info."""
        lags: dict[str, dict[str, Any]] = {}
        for name, proc in self.procs.items():
            if name.startswith(("prefill", "decode")) and proc.alive:
                info = httpx.get(proc.ready_url.replace("/health", "/server_info"), timeout=5).json()
                lags[name] = info["basin_emulate"]["lag"]
        return lags

    def _plan(self) -> None:
        spec, python, logs = self.spec, sys.executable, self.spec.logs
        common = ["--time-scale", f"{spec.time_scale:g}", "--enable-metrics", "--enable-cache-report",
                  "--enable-priority-scheduling", "--schedule-low-priority-values-first", "--log-level", "warning",
                  *spec.emulator_args]
        if spec.max_total_tokens is not None:
            common += ["--max-total-tokens", str(spec.max_total_tokens)]
        if spec.profile is not None:
            common += ["--profile", spec.profile]
        router = [python, "-m", "smg.launch_router", "--pd-disaggregation"]
        for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
            for k in range(count):
                port, name = free_port(), f"{role}{k}"
                url = f"http://127.0.0.1:{port}"
                argv = [python, "-m", "basin_emulate", "--role", role, "--port", str(port), *common,
                        *(spec.prefill_args if role == "prefill" else spec.decode_args)]
                if role == "prefill":
                    bootstrap = free_port()
                    argv += ["--disaggregation-bootstrap-port", str(bootstrap)]
                    router += ["--prefill", url, str(bootstrap)]
                    self.prefill_urls.append(url)
                else:
                    router += ["--decode", url]
                    self.decode_urls.append(url)
                self.procs[name] = Proc(name, argv, logs / f"{name}.log", f"{url}/health", env=spec.engine_env)
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        router += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                   "--prometheus-port", str(free_port()), "--log-level", "warn", *spec.router_args]
        self.procs["router"] = Proc("router", router, logs / "router.log", f"{self.router_url}/readiness")
        if spec.gateway is not None:
            port = free_port()
            self.gateway_url = f"http://127.0.0.1:{port}"
            options = {**spec.gateway, "upstream": self.router_url, "host": "127.0.0.1", "port": port}
            options.setdefault("engine_metrics_urls", [f"{url}/metrics" for url in self.prefill_urls])
            if options.get("engine_session_cache"):  # sessions are closed on every engine, prefill and decode
                options.setdefault("engine_urls", self.engine_urls)
            config = logs / "gateway.yaml"
            config.write_text(yaml.safe_dump(gateway_config(options, spec.time_scale)), encoding="utf-8")
            config.chmod(0o600)  # it may hold the admin token
            self.procs["gateway"] = Proc("gateway", [python, "-m", "basin_runtime.gateway", "--config", str(config)],
                                         logs / "gateway.log", f"{self.gateway_url}/health")

    def _start(self, procs: Sequence[Proc]) -> None:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + self.spec.startup_timeout_s
        for proc in procs:
            _wait_ready(proc, deadline, self.spec.startup_timeout_s)


def _wait_ready(proc: Proc, deadline: float, timeout_s: float) -> None:
    while time.monotonic() < deadline:
        if not proc.alive:
            code = None if proc.popen is None else proc.popen.returncode
            raise StackError(f"{proc.name} exited with {code} before it was ready ({proc.log}):\n{proc.tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(proc.ready_url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise StackError(f"{proc.name} was not ready at {proc.ready_url} within {timeout_s:g} s ({proc.log}):\n"
                     f"{proc.tail()}")


_LIVE: list[LocalStack] = []


def _stop_all() -> None:
    for stack in list(_LIVE):
        stack.stop()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _stop_all()
    raise SystemExit(128 + signum)


def _register(stack: LocalStack) -> None:
    if not _LIVE:
        atexit.register(_stop_all)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)
    _LIVE.append(stack)


def _unregister(stack: LocalStack) -> None:
    if stack in _LIVE:
        _LIVE.remove(stack)

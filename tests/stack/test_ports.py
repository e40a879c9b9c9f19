"""The stack's port picker: ports outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from basin_stack.stack import PORT_RANGE_ENV, StackError, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_distinct_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low > 11_000:  # room below the range (Linux's default starts at 32768)
        assert all(10_000 <= port < low for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing was left listening


def test_a_port_range_in_the_environment_keeps_the_picks_inside_it_and_a_bad_one_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20100")  # how tests/conftest.py keeps two workers apart
    ports = [free_port() for _ in range(20)]
    assert all(20_000 <= port < 20_100 for port in ports) and len(set(ports)) == 20
    for bad in ("20000", "a-b", "20100-20000", "80-90"):
        monkeypatch.setenv(PORT_RANGE_ENV, bad)
        with pytest.raises(StackError, match=r"\$BASIN_PORT_RANGE must"):
            free_port()

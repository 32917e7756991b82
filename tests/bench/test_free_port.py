"""free_port hands out ports a client can never be given as its own source port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mpprefill.bench.procs import free_port

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="needs Linux's ephemeral port range")
def test_free_ports_are_bindable_and_outside_the_ephemeral_range():
    low, high = (int(v) for v in EPHEMERAL.read_text().split())
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 1  # chosen at random, not one fixed port
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

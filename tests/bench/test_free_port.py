"""free_port hands out ports a client can never be given as its own source port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mpprefill.bench.procs import free_base_port, free_port

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


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="needs Linux's ephemeral port range")
def test_a_free_base_port_has_every_offset_free_outside_the_ephemeral_range():
    low, high = (int(v) for v in EPHEMERAL.read_text().split())
    offsets = (-21002, 1, 100, 200)
    for _ in range(5):
        base = free_base_port(offsets)
        for port in (base, *(base + o for o in offsets)):
            assert not low <= port <= high
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_offsets_wider_than_the_free_range_are_refused():
    with pytest.raises(RuntimeError, match="do not fit"):
        free_base_port((-70000, 70000))

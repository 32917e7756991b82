from __future__ import annotations

import multiprocessing as mp
import uuid

import pytest

import ipc


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


@pytest.fixture
def endpoint():
    return ipc.ipc_endpoint(f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def prefix():
    p = ipc.new_prefix("mpptest")
    yield p
    leftover = ipc.list_segments(p)
    ipc.remove_prefix(p)
    assert not leftover, f"segments left behind: {leftover}"


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)

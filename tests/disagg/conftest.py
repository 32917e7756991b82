"""Fixtures of the disagg tests: a prefill pool, a decode receiver, its router, rooms."""

from __future__ import annotations

import itertools
import os

import pytest

import ipc
from tests.disagg.helpers import DecodeProc, Router, filled_pool

_rooms = itertools.count(1000)


@pytest.fixture(scope="module")
def pool():
    """(prefill KVCache, prompts): the real model's KV over PROMPT_LENS."""
    return filled_pool()


@pytest.fixture(scope="module")
def decode():
    """One verifying shm decode receiver per test module; it must leave no segment."""
    d = DecodeProc("--verify").wait_ready()
    yield d
    left = d.close()
    assert not left, f"decode left segments behind: {left}\n{d.output()}"


@pytest.fixture
def router(decode):
    with Router(decode.address) as r:
        yield r


@pytest.fixture
def room():
    """Fresh bootstrap room numbers: room() -> int."""
    return lambda: next(_rooms)


@pytest.fixture
def no_prefill_segments():
    """The prefill side (this process) opens the decode's segment but never creates one."""
    mine = f".{os.getpid()}."
    yield
    assert not [s for s in ipc.list_segments("") if mine in s]

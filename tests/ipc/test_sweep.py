"""Sweeping stale segments from a /dev/shm shared with other users and other PID
namespaces: only this user's from this namespace, and a name that cannot be removed does
not stop the sweep."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import ipc
from ipc.runtime import pid_namespace
from ipc.shm import SHM_DIR

NOBODY = 65534
NS = pid_namespace()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(name: str) -> str:
    """A segment file as its creator left it; its path."""
    path = SHM_DIR + name
    with open(path, "wb") as f:
        f.write(bytes(8))
    return path


def test_names_carry_the_creators_pid_and_namespace(prefix):
    with ipc.SharedTensor.create((8,), torch.uint8, prefix) as st:
        assert st.handle.name.startswith(f"/{prefix}.{os.getpid()}.{NS}.")


def test_sweep_removes_this_users_stale_segments(prefix, dead_pid):
    names = [f"/{prefix}.{dead_pid}.{NS}.0", f"/{prefix}.{dead_pid}.1"]  # the latter: older
    paths = [_plant(n) for n in names]
    assert sorted(ipc.sweep_stale(prefix.split("_")[0])) == sorted(names)
    assert not any(os.path.exists(p) for p in paths)


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user owns needs root")
def test_sweep_leaves_other_users_segments(prefix, dead_pid):
    path = _plant(f"/{prefix}.{dead_pid}.{NS}.0")
    os.chown(path, NOBODY, NOBODY)
    try:
        assert ipc.sweep_stale(prefix.split("_")[0]) == []
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_sweep_leaves_segments_of_another_pid_namespace(prefix, dead_pid):
    path = _plant(f"/{prefix}.{dead_pid}.{NS + 1}.0")  # that pid may run there
    try:
        assert ipc.sweep_stale(prefix.split("_")[0]) == []
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_sweep_goes_on_past_a_name_it_cannot_remove(prefix, dead_pid):
    blocked = SHM_DIR + f"/{prefix}.{dead_pid}.{NS}.0"
    os.mkdir(blocked)  # shm_unlink fails on it (EISDIR)
    try:
        stale = _plant(f"/{prefix}.{dead_pid}.{NS}.1")
        assert ipc.sweep_stale(prefix.split("_")[0]) == [f"/{prefix}.{dead_pid}.{NS}.1"]
        assert not os.path.exists(stale)
    finally:
        shutil.rmtree(blocked)

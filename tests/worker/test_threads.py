"""Torch threads on each side of the process boundary: the forward processes take theirs,
the scheduler process the cores they leave."""

from __future__ import annotations

import os

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.worker import build
from mpprefill.worker.build import forward_threads, scheduler_threads


@pytest.mark.parametrize(
    ("cpus", "kw", "forward", "scheduler"),
    [
        (2, dict(worker_threads=1), 1, 1),
        (2, dict(), 2, 1),  # the forward takes every core; the scheduler keeps one
        (16, dict(worker_threads=4), 4, 12),
        (16, dict(tp_size=4, forward_mode="proc"), 4, 1),  # CPU ranks share the cores
        (16, dict(tp_size=2, worker_threads=3, forward_mode="proc"), 3, 10),
        # the emulated device runs a TP group's host path in one process
        (16, dict(device="emulated", tp_size=4, worker_threads=2), 2, 14),
    ],
)
def test_the_scheduler_gets_the_cores_the_forward_processes_leave(
    monkeypatch, cpus, kw, forward, scheduler
):
    monkeypatch.setattr(build.os, "cpu_count", lambda: cpus)
    cfg = ServerArgs(**kw).worker_config()
    assert forward_threads(cfg) == forward
    assert scheduler_threads(cfg) == scheduler


@pytest.mark.timeout(120)
def test_a_process_worker_leaves_its_scheduler_one_thread_where_the_forward_takes_the_rest():
    from mpprefill.modes import MODES
    from mpprefill.worker.factory import make_worker

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # whatever the process had: the worker sets it
    args = ServerArgs(forward_mode="proc", worker_threads=max(1, (os.cpu_count() or 1) - 1))
    worker, _ = make_worker(args, MODES["proc"])
    try:
        assert torch.get_num_threads() == 1
    finally:
        worker.close()
        torch.set_num_threads(before)

"""The scheduler's side of each forward process of a group (one per tensor-parallel rank).

Every rank gets the same Submit and reads the same staging slot; each has its own event
table, its own two mailboxes and its own KV shard. The scheduler's barriers hold per rank:
a slot is rewritten once every rank finished reading it, results are read once every rank
finished the forward, KV once every rank wrote it. Rank 0 writes the results.

| event            | recorded by            | waited on (GroupOrder)      |
|------------------|------------------------|-----------------------------|
| staged[slot]     | the scheduler, per rank | each rank, its own          |
| reads_done[slot] | each rank              | every rank's, before a write |
| forward_done     | each rank              | every rank's (KV fence)     |
| result_ready     | each rank              | every rank's, before collect |
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import threading

import torch
import torch.distributed as dist

import ipc
from mpprefill.layer_configs import WorkerConfig
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import NUM_EVENTS, SchedulerOrder, make_events
from mpprefill.worker.forward_process import WorkerSetup, worker_main
from mpprefill.worker.hooks import DeviceHooks


class RankLink:
    """One forward process: its process, request and reply channels, event table and the
    scheduler's order over those events."""

    def __init__(
        self,
        cfg: WorkerConfig,
        plan: DevicePlan,
        prefix: str,
        slots: list[dict[str, ipc.TensorHandle]],
        hooks: DeviceHooks,
        rank: int,
        store: tuple[str, int] | None,
        undo: contextlib.ExitStack,
    ):
        self.rank = rank
        self.events_st = ipc.SharedTensor.create((NUM_EVENTS,), torch.int64, prefix)
        undo.callback(self.events_st.unlink)
        events, cuda_events = make_events(plan, "scheduler", self.events_st.tensor)
        # Requests (Submit, Sample, Exit) one way, replies the other: each side serves
        # its receiving mailbox on a thread of its own (see mailboxes.py).
        tag = f"fw-{prefix}" if rank == 0 else f"fw{rank}-{prefix}"
        self.requests = ipc.Channel(ipc.ipc_endpoint(f"{tag}-req"), bind=True)
        undo.callback(drop_channel, self.requests)
        self.replies = ipc.Channel(ipc.ipc_endpoint(f"{tag}-rep"), bind=True)
        undo.callback(drop_channel, self.replies)
        setup = WorkerSetup.of(
            cfg,
            plan,
            prefix,
            self.events_st.handle,
            cuda_events or None,
            slots,
            cfg.max_running_requests,
            hooks,
            tp_rank=rank,
            tp_store=store,
        )
        name = "mpprefill-forward" if store is None else f"mpprefill-forward-tp{rank}"
        self.proc = mp.get_context("spawn").Process(
            target=worker_main,
            name=name,
            daemon=True,
            args=(setup, (self.requests.endpoint, self.replies.endpoint), os.getpid()),
        )
        self.proc.start()
        undo.callback(stop_process, self.proc)
        self.requests.set_peer(self.proc.pid)
        self.replies.set_peer(self.proc.pid)
        self.order = SchedulerOrder(events, alive=self.proc.is_alive)

    def ended(self) -> bool:
        """Whether the process has ended (its sentinel fires before it can be reaped)."""
        return not self.proc.is_alive() or _fired([self.proc.sentinel], 0)

    @property
    def label(self) -> str:
        return "forward process" if self.rank == 0 else f"forward process (tp rank {self.rank})"


class GroupOrder:
    """`SchedulerOrder` over every rank: waits wait on all of them, records go to all."""

    def __init__(self, orders: list[SchedulerOrder]):
        self.orders = orders

    def before_write(self, slot: int) -> None:
        for o in self.orders:
            o.before_write(slot)

    def after_write(self, slot: int, seq: int) -> None:
        for o in self.orders:
            o.after_write(slot, seq)

    def before_result(self, gen: int, timeout: float | None = None) -> None:
        for o in self.orders:
            o.before_result(gen, timeout)

    def kv_written(self, seq: int) -> None:
        for o in self.orders:
            o.kv_written(seq)

    def kv_written_query(self, seq: int) -> bool:
        return all(o.kv_written_query(seq) for o in self.orders)


class GroupSentinel:
    """A file descriptor that turns readable once any rank's process has ended, for the
    front's poll (a process's own sentinel covers only itself)."""

    def __init__(self, procs: list[mp.process.BaseProcess]):
        self.fd, self._write = os.pipe()
        sentinels = [p.sentinel for p in procs]
        self._thread = threading.Thread(
            target=self._watch, args=(sentinels,), name="tp-sentinel", daemon=True
        )
        self._thread.start()

    def _watch(self, sentinels: list[int]) -> None:
        _fired(sentinels, None)
        with contextlib.suppress(OSError):  # the read end may be closed already
            os.write(self._write, b"x")
        os.close(self._write)  # NOTE: only this thread closes it, so no reused fd is hit

    def close(self) -> None:
        """Close the read end; the watcher closes its end once the processes ended."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


def start_store() -> dist.TCPStore:
    """The rendezvous of a group's ranks, served from this process (any free port)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def stop_process(proc: mp.process.BaseProcess, wait_s: float = 5) -> None:
    if proc.is_alive():
        proc.kill()
        proc.join(wait_s)


def drop_channel(ch: ipc.Channel) -> None:
    ch.close()
    ipc.remove_ipc_endpoint(ch.endpoint)


def _fired(sentinels: list[int], timeout: float | None) -> bool:
    """Whether any process sentinel (a file descriptor on POSIX) is readable, i.e. ended."""
    readable, _, _ = select.select(sentinels, [], [], timeout)
    return bool(readable)

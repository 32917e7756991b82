"""Child-process entry points for the ipc tests (spawned, so they live in a module)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import torch

import ipc


@ipc.message
class Note(ipc.Message, tag=True):
    seq: int
    text: str = ""
    handle: ipc.TensorHandle | None = None


def pattern(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def echo(endpoint: str, parent: int) -> None:
    """Take a handle, check its bytes, answer with a tensor of our own."""
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    note = ch.get(timeout=10)
    t = ipc.open_handle(note.handle)
    same = torch.equal(t, pattern(note.handle.shape, note.seq))
    again = ipc.open_handle(note.handle)
    reused = again is t  # the cached view of the one mapping
    own = ipc.SharedTensor.create(note.handle.shape, torch.float32, note.text)
    own.tensor.copy_(pattern(note.handle.shape, note.seq + 1))
    ch.put(Note(note.seq, f"{same}:{reused}", own.handle), timeout=10)
    ch.get(timeout=10)  # parent is done reading
    own.unlink()
    ch.close()


def hold(endpoint: str, parent: int, prefix: str, install_handlers: bool) -> None:
    """Create segments under `prefix`, report, then wait to be stopped or released."""
    if install_handlers:
        ipc.install_signal_cleanup()
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    segs = [ipc.SharedTensor.create((256,), torch.int64, prefix) for _ in range(3)]
    ch.put(Note(len(segs)), timeout=10)
    ch.get(timeout=30)
    ch.close()


def sleeper(endpoint: str, parent: int) -> None:
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    ch.put(Note(0), timeout=10)
    time.sleep(60)


def slow_taker(endpoint: str, parent: int, delay: float) -> None:
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    for _ in range(2):
        time.sleep(delay)
        note = ch.get(timeout=10)
        if note.seq < 0:
            break
    ch.close()


def event_setter(handle: ipc.TensorHandle, gen: int, delay: float) -> None:
    event = ipc.ShmEvent(ipc.open_handle(handle)[0:1])
    time.sleep(delay)
    event.record(gen)


def self_kill(endpoint: str, parent: int) -> None:
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    ch.get(timeout=10)
    os.kill(os.getpid(), signal.SIGKILL)


def signal_while_unlinking(prefix: str) -> None:
    """A signal lands while this process unlinks one of its segments (in the middle of its
    bookkeeping); the cleanup handler runs right there, then a handler that returns, and the
    process carries on. Exit 0 once both handlers ran."""
    seen = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    ipc.install_signal_cleanup((signal.SIGUSR1,))
    ipc.SharedTensor.create((8,), torch.uint8, prefix)
    doomed = ipc.SharedTensor.create((8,), torch.uint8, prefix)

    def profile(frame, event, arg):
        if event == "c_call" and frame.f_code.co_name == "unlink_segment" and not seen:
            os.kill(os.getpid(), signal.SIGUSR1)

    sys.setprofile(profile)
    doomed.unlink()
    sys.setprofile(None)
    sys.exit(0 if seen else 3)


def parent_of_watcher(endpoint: str) -> None:
    """Start a child that dies with this process, then wait to be killed."""
    child = mp.get_context("spawn").Process(target=watcher, args=(endpoint, os.getpid()))
    child.start()
    time.sleep(60)


def watcher(endpoint: str, parent: int) -> None:
    """Ask to die with `parent`, report this pid, then sleep without ever polling it."""
    if not ipc.die_with_parent(parent):
        return
    ch = ipc.Channel(endpoint, bind=False)
    ch.put(Note(os.getpid()), timeout=10)
    time.sleep(60)

"""Child-process entry points for the GPU tests (spawned, so they live in a module)."""

from __future__ import annotations

import torch

import ipc
from ipc.cuda import CudaGenEvent, CudaIpcEvent
from ipc.events import ShmEvent

SLEEP_CYCLES = 400_000_000  # a few hundred ms of device time


@ipc.message
class GpuNote(ipc.Message, tag=True):
    seq: int
    text: str = ""
    handles: dict[str, ipc.TensorHandle] = {}
    event: str = ""


def pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def open_and_reply(endpoint: str, parent: int) -> None:
    """Open each handle; report whether its contents match the parent's pattern; then
    write seed + 100 into the field named "back" (on the device) for the parent."""
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    note = ch.get(timeout=60)
    back = ipc.open_handle(note.handles["back"])
    back.copy_(pattern(back.numel(), note.seq + 100).to(back.device))
    ok = []
    for i, name in enumerate(sorted(k for k in note.handles if k != "back")):
        t = ipc.open_handle(note.handles[name])
        ok.append(torch.equal(t.cpu(), pattern(t.numel(), note.seq + i)))
        ok.append(ipc.open_handle(note.handles[name]).data_ptr() == t.data_ptr())  # cached
    torch.cuda.synchronize()
    ch.put(GpuNote(note.seq, ",".join(map(str, ok))), timeout=60)
    ch.get(timeout=60)  # the parent is done reading
    ch.close()


def record_late(endpoint: str, parent: int, counter: ipc.TensorHandle) -> None:
    """Fill a shared device tensor after a long device-side sleep and record generation
    1 behind it, on a stream of this process; reply as soon as it is issued."""
    ch = ipc.Channel(endpoint, bind=False, peer_pid=parent)
    note = ch.get(timeout=60)
    event = CudaGenEvent(
        ShmEvent(ipc.open_handle(counter), "late"),
        CudaIpcEvent.from_handle(torch.cuda.current_device(), note.event),
    )
    out = ipc.open_handle(note.handles["out"])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        out.fill_(7.0)
        event.record(1)
    ch.put(GpuNote(1, "issued"), timeout=60)
    ch.get(timeout=60)
    stream.synchronize()
    ch.close()

"""Which event is waited on before what, written once for every device and staging.

| event            | recorder  | recorded after              | waiter     | waited before      |
|------------------|-----------|-----------------------------|------------|--------------------|
| staged[slot]     | scheduler | its writes into the slot    | worker     | reading the slot   |
| reads_done[slot] | worker    | the forward's last read     | scheduler  | rewriting it (WAR) |
| forward_done     | worker    | the forward's last KV write | KV readers | reading its pages  |
| result_ready     | worker    | its result slot writes      | scheduler  | reading results    |
| layers_done      | worker    | each layer's KV writes      | transfer   | a layer-wise send  |

Generations: staged, reads_done and forward_done carry the batch's seq; result_ready
carries 2 * seq for a forward and 2 * seq + 1 for its deferred sample; layers_done carries
seq * L + layers (`layers.py`). The event classes behind these names depend on the device
(see `device.py`); the order does not. layers_done is read by the transfer thread, on the
host, as soon as each layer completes: on a GPU the worker publishes it from a thread that
waits for each record (`PolledEvent`) rather than at its next reply, and every reader holds
the bare counter.

Two result slots alternate like the staging slots: forward N writes result slot N % 2,
so the worker may run N + 1 while the scheduler has not yet read N's results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ipc.cuda import CudaGenEvent, CudaIpcEvent, HostFencedEvent, PolledEvent
from ipc.events import GenEvent, ShmEvent
from mpprefill.streams import HostStream
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.layers import LayerPublisher

NUM_SLOTS = 2
EVENT_NAMES = (
    "staged0",
    "staged1",
    "reads_done0",
    "reads_done1",
    "forward_done",
    "result_ready",
    "layers_done",
)
RECORDERS = ("scheduler", "scheduler", "worker", "worker", "worker", "worker", "worker")
NUM_EVENTS = len(EVENT_NAMES)
WAIT_S = 60.0  # no barrier legitimately takes longer than a forward; a hang must fail


def forward_gen(seq: int) -> int:
    return 2 * seq


def sample_gen(seq: int) -> int:
    return 2 * seq + 1


@dataclass(slots=True)
class EventSet:
    staged: list[GenEvent]
    reads_done: list[GenEvent]
    forward_done: GenEvent
    result_ready: GenEvent
    layers_done: GenEvent

    def all(self) -> list[GenEvent]:
        ordered = [self.forward_done, self.result_ready, self.layers_done]
        return [*self.staged, *self.reads_done, *ordered]

    def flush(self) -> None:
        for event in self.all():
            event.flush()


def make_events(
    plan: DevicePlan,
    side: str,
    table: torch.Tensor,
    cuda_handles: dict[str, str] | None = None,
) -> tuple[EventSet, dict[str, str]]:
    """The events over the shared int64 `table`, as `side` holds them, and the CUDA IPC
    handles (by name) of the events this call created: the scheduler creates them, the
    worker opens them from `cuda_handles`."""
    events: list[GenEvent] = []
    created: dict[str, str] = {}
    for i, (name, recorder) in enumerate(zip(EVENT_NAMES, RECORDERS, strict=True)):
        counter = ShmEvent(table[i : i + 1], name)
        kind = plan.event_kind(side, recorder)
        if name == "layers_done":
            events.append(PolledEvent(counter) if side == "worker" and kind != "shm" else counter)
        elif kind == "cuda" and cuda_handles is None:
            cuda = CudaIpcEvent.create()
            created[name] = cuda.handle()
            events.append(CudaGenEvent(counter, cuda))
        elif kind == "cuda":
            cuda = CudaIpcEvent.from_handle(torch.cuda.current_device(), cuda_handles[name])
            events.append(CudaGenEvent(counter, cuda))
        elif kind == "fenced":
            events.append(HostFencedEvent(counter))
        else:
            events.append(counter)
    s = NUM_SLOTS
    rest = events[2 * s :]
    return EventSet(events[:s], events[s : 2 * s], *rest), created


class SchedulerOrder:
    """The scheduler's side. NOTE: the worker may reply before its device work is
    complete, so results and KV pages are read only after their events."""

    def __init__(self, events: EventSet, alive: Callable[[], bool], timeout: float = WAIT_S):
        self.events = events
        self.alive = alive
        self.timeout = timeout
        self.slot_seq = [0] * NUM_SLOTS  # the last forward staged in each slot

    def before_write(self, slot: int) -> None:
        """WAR barrier: the forward that last read `slot` is done reading it. Issued on
        the stream that writes the slot (the host on CPU and with pinned staging)."""
        self.events.reads_done[slot].wait(self.slot_seq[slot], self.timeout, self.alive)

    def after_write(self, slot: int, seq: int) -> None:
        self.events.staged[slot].record(seq)
        self.slot_seq[slot] = seq

    def before_result(self, gen: int, timeout: float | None = None) -> None:
        self.events.result_ready.synchronize(gen, timeout, self.alive)

    def kv_written(self, seq: int) -> None:
        """Block until forward `seq` and every earlier one finished writing KV."""
        self.events.forward_done.synchronize(seq, self.timeout, self.alive)

    def kv_written_query(self, seq: int) -> bool:
        return self.events.forward_done.query(seq)


class WorkerOrder:
    """The forward process's side; records land on its forward stream (`record`), so they
    mark the completion of the device work issued before them."""

    def __init__(
        self,
        events: EventSet,
        alive: Callable[[], bool],
        record: Callable[[GenEvent, int], None],
        timeout: float = WAIT_S,
    ):
        self.events = events
        self.alive = alive
        self.record = record
        self.timeout = timeout

    def before_read(self, slot: int, seq: int) -> None:
        self.events.staged[slot].wait(seq, self.timeout, self.alive)

    def reads_done(self, slot: int, seq: int) -> None:
        self.record(self.events.reads_done[slot], seq)

    def forward_done(self, seq: int) -> None:
        self.record(self.events.forward_done, seq)

    def layers(self, stream: HostStream, num_layers: int) -> LayerPublisher:
        """The publisher of each layer's completion, on the worker's stream."""
        return LayerPublisher(self.events.layers_done, stream, num_layers)

    def result_ready(self, gen: int) -> None:
        self.record(self.events.result_ready, gen)

    def flush(self) -> None:
        """Publish what a host-only peer waits on; called before every reply."""
        self.events.flush()

"""Per-layer completion: how far each forward has written its KV, layer by layer.

The forward publishes one counter per rank, a generation that only grows:

    gen(seq, layers) = seq * L + layers        L: the model's layers, 0 <= layers <= L

so "forward seq wrote the KV of its layers [0, layers)" is one int64, written whole and
read whole (no torn pair of fields), and gen(seq, L) == gen(seq + 1, 0): a forward that
finished every layer and the next one that has not begun one read the same. Forwards run
one at a time, in order, so one counter per rank covers every forward slot.

The writer is the forward's `on_layer` hook (`LayerPublisher`): after layer i's work is
issued it records gen(seq, i + 1) on the worker's stream, so the count is published once
that work is complete: at once on the CPU, when the clock passes the layer's end on the
emulated device, when a CUDA event recorded after the layer completes on a GPU
(`ipc.cuda.PolledEvent`'s thread). The reader is the transfer thread (`LayerProgress`),
which asks without blocking and never goes through the scheduler. Only a worker built with
`WorkerConfig.publish_layers` (layer-wise send on) publishes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ipc.events import GenEvent, ShmEvent
from mpprefill.streams import HostStream


def layer_gen(seq: int, layers: int, num_layers: int) -> int:
    """The counter's value once forward `seq` wrote the KV of its first `layers` layers."""
    return seq * num_layers + layers


class LayerPublisher:
    """The forward's side: `hook(seq)` is the `on_layer` of forward `seq`."""

    def __init__(self, event: GenEvent, stream: HostStream, num_layers: int):
        self.event = event
        self.stream = stream
        self.num_layers = num_layers

    def hook(self, seq: int) -> Callable[[int], None]:
        num_layers = self.num_layers

        def on_layer(i: int) -> None:
            self.stream.record(self.event, layer_gen(seq, i + 1, num_layers))

        return on_layer


class LayerProgress:
    """The reader's side, over every rank's counter: a layer is done once every rank
    wrote it (each rank holds some of the KV heads)."""

    def __init__(self, counters: list[ShmEvent], num_layers: int):
        if num_layers < 1:
            raise ValueError(f"a model of {num_layers} layers")
        self.counters = counters
        self.num_layers = num_layers

    def layers_done(self, seq: int) -> int:
        """How many of forward `seq`'s layers have their KV written on every rank."""
        base = seq * self.num_layers
        low = min(c.value() for c in self.counters)
        return max(0, min(self.num_layers, low - base))

    def overtaken(self, seq: int, layer: int) -> bool:
        """A later forward may have begun writing `layer` (every layer of `seq` is done and
        the next forward finished the layers before it on some rank)."""
        later = layer_gen(seq + 1, layer, self.num_layers)
        return max(c.value() for c in self.counters) >= later


def local_layers(stream: HostStream, num_layers: int) -> tuple[LayerPublisher, LayerProgress]:
    """Both sides over one counter in this process (the in-process workers)."""
    counter = ShmEvent(torch.zeros(1, dtype=torch.int64), "layers_done")
    return LayerPublisher(counter, stream, num_layers), LayerProgress([counter], num_layers)

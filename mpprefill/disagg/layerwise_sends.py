"""The layer-wise sends in progress: which layer of which send may be written now.

A layer-wise send names the forward that writes its pages (`TransferCmd.layer_seq`); it is
queued when that forward is submitted, before it runs. Layer i of its pages may be read
once the forward's per-layer counter says layer i is written on every rank
(`LayerProgress.layers_done`, from the worker). The thread asks without blocking, between
its polls, so frames and other commands are served while a forward runs; sends are taken
in forward order, and within a forward layer by layer, every send's layer i before any
send's layer i + 1.

    forward N     | layer 0 | layer 1 | layer 2 | ... | layer L-1 |
    transfer            | w0 |      | w1 |      | w2 | ...        | wL-1 | layers_written

The thread owns this part and acts on what it answers (`due`); it never calls back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpprefill.disagg.transfer_sender import TransferCmd, TransferSender


@dataclass(slots=True, eq=False)
class LayerSend:
    cmd: TransferCmd
    layers: int = 0  # layers of its pages written so far
    dropped: bool = False  # not sent on: skip what `due` listed for it

    @property
    def seq(self) -> int:
        return self.cmd.layer_seq


class LayerwiseSends:
    """Layer-wise sends by forward, oldest first. `progress`: the worker's LayerProgress
    (`layers_done(seq)`, `overtaken(seq, layer)`, `num_layers`)."""

    def __init__(self, progress) -> None:
        self.progress = progress
        self.num_layers = progress.num_layers
        self._sends: list[LayerSend] = []

    def add(self, cmd: TransferCmd) -> None:
        self._sends.append(LayerSend(cmd))

    @property
    def waiting(self) -> bool:
        """Sends wait for layers still being computed: poll the counter often."""
        return bool(self._sends)

    def finishing(self) -> bool:
        """Some send's forward is computing its last layer: it ends any moment."""
        seqs = {x.seq for x in self._sends}
        return any(self.progress.layers_done(seq) >= self.num_layers - 1 for seq in seqs)

    def holds(self, s: TransferSender) -> bool:
        """Some of `s`'s pages are still being sent layer by layer: its later commands (its
        last send, which announces every page) wait."""
        return any(x.cmd.sender is s for x in self._sends)

    def due(self) -> list[tuple[LayerSend, int]]:
        """(send, layer) pairs whose layer is written and not yet sent, in order: by
        forward, then by layer, then by send."""
        out = []
        done_of: dict[int, int] = {}
        for x in self._sends:
            if x.seq not in done_of:
                done_of[x.seq] = self.progress.layers_done(x.seq)
        for seq in sorted(done_of):
            sends = [x for x in self._sends if x.seq == seq]
            start = min(x.layers for x in sends)
            for layer in range(start, done_of[seq]):
                out.extend((x, layer) for x in sends if x.layers <= layer)
        return out

    def prune(self, live) -> None:
        """Drop the sends whose sender `live(sender)` says is gone: a forward that never
        finishes its layers (its worker died) must not hold the commands behind them."""
        for x in [x for x in self._sends if not live(x.cmd.sender)]:
            self.drop(x)

    def wrote(self, x: LayerSend, layer: int) -> bool:
        """Layer `layer` of `x` is written; True when that was its last (it leaves)."""
        x.layers = layer + 1
        if x.layers < self.num_layers:
            return False
        self._sends.remove(x)
        return True

    def drop(self, x: LayerSend) -> None:
        """`x` is not sent on (its sender failed, or a write failed)."""
        x.dropped = True
        if x in self._sends:
            self._sends.remove(x)

    def overtaken(self, x: LayerSend, layer: int) -> bool:
        """A later forward may have begun writing `layer`: pages handed to it since `x` was
        queued would no longer hold `x`'s KV."""
        return self.progress.overtaken(x.seq, layer)

    def take_all(self) -> list[TransferCmd]:
        """Every send left (the thread is stopping)."""
        cmds = [x.cmd for x in self._sends]
        self._sends.clear()
        return cmds

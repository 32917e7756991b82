"""Which pages each send writes where: the shipped pools' planes (plane_map.py), checked
against the decode pool a bootstrap reply names.

A send's full pages go to every shipped pool's full planes (none when every layer
slides; one per layer in a latent pool, K's and V's otherwise), its last window's SWA pages
to their SWA planes; each (source pages, destination
pages, pool planes) is one write, done by the backend's pool writer (`_write` of
ShmTransfer or MooncakeTransfer).
"""

from __future__ import annotations

import torch

from mpprefill.disagg import wire
from mpprefill.disagg.plane_map import PoolPlanes, pool_planes
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.transfer_sender import SenderLimits, TransferCmd, TransferSender, check_range

Write = tuple[torch.Tensor, torch.Tensor, PoolPlanes]  # source pages, destination pages, pool


class PageWrites:
    """The shipped pools as planes, and the model's whole pool layout they fill."""

    def __init__(self, shipped: ShippedKV, page_size: int, layerwise: bool = False) -> None:
        """`layerwise`: sends may go layer by layer (bootstraps say so)."""
        num_slots = shipped.shards[0].kv.num_slots
        if page_size < 1 or num_slots < page_size:
            raise ValueError(f"bad page size {page_size} for a pool of {num_slots} slots")
        self.page_size = page_size
        self.shipped = shipped
        self.layout = shipped.layout(page_size)
        # (full pool, SWA pool or None) of each shipped pool, in head order
        self.planes = [pool_planes(s.kv, page_size, s.heads) for s in shipped.shards]
        self.layerwise = layerwise
        # layer j's planes of each shipped pool (layer-wise sends: full pools only)
        self._layers = [
            [full.layer(j) for full, _ in self.planes] for j in range(self.planes[0][0].num_layers)
        ]

    @property
    def can_go_by_layer(self) -> bool:
        """Every layer lives in the full pool: a pool with sliding-window layers sends its
        last window with the last send, whole (its pages are known only then)."""
        return self.planes[0][1] is None

    def limits(self, bootstrap_timeout: float, transfer_timeout: float) -> SenderLimits:
        """What every sender checks its pages and deadlines against."""
        swa = self.planes[0][1]
        swa_pages = None if swa is None else swa.num_pages
        return SenderLimits(self.layout.num_pages, swa_pages, bootstrap_timeout, transfer_timeout)

    def bootstrap(self, room: int) -> wire.Bootstrap:
        """The room's bootstrap: the shipped pools' head ranges, dtype and KV layout."""
        shipped = self.shipped
        layout = self.layout
        return wire.Bootstrap(
            room,
            shipped.tp_size,
            shipped.kv_heads,
            layout.dtype,
            layout.kv_layout,
            layout.head_dim,
            self.layerwise,
        )

    def moves_pages(self, cmd: TransferCmd) -> bool:
        """The send has full pages or window pages (a last send may carry neither)."""
        return len(cmd.src) > 0 or _has_window(cmd)

    def writes(self, cmd: TransferCmd) -> list[Write]:
        """The writes of a send, pool by pool: its full pages, then its window's pages."""
        window = _has_window(cmd)
        out = []
        for full, swa in self.planes:
            if len(full.view):  # none when every layer slides
                out.append((cmd.src, cmd.dst, full))
            if window:
                out.append((cmd.swa_src, cmd.swa_dst, swa))
        return out

    def layer_writes(self, cmd: TransferCmd, layer: int) -> list[Write]:
        """The writes of layer `layer` of a layer-wise send, pool by pool."""
        return [(cmd.src, cmd.dst, planes) for planes in self._layers[layer]]

    def layers_written(self, s: TransferSender, cmd: TransferCmd) -> wire.LayersWritten:
        """The announcement of a send's pages once every layer of them is written."""
        layers = self.layout.num_layers
        return wire.LayersWritten(s.room, cmd.first_page, len(cmd.src), layers, s.instance)

    def check_reply(self, msg: wire.BootstrapReply, remote: wire.PoolLayout) -> torch.Tensor:
        """The room's destination pages in the decode pool `remote` the reply named;
        ValueError when that pool does not match this one or the pages do not fit it."""
        why = self.layout.mismatch(remote)
        if why:
            raise ValueError(why)
        dst = torch.tensor(msg.dst_pages, dtype=torch.int64)
        check_range(dst, remote.num_pages, "destination")
        prefix = msg.decode_prefix_len
        if prefix % self.page_size or prefix > len(dst) * self.page_size:
            raise ValueError(f"bad decode_prefix_len {prefix}")
        return dst

    def transfer_done(self, s: TransferSender, cmd: TransferCmd) -> wire.TransferDone:
        """What follows a room's last send: the first token, the pages written, the run."""
        logprob, top = (None, None) if cmd.first_logprob is None else cmd.first_logprob
        first = int(cmd.first_token)
        return wire.TransferDone(s.room, first, s.pages_sent, s.instance, logprob, top)


def _has_window(cmd: TransferCmd) -> bool:
    return cmd.swa_src is not None and len(cmd.swa_src) > 0

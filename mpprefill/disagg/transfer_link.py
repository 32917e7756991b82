"""What the transfer thread puts on the network: each page write's bytes, and each room's
completion (the TransferDone that tells the decode its KV is in).

Without an emulated link a completion is posted at once. With one (`--emulate-link-gbps`,
emulated_link.py) a write's bytes are handed to the link as the write starts (the copy
stands for the NIC's DMA, so the link's time runs beside it, not after it), and a
completion is a message on the same serialized link: it is delivered after the last byte
of every write handed before it. Until then it is held here, never posted, so the decode
cannot see the room done early. The thread does not wait for it: `release`, on the
thread's tick, posts what is due, and `poll_ms` shortens the thread's poll to the next
completion due (rounded up to the poll's millisecond, so a completion is late by at most
that and the thread's wake-up, never early).

On the emulated device the pool's pages are the host stand-in's, narrower than the model
the device emulates: a write then counts the emulated model's bytes for its tokens and
layers (LinkConfig.kv_bytes_per_token), as the real transfer would carry them.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import torch

from ipc.handle import dtype_from_name
from mpprefill.disagg import wire
from mpprefill.disagg.emulated_link import EmulatedLink
from mpprefill.disagg.live_rooms import LiveRooms
from mpprefill.disagg.plane_map import PoolPlanes
from mpprefill.disagg.transfer_sender import TransferSender
from mpprefill.layer_configs import LinkConfig


def pool_bytes_per_token(layout: wire.PoolLayout) -> int:
    """Bytes of one token's KV in one layer of the pool `layout` describes (every head)."""
    itemsize = torch.empty((), dtype=dtype_from_name(layout.dtype)).element_size()
    per_head = layout.head_dim * itemsize
    return per_head if layout.latent else 2 * layout.num_kv_heads * per_head


class TransferLink:
    """The transfer thread's way out to the decodes, through `config`'s emulated link when
    there is one. Thread only."""

    def __init__(
        self,
        rooms: LiveRooms,
        config: LinkConfig | None,
        layout: wire.PoolLayout,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`layout`: the whole pool the shipped pools fill (PageWrites.layout); `clock`:
        the thread's time (a test's own)."""
        self.rooms = rooms
        self.link = None if config is None else EmulatedLink(config.gbps, config.latency_us)
        wire_bytes = None if config is None else config.kv_bytes_per_token
        self.scale = 1.0 if wire_bytes is None else wire_bytes / pool_bytes_per_token(layout)
        self._clock = clock
        # NOTE: a link delivers in the order it was handed messages, so this is in due order
        self._held: deque[tuple[float, TransferSender, wire.Message]] = deque()

    def write_bytes(self, num_pages: int, planes: PoolPlanes) -> int:
        """The bytes on the wire of `num_pages` pages of every plane of `planes`."""
        view = planes.view  # [planes, pages, page_numel]
        pool_bytes = num_pages * view.shape[0] * view.shape[2] * view.element_size()
        return round(pool_bytes * self.scale)

    def handed(self, src: torch.Tensor, planes: PoolPlanes) -> float | None:
        """A write of pages `src` of `planes` starts now: its bytes go on the link. The time
        they are delivered (None without a link)."""
        if self.link is None:
            return None
        return self.link.carry(self.write_bytes(len(src), planes), self._clock())

    def done(self, s: TransferSender, msg: wire.Message) -> None:
        """Post room `s.room`'s completion `msg`: at once without a link, else once the link
        delivers it."""
        if self.link is None:
            self.rooms.post(s.room, msg)
            return
        due = self.link.carry(len(wire.encode(msg)), self._clock())
        self._held.append((due, s, msg))

    def release(self, now: float) -> None:
        """Post the completions due by `now`; one whose sender failed or was dropped while
        held is not posted (the decode had its abort instead)."""
        while self._held and self._held[0][0] <= now:
            _, s, msg = self._held.popleft()
            if self.rooms.holds(s):
                self.rooms.post(s.room, msg)

    def poll_ms(self, idle_ms: int, now: float) -> int:
        """How long the thread may poll: `idle_ms`, or less when a completion is due sooner."""
        if not self._held:
            return idle_ms
        return max(0, min(idle_ms, math.ceil((self._held[0][0] - now) * 1e3)))

    @property
    def held(self) -> int:
        """Completions not yet due."""
        return len(self._held)

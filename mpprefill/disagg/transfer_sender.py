"""The per-request KV sender: its state machine and the commands it hands the transfer thread.

The scheduler thread calls `init`, `send` and `abort`; the backend's thread drives the
transitions (`ready`, `succeed`, `fail`) as the decode side answers.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpprefill.disagg.sender import KVPoll, KVSender

if TYPE_CHECKING:
    from mpprefill.disagg.transfer import TransferBackend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferCmd:
    kind: str  # "start" | "send" | "abort"
    sender: TransferSender
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    last: bool = False
    first_token: int | None = None
    swa_src: torch.Tensor | None = None  # the last window's pages in the prefill SWA pool
    swa_dst: torch.Tensor | None = None  # ... and in the decode pool


class TransferSender(KVSender):
    """Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.

    Either thread changes `state` under the lock; `poll` only reads it.
    """

    def __init__(self, backend: TransferBackend, rid: str, room: int | None) -> None:
        self.rid, self.room, self.state = rid, room, KVPoll.Bootstrapping
        self.num_pages: int | None = None
        self.dst_pages: torch.Tensor | None = None  # the room's pages in the decode pool
        self.target = None  # the decode pool those pages are in, as the backend opened it
        self.decode_prefix_len = self._prefix_pages = 0
        self.pages_sent = 0  # pages written so far (transfer thread)
        self.deadline = self.next_try = 0.0  # bootstrap timing (transfer thread)
        self._backend, self._error, self._lock = backend, None, threading.Lock()
        self._queued, self._last_queued = 0, False

    def poll(self) -> KVPoll:
        return self.state

    def init(self, num_pages: int, aux_index: int | None = None) -> None:
        self.num_pages = num_pages
        room = len(self.dst_pages) - self._prefix_pages if self.dst_pages is not None else 0
        if num_pages > room:
            self.abort(f"{num_pages} pages to send but the decode side has {room}")

    def send(self, page_indices, last=False, first_token=None, state_indices=None) -> None:
        if self.state == KVPoll.Failed:
            return
        if self.state == KVPoll.Bootstrapping or self.num_pages is None:
            raise RuntimeError(f"room {self.room}: send before bootstrap and init")
        src = torch.as_tensor(page_indices, dtype=torch.int64).flatten().cpu().clone()
        self._check_send(len(src), last, first_token)
        check_range(src, self._backend.layout.num_pages, "source")
        swa = None if state_indices is None else self._window(state_indices, last)
        if self.state == KVPoll.Failed:
            return
        start = self._prefix_pages + self._queued
        dst = self.dst_pages[start : start + len(src)]
        self._queued, self._last_queued = self._queued + len(src), last
        with self._lock:
            if self.state == KVPoll.WaitingForInput:
                self.state = KVPoll.Transferring
        cmd = TransferCmd("send", self, src, dst, last, first_token)
        if swa is not None:
            cmd.swa_src, cmd.swa_dst = swa
        self._backend.enqueue(cmd)

    def _window(self, state_indices, last: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(SWA source pages, decode pages) of the last window: `state_indices` are the SWA
        pages of the prompt's last pages, in order, so they pair with the room's last pages.
        Pages inside the decode's own prefix are skipped, as full pages are.

        NOTE: the KV write fence knows full pages only and needs no entry for these: the
        last send always carries the page of the prompt's last token, written by the
        request's final forward; every window page was written by that forward or an
        earlier one (with its full page), and forwards complete in order."""
        swa = torch.as_tensor(state_indices, dtype=torch.int64).flatten().cpu().clone()
        if not last:
            raise ValueError(f"room {self.room}: window pages go with the last send")
        if self._backend.swa_planes is None:
            raise ValueError(f"room {self.room}: window pages but the pool has no SWA layers")
        first = len(self.dst_pages) - len(swa)
        if first < 0:
            raise ValueError(f"room {self.room}: {len(swa)} window pages, more than its pages")
        if len(swa) and int(swa.min()) < 0:
            self.abort("a page of the last window has no sliding-window KV")
            return None
        skip = max(0, self._prefix_pages - first)
        check_range(swa, self._backend.swa_planes.num_pages, "SWA source")
        return swa[skip:], self.dst_pages[first + skip :]

    def _check_send(self, n: int, last: bool, first_token: int | None) -> None:
        if self._last_queued:
            raise RuntimeError(f"room {self.room}: send after the last send")
        total = self._queued + n
        if total > self.num_pages or (last and total != self.num_pages):
            raise ValueError(f"room {self.room}: {total} pages sent of {self.num_pages}")
        if last and first_token is None:
            raise ValueError(f"room {self.room}: the last send carries the first token")

    def abort(self, reason: str = "aborted") -> None:
        if self.fail(reason):
            self._backend.enqueue(TransferCmd("abort", self))

    def failure_reason(self) -> str:
        return self._error or "transfer failed"

    def pop_decode_prefix_len(self) -> int:
        return self.decode_prefix_len

    def should_send_kv_chunk(self, num_pages: int, last: bool) -> bool:
        return num_pages > 0 or last

    @property
    def is_live(self) -> bool:
        return self.state not in (KVPoll.Success, KVPoll.Failed)

    # ---- transitions (either thread) ----------------------------------------------------

    def ready(self, target, dst_pages: torch.Tensor, prefix_len: int, prefix_pages: int) -> None:
        with self._lock:
            if self.state == KVPoll.Bootstrapping:
                self.target, self.dst_pages, self.decode_prefix_len = target, dst_pages, prefix_len
                self._prefix_pages, self.state = prefix_pages, KVPoll.WaitingForInput

    def succeed(self) -> None:
        with self._lock:
            if self.state == KVPoll.Transferring:
                self.state = KVPoll.Success

    def fail(self, reason: str) -> bool:
        """Failed unless already finished; True when this call made it fail."""
        with self._lock:
            if not self.is_live:
                return False
            self._error, self.state = reason, KVPoll.Failed
        logger.info("room %s (%s): transfer failed: %s", self.room, self.rid, reason)
        return True


def check_range(pages: torch.Tensor, num_pages: int, what: str) -> None:
    if len(pages) and not 0 <= int(pages.min()) <= int(pages.max()) < num_pages:
        raise ValueError(f"{what} page out of range [0, {num_pages})")

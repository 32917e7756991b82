"""The per-request KV sender: its state machine, and the queue of commands it hands the
transfer thread.

The scheduler thread calls `init`, `send`, `poll` and `abort`; the backend's thread drives
the transitions (`ready`, `wrote`, `succeed`, `fail`) as the decode side answers. A sender
never calls its backend: it queues commands, which the backend's thread takes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass

import torch

from mpprefill.disagg.sender import KVPoll, KVSender
from mpprefill.disagg.wire import brief
from mpprefill.sampling.token_logprob import TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferCmd:
    kind: str  # "start" | "send" | "abort" | "refuse"
    sender: TransferSender | None  # None for "refuse": a request that never got one
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None
    last: bool = False
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None  # with first_token, where the request asked
    swa_src: torch.Tensor | None = None  # the last window's pages in the prefill SWA pool
    swa_dst: torch.Tensor | None = None  # ... and in the decode pool
    layer_seq: int = 0  # a layer-wise send: forward that writes its pages (0: whole pages)
    first_page: int = 0  # "send": its first page's index among the room's sent pages
    room: int | None = None  # "refuse": the room of the refused request
    reason: str = ""  # "refuse": why it was refused
    code: int | None = None  # "refuse": the status the server replied with (protocol.Code)


class CommandQueue:
    """Commands for the transfer thread, in order, and a pipe that wakes its poll.

    `fence` (the worker's `kv_fence`, optional): each send's command is queued with the
    forward its pages need (`fence.required`), named on the scheduler thread; a layer-wise
    send waits on the forward's per-layer counter instead (layerwise_sends.py).
    """

    def __init__(self, fence=None) -> None:
        self.fence = fence
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)

    def put(self, cmd: TransferCmd | None) -> None:
        """Queue `cmd` (None: stop the thread) and wake the thread."""
        fenced = self.fence is not None and cmd is not None and cmd.kind == "send"
        fenced = fenced and not cmd.layer_seq
        self._cmds.put((cmd, self.fence.required(cmd.src) if fenced else 0))
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            os.write(self._wake_w, b"\0")

    def get(self) -> tuple[TransferCmd | None, int]:
        """The next command and the forward it waits for (0: none); queue.Empty if none."""
        return self._cmds.get_nowait()

    def clear_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 4096):
                pass

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            os.close(fd)


@dataclass(frozen=True, slots=True)
class SenderLimits:
    """What every sender of one backend checks against."""

    num_pages: int  # pages of the prefill pool the sources are in
    swa_num_pages: int | None  # ... of its sliding-window pool (None: it has none)
    answer_timeout: float  # seconds the decode side has to answer a bootstrap or final send
    transfer_timeout: float = math.inf  # seconds from the first send to the ack


class TransferSender(KVSender):
    """Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed.

    Either thread changes `state` under the lock. `poll` fails a sender that has waited
    for the decode side longer than `answer_timeout`: for the bootstrap reply (counted
    from its creation) or for the ack of its final send (counted from that send). The
    backend's thread fails one still Transferring `transfer_timeout` after its first send
    (`transfer_by`).

    From the "start" command on, the backend's thread holds the sender (`hand_over`) until
    it drops the room (`let_go`): only then are none of its pages read any more.
    """

    def __init__(
        self, rid: str, room: int | None, commands: CommandQueue, limits: SenderLimits
    ) -> None:
        self.rid = rid
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.num_pages: int | None = None
        self.dst_pages: torch.Tensor | None = None  # the room's pages in the decode pool
        self.target = None  # the decode pool those pages are in, as the backend opened it
        self.decode_prefix_len = 0
        self.instance = ""  # the decode receiver's run that answered the bootstrap
        self.registered = (
            True  # False while no decode has registered the room (bootstrap_server.py)
        )
        self.transfer_by = math.inf  # the backend's deadline for the ack
        self.pages_sent = 0  # pages written so far (transfer thread)
        self.awaiting_ack = False  # its transfer_done went out (transfer thread)
        self.layerwise = False  # its pages are announced with their layers (its bootstrap)
        self._prefix_pages = 0
        self._commands = commands
        self._limits = limits
        self._answer_by = time.monotonic() + limits.answer_timeout
        self._error: str | None = None
        self._lock = threading.Lock()
        self._queued = 0
        self._last_queued = False
        self._held = False

    def poll(self) -> KVPoll:
        if self.is_live and time.monotonic() > self._answer_by:
            self.abort(self._overdue_reason())
        return self.state

    def _overdue_reason(self) -> str:
        timeout = self._limits.answer_timeout
        if self.state == KVPoll.Bootstrapping and not self.registered:
            return f"no decode registered room {self.room} within {timeout:.1f} s"
        if self.state == KVPoll.Bootstrapping:
            return f"bootstrap timed out after {timeout:.1f} s"
        return f"no answer from the decode side within {timeout:.1f}s"

    def init(self, num_pages: int) -> None:
        self.num_pages = num_pages
        room = len(self.dst_pages) - self._prefix_pages if self.dst_pages is not None else 0
        if num_pages > room:
            self.abort(f"{num_pages} pages to send but the decode side has {room}")

    def send(
        self,
        page_indices,
        last=False,
        first_token=None,
        state_indices=None,
        first_logprob=None,
        layer_seq=0,
    ) -> None:
        if self.state == KVPoll.Failed:
            return
        if self.state == KVPoll.Bootstrapping or self.num_pages is None:
            raise RuntimeError(f"room {self.room}: send before bootstrap and init")
        src = torch.as_tensor(page_indices, dtype=torch.int64).flatten().cpu().clone()
        self._check_send(len(src), last, first_token)
        check_range(src, self._limits.num_pages, "source")
        swa = None if state_indices is None else self._window(state_indices, last)
        if self.state == KVPoll.Failed:
            return
        cmd = TransferCmd("send", self, src, self._next_dst(len(src)), last, first_token)
        cmd.first_logprob = first_logprob
        cmd.layer_seq = layer_seq
        cmd.first_page = self._queued
        if swa is not None:
            cmd.swa_src, cmd.swa_dst = swa
        self._queue_send(cmd)

    def _next_dst(self, num_pages: int) -> torch.Tensor:
        start = self._prefix_pages + self._queued
        return self.dst_pages[start : start + num_pages]

    def _queue_send(self, cmd: TransferCmd) -> None:
        self._queued += len(cmd.src)
        self._last_queued = cmd.last
        with self._lock:
            if self.state == KVPoll.WaitingForInput:
                self.state = KVPoll.Transferring
                self.transfer_by = time.monotonic() + self._limits.transfer_timeout
            if cmd.last:  # from now on the decode side is to answer
                self._answer_by = time.monotonic() + self._limits.answer_timeout
        self._commands.put(cmd)

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
        if self._limits.swa_num_pages is None:
            raise ValueError(f"room {self.room}: window pages but the pool has no SWA layers")
        first = len(self.dst_pages) - len(swa)
        if first < 0:
            raise ValueError(f"room {self.room}: {len(swa)} window pages, more than its pages")
        if len(swa) and int(swa.min()) < 0:
            self.abort("a page of the last window has no sliding-window KV")
            return None
        skip = max(0, self._prefix_pages - first)
        check_range(swa, self._limits.swa_num_pages, "SWA source")
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
            self._commands.put(TransferCmd("abort", self))

    def failure_reason(self) -> str:
        return self._error or "transfer failed"

    def settled(self) -> bool:
        return not self._held

    def pop_decode_prefix_len(self) -> int:
        return self.decode_prefix_len

    @property
    def is_live(self) -> bool:
        return self.state not in (KVPoll.Success, KVPoll.Failed)

    # ---- transitions (either thread) ----------------------------------------------------

    def hand_over(self) -> None:
        """The backend queued its "start": its thread holds the sender from now on."""
        self._held = True

    def let_go(self) -> None:
        """The backend's thread dropped the room and reads none of its pages any more."""
        self._held = False

    def ready(
        self,
        target,
        dst_pages: torch.Tensor,
        prefix_len: int,
        prefix_pages: int,
        instance: str = "",
        layerwise: bool = False,
    ) -> None:
        with self._lock:
            if self.state != KVPoll.Bootstrapping:
                return
            self.layerwise = layerwise
            self.target = target
            self.dst_pages = dst_pages
            self.decode_prefix_len = prefix_len
            self.instance = instance
            self._prefix_pages = prefix_pages
            self._answer_by = math.inf  # the scheduler is to act now, not the decode side
            self.state = KVPoll.WaitingForInput

    def wrote(self, num_pages: int) -> None:
        """The transfer thread wrote `num_pages` more of the room's pages."""
        self.pages_sent += num_pages

    def succeed(self) -> None:
        with self._lock:
            if self.state == KVPoll.Transferring:
                self.state = KVPoll.Success

    def fail(self, reason: str) -> bool:
        """Failed unless already finished; True when this call made it fail."""
        with self._lock:
            if not self.is_live:
                return False
            self._error = brief(reason, 400)
            self.state = KVPoll.Failed
        logger.info("room %s (%s): transfer failed: %s", self.room, self.rid, self._error)
        return True


def check_range(pages: torch.Tensor, num_pages: int, what: str) -> None:
    if len(pages) and not 0 <= int(pages.min()) <= int(pages.max()) < num_pages:
        raise ValueError(f"{what} page out of range [0, {num_pages})")

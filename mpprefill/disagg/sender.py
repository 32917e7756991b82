"""KV sender interface, the poll states, and the fake backend."""

from __future__ import annotations

import enum

import torch

from mpprefill.sampling.token_logprob import TokenLogprob


class KVPoll(enum.IntEnum):
    """Sender states; across ranks the minimum wins."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferDied(RuntimeError):
    """The transfer backend's thread failed: no request can move its KV any more."""


class KVSender:
    """One request's KV on its way to the decode side.

    Calls on one sender always come from the scheduler thread, in order:
    `init` once bootstrapped, then `send` for each page range, the last with
    `last=True` (carrying the first token, and its logprob where the request asked for
    logprobs), while `poll` is asked every loop. A send with `layer_seq` N is layer-wise:
    queued when forward N, which writes its pages, is submitted, and read layer by layer as
    that forward writes them (the backend's `layers`).
    With sliding-window layers the last send's `state_indices` are the SWA-pool pages of
    the prompt's last window (planes.window_swa_pages), which pair with its last pages.
    """

    def init(self, num_pages: int) -> None:
        self.num_pages = num_pages

    def send(
        self,
        page_indices: torch.Tensor,
        last: bool = False,
        first_token: int | None = None,
        state_indices: torch.Tensor | None = None,
        first_logprob: TokenLogprob | None = None,
        layer_seq: int = 0,
    ) -> None:
        raise NotImplementedError

    def poll(self) -> KVPoll:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def failure_reason(self) -> str:
        return "transfer failed"

    def settled(self) -> bool:
        """No thread of the backend reads the request's pages any more (its pages may be
        released); asked once `poll` says Success or Failed."""
        return True

    def pop_decode_prefix_len(self) -> int:
        return 0

    def should_send_kv_chunk(self, num_pages: int, last: bool) -> bool:
        """A last send goes out even without pages: it carries the first token."""
        return num_pages > 0 or last


class FakeSender(KVSender):
    """Moves nothing: WaitingForInput until the last send, then Success."""

    def __init__(self) -> None:
        self.sent_pages: list[int] = []
        self.first_token: int | None = None  # what the last send carried
        self.first_logprob: TokenLogprob | None = None
        self._done = self._aborted = False

    def send(
        self,
        page_indices,
        last=False,
        first_token=None,
        state_indices=None,
        first_logprob=None,
        layer_seq=0,
    ) -> None:
        self.sent_pages.extend(int(p) for p in page_indices)
        if last:
            self.first_token = first_token
            self.first_logprob = first_logprob
        self._done = self._done or last

    def poll(self) -> KVPoll:
        if self._aborted:
            return KVPoll.Failed
        return KVPoll.Success if self._done else KVPoll.WaitingForInput

    def abort(self) -> None:
        self._aborted = True

    def failure_reason(self) -> str:
        return "aborted"


class FakeTransfer:
    """Backend factory: every request is bootstrapped at once."""

    name = "fake"
    needs_bootstrap_room = False
    layers = None  # it reads no page, so it sends none layer by layer

    def create_sender(self, req) -> KVSender:
        return FakeSender()

    def refuse(self, room: int, reason: str, code: int | None = None) -> None:
        pass

    def raise_if_dead(self) -> None:
        pass

    def close(self) -> None:
        pass

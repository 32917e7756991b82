"""A transfer backend that records what it read, and small batch builders."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from mpprefill.bench.procs import forward_pids
from mpprefill.disagg.transfer import TransferBackend
from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.worker.api import ForwardInput


class RecordingTransfer(TransferBackend):
    """Copies each send's source pages aside instead of writing a decode pool. No decode
    side answers, so senders are made ready by hand (`ready_sender`)."""

    name = "recording"

    def __init__(self, kv, page_size: int, fence=None):
        self.reads: list[torch.Tensor] = []
        self.kv = kv
        super().__init__(kv, page_size, "127.0.0.1:9", dead_timeout=60.0, fence=fence)

    def _write(self, target, src_pages: torch.Tensor, dst_pages: torch.Tensor, planes) -> None:
        ps = self.page_size
        slots = (src_pages[:, None] * ps + torch.arange(ps)).flatten()
        self.reads.append(self.kv.buffer[:, :, slots].clone())

    def ready_sender(self, room: int, num_pages: int):
        sender = self.create_sender(SimpleNamespace(rid=f"r{room}", bootstrap_room=room))
        sender.ready(None, torch.arange(num_pages), 0, 0)
        sender.init(num_pages)
        return sender

    def wait_reads(self, n: int = 1, timeout: float = 10.0) -> list[torch.Tensor]:
        deadline = time.monotonic() + timeout
        while len(self.reads) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.reads)} of {n} sends read")
            time.sleep(0.005)
        return self.reads


def forward_input(seq: int, ids: list[int], slots: list[int], vocab: int) -> ForwardInput:
    """One request without prefix: `ids` written to KV `slots`."""
    fb = ForwardBatch.build([ids], [0], [slots])
    info = SamplingBatchInfo.from_params([SamplingParams()], vocab)
    return ForwardInput(seq, fb, info)


def rank_pids(parent: int) -> list[int]:
    """The forward processes `parent` spawned (multiprocessing's spawn children)."""
    return forward_pids(parent)

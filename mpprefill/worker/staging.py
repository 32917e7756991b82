"""Staging slots: the tensors of one snapshot, written by the scheduler, read by the worker.

Two slots alternate, so batch N+1 is written while batch N's slot is being read. A slot
is rewritten only after the forward that read it signalled "shared reads done" (the
WAR barrier, `SchedulerOrder.before_write`). Where the slots live follows the device
plan: POSIX shm (CPU, and pinned staging on a GPU) or device memory shared through CUDA
IPC (`CudaIpcStaging`). Slots are allocated once; their handles travel once, at spawn,
and the worker opens them once.

cuda-ipc: the scheduler allocates both slots on the device once and shares them through
CUDA IPC; it fills a slot on its own copy stream (after a device-side wait on the slot's
"reads done" event, then records "staged"), so the copies leave the host at once and the
worker's stream waits for them on the device.

pinned: the slots stay in host shared memory; the worker page-locks the segments once,
then copies each batch in asynchronously on its forward stream. The scheduler never
touches CUDA. The result slot (host shared memory) is page-locked the same way.

Default: pinned, pending GPU numbers. A batch's inputs are small (int64 per new token
plus the page-table rows: hundreds of KiB, a few MiB at most, tens of microseconds over
PCIe), and the forward stream copies batch N+1 in right after forward N, so cuda-ipc's
separate copy engine buys little. Pinned keeps the scheduler free of a CUDA context
(memory, start-up time, CUDA calls holding its GIL), of CUDA IPC's lifetime rules (a
consumer killed by a signal leaks the block while the producer lives; one open per
process), and of a device-side wait it cannot time out; its cost is one host wait in the
worker per forward, before the reply. cuda-ipc should win only if that wait shows up as
a bubble: gpu_check.sh measures both (submit and collect-wait per batch).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

import ipc
from ipc.cuda import pin
from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.streams import CudaStream, HostStream
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import NUM_SLOTS, SchedulerOrder

logger = logging.getLogger(__name__)

FB_FIELDS = ("input_ids", "positions", "out_cache_loc", "prefix_lens", "extend_lens", "kv_indices")
# Read by the worker's host code (the batch's host lengths): in host shared memory on every
# plan, so the worker never reads them back from a device.
HOST_FIELDS = ("prefix_lens", "extend_lens")
SWA_FIELDS = ("swa_out_cache_loc", "swa_kv_indices")  # only in slots of sliding-window models


def staging_specs(
    max_tokens: int, max_reqs: int, max_kv: int, swa: bool = False
) -> ipc.bundle.Specs:
    i64 = torch.int64
    specs = {
        "input_ids": ((max_tokens,), i64),
        "positions": ((max_tokens,), i64),
        "out_cache_loc": ((max_tokens,), i64),
        "prefix_lens": ((max_reqs,), i64),
        "extend_lens": ((max_reqs,), i64),
        "kv_indices": ((max_kv,), i64),
    }
    if swa:
        specs.update(
            {"swa_out_cache_loc": ((max_tokens,), i64), "swa_kv_indices": ((max_kv,), i64)}
        )
    # NOTE: a batch's rows' prompt tokens are at most its KV entries (the repetition
    # penalty's ragged ids)
    sampling = SamplingBatchInfo.tensor_specs(max_reqs, max_kv)
    specs.update({f"s_{k}": v for k, v in sampling.items()})
    return specs


class ShmStaging:
    """The scheduler's two slots in host shared memory, written by the host (CPU, and
    pinned staging on a GPU: the worker page-locks the segments)."""

    device = "cpu"
    non_blocking = False
    stream_type: type[HostStream] = HostStream

    def __init__(self, specs: ipc.bundle.Specs, prefix: str):
        self.specs = specs
        self.bundles = [ipc.SharedBundle(specs, prefix, self.device) for _ in range(NUM_SLOTS)]
        self.stream = self.stream_type()

    @property
    def handles(self) -> list[dict[str, ipc.TensorHandle]]:
        return [b.handles for b in self.bundles]

    def write(self, slot: int, seq: int, fb: ForwardBatch, sampling, order: SchedulerOrder):
        """Barrier, writes, record, all on the writing stream; returns the counts."""
        check_capacity(fb, self.specs, sampling)
        with self.stream.current():
            order.before_write(slot)
            counts = write_slot(self.bundles[slot].tensors, fb, sampling, self.non_blocking)
            order.after_write(slot, seq)
        return counts

    def unlink(self) -> None:
        for b in self.bundles:
            b.unlink()


class CudaIpcStaging(ShmStaging):
    """Slots in device memory, but for the host lengths (`HOST_FIELDS`), which stay in host
    shared memory; the scheduler's writes are copies on its copy stream.

    NOTE: the host lengths need no barrier of their own: the worker reads them before it
    replies Done, and a slot is rewritten only after its forward's Done came back."""

    device = "cuda"
    non_blocking = True  # NOTE: from pageable memory the copy returns once it is staged
    stream_type = CudaStream

    def __init__(self, specs: ipc.bundle.Specs, prefix: str):
        on_device = {k: v for k, v in specs.items() if k not in HOST_FIELDS}
        super().__init__(on_device, prefix)
        self.specs = specs
        host = {k: specs[k] for k in HOST_FIELDS}
        self.host_bundles = [ipc.SharedBundle(host, prefix) for _ in range(NUM_SLOTS)]
        for b, h in zip(self.bundles, self.host_bundles, strict=True):
            b.tensors.update(h.tensors)

    @property
    def handles(self) -> list[dict[str, ipc.TensorHandle]]:
        return [{**b.handles, **h.handles} for b, h in zip(self.bundles, self.host_bundles)]

    def unlink(self) -> None:
        super().unlink()
        for b in self.host_bundles:
            b.unlink()


def staging_class(plan: DevicePlan) -> type[ShmStaging]:
    """The scheduler's staging for a plan (its `device`: where the slots live)."""
    return CudaIpcStaging if plan.staging == "cuda-ipc" else ShmStaging


def make_staging(specs: ipc.bundle.Specs, prefix: str, plan: DevicePlan) -> ShmStaging:
    return staging_class(plan)(specs, prefix)


def write_slot(
    slot: dict[str, torch.Tensor],
    fb: ForwardBatch,
    sampling: SamplingBatchInfo,
    non_blocking: bool = False,
):
    """Copy one snapshot into a slot; returns (num_tokens, num_reqs, num_kv)."""
    for name in FB_FIELDS:
        src = getattr(fb, name)
        slot[name][: len(src)].copy_(src, non_blocking=non_blocking)
    if SWA_FIELDS[0] in slot:
        for name, src in zip(SWA_FIELDS, fb.swa_slots(), strict=True):
            slot[name][: len(src)].copy_(src, non_blocking=non_blocking)
    for name, t in sampling.to_tensors().items():
        slot["s_" + name][: len(t)].copy_(t, non_blocking=non_blocking)
    return fb.num_tokens, fb.batch_size, len(fb.kv_indices)


def read_slot(
    slot: dict[str, torch.Tensor],
    num_tokens: int,
    num_reqs: int,
    num_kv: int,
    device: torch.device | str = "cpu",
    num_penalty_ids: int = 0,
) -> tuple[ForwardBatch, SamplingBatchInfo, bool]:
    """Views of a slot, or copies on `device` when the slot lives elsewhere (issued on the
    current stream, asynchronous from pinned memory). The flag says whether it copied:
    then the slot's reads end here; otherwise they end with the forward. The batch's host
    lengths are read here, from host memory (`HOST_FIELDS`); `num_penalty_ids`: the
    sampling rows' ragged entries (`Submit.num_penalty_ids`)."""
    sizes = {"prefix_lens": num_reqs, "extend_lens": num_reqs, "kv_indices": num_kv}
    sizes["swa_kv_indices"] = num_kv
    names = FB_FIELDS + (SWA_FIELDS if SWA_FIELDS[0] in slot else ())
    fb = ForwardBatch(**{n: slot[n][: sizes.get(n, num_tokens)] for n in names})
    sampling = SamplingBatchInfo.from_tensors(
        {k[2:]: v for k, v in slot.items() if k.startswith("s_")}, num_reqs, num_penalty_ids
    )
    device = torch.device(device)
    if device == fb.input_ids.device:
        if fb.prefix_lens.device != device:  # device slots: their host lengths go along
            lens = {n: getattr(fb, n).to(device, non_blocking=True) for n in HOST_FIELDS}
            fb = dataclasses.replace(fb, **lens)
        return fb, sampling, False
    moved = fb.to(device, non_blocking=True)
    return moved, sampling.to(device, non_blocking=True), True


def check_capacity(
    fb: ForwardBatch, specs: ipc.bundle.Specs, sampling: SamplingBatchInfo | None = None
) -> None:
    sizes = {name: len(getattr(fb, name)) for name in FB_FIELDS}
    if sampling is not None:
        sizes["s_penalty_ids"] = len(sampling.penalty_ids)
    for name, n in sizes.items():
        cap = specs[name][0][0]
        if n > cap:
            raise ValueError(f"batch field {name} has {n} entries, staging holds {cap}")


def pin_segments(handles: list[ipc.TensorHandle]) -> list[torch.Tensor]:
    """Page-lock the whole host segments behind `handles`, once each; returns the pinned
    views (kept by the caller for as long as the mapping lives)."""
    pinned, seen = [], set()
    for h in handles:
        if h.kind != "shm" or h.name in seen:
            continue
        seen.add(h.name)
        whole = ipc.open_handle(ipc.TensorHandle("shm", h.name, "uint8", (h.nbytes,), 0, h.nbytes))
        if pin(whole):
            pinned.append(whole)
        else:
            logger.warning("could not page-lock %s; its copies will be synchronous", h.name)
    return pinned

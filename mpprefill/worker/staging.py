"""Staging slots: the tensors of one snapshot, written by the scheduler, read by the worker.

Two slots alternate, so batch N+1 is written while batch N's slot is being read. A slot
is rewritten only after the forward that read it signalled "shared reads done" (the
WAR barrier): `reads_done[slot]` reaches the seq of that forward.
"""

from __future__ import annotations

import torch

import ipc
from mpprefill.model import ForwardBatch
from mpprefill.sampling import SamplingBatchInfo

FB_FIELDS = ("input_ids", "positions", "out_cache_loc", "prefix_lens", "extend_lens", "kv_indices")
NUM_SLOTS = 2


def staging_specs(max_tokens: int, max_reqs: int, max_kv: int) -> ipc.bundle.Specs:
    i64 = torch.int64
    specs = {
        "input_ids": ((max_tokens,), i64),
        "positions": ((max_tokens,), i64),
        "out_cache_loc": ((max_tokens,), i64),
        "prefix_lens": ((max_reqs,), i64),
        "extend_lens": ((max_reqs,), i64),
        "kv_indices": ((max_kv,), i64),
    }
    specs.update({f"s_{k}": v for k, v in SamplingBatchInfo.tensor_specs(max_reqs).items()})
    return specs


def write_slot(slot: dict[str, torch.Tensor], fb: ForwardBatch, sampling: SamplingBatchInfo):
    """Copy one snapshot into a slot; returns (num_tokens, num_reqs, num_kv)."""
    for name in FB_FIELDS:
        src = getattr(fb, name)
        slot[name][: len(src)].copy_(src)
    for name, t in sampling.to_tensors().items():
        slot["s_" + name][: len(t)].copy_(t)
    return fb.num_tokens, fb.batch_size, len(fb.kv_indices)


def read_slot(
    slot: dict[str, torch.Tensor],
    num_tokens: int,
    num_reqs: int,
    num_kv: int,
    device: torch.device | str = "cpu",
) -> tuple[ForwardBatch, SamplingBatchInfo]:
    """Zero-copy views of a slot (copies when the device differs)."""
    sizes = {"prefix_lens": num_reqs, "extend_lens": num_reqs, "kv_indices": num_kv}
    fb = ForwardBatch(**{n: slot[n][: sizes.get(n, num_tokens)] for n in FB_FIELDS})
    sampling = SamplingBatchInfo.from_tensors(
        {k[2:]: v for k, v in slot.items() if k.startswith("s_")}, batch_size=num_reqs
    )
    if torch.device(device) != fb.input_ids.device:
        fb, sampling = fb.to(device), sampling.to(device)
    return fb, sampling


def check_capacity(fb: ForwardBatch, specs: ipc.bundle.Specs) -> None:
    for name in FB_FIELDS:
        cap = specs[name][0][0]
        if len(getattr(fb, name)) > cap:
            raise ValueError(
                f"batch field {name} has {len(getattr(fb, name))} entries, staging holds {cap}"
            )

"""The forward bound: replay a run's batches in one worker, back to back, nothing between."""

from __future__ import annotations

import json
import time

import torch

from mpprefill.config import ServerArgs
from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.worker.api import ForwardInput, sleep_until_ns
from mpprefill.worker.build import build_runner
from mpprefill.worker.runner import set_torch_threads

WARMUP = 2  # untimed forwards of the first batches before the timed replay


def load_shapes(path: str) -> list[tuple[list[int], list[int]]]:
    with open(path) as f:
        return [(list(p), list(e)) for p, e in json.load(f)]


def forward_bound(shapes: list[tuple[list[int], list[int]]], args: ServerArgs) -> dict:
    """ITPS of the recorded batches with no scheduler in between (same model and threads)."""
    if not shapes:
        raise ValueError("no batches to replay")
    set_torch_threads(args.worker_threads)
    runner = build_runner(args.worker_config(), args.worker_device.torch_device)
    g = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    batches = [_batch(p, e, runner.kv, vocab, g) for p, e in shapes]  # built untimed
    for seq, (fb, sampling) in enumerate(batches[:WARMUP]):
        _sync(args.device, runner.forward(ForwardInput(seq, fb, sampling)))
    t0 = time.perf_counter()
    out = None
    for seq, (fb, sampling) in enumerate(batches, start=WARMUP):
        out = runner.forward(ForwardInput(seq, fb, sampling))
    _sync(args.device, out)  # device work is asynchronous: the clock stops when it is done
    elapsed = time.perf_counter() - t0
    tokens = sum(sum(e) for _, e in shapes)
    return {
        "itps": tokens / elapsed,
        "forward_s": elapsed,
        "num_batches": len(shapes),
        "tokens": tokens,
    }


def _batch(prefix_lens, extend_lens, kv, vocab, g) -> tuple:
    """Random tokens; each request's KV in one contiguous run of slots, as pages mostly are
    (in the SWA pool too, wrapped around its smaller size)."""
    ids, slots, base, num_slots = [], [], 0, kv.num_slots
    for p, e in zip(prefix_lens, extend_lens):
        ids.append(torch.randint(1, vocab, (e,), generator=g).tolist())
        base = 0 if base + p + e > num_slots else base
        slots.append(list(range(base, base + p + e)))
        base += p + e
    fb = ForwardBatch.build(ids, prefix_lens, slots)
    if kv.num_swa_slots:
        fb.swa_out_cache_loc = fb.out_cache_loc % kv.num_swa_slots
        fb.swa_kv_indices = fb.kv_indices % kv.num_swa_slots
    info = SamplingBatchInfo.from_params([SamplingParams()] * len(ids), vocab)
    return fb, info


def _sync(device: str, out) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if out is not None:  # the emulated device's clock
        sleep_until_ns(out.end_ns)

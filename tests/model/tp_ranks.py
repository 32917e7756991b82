"""Tensor-parallel ranks for the model tests: spawn N processes over a gloo group, each runs
the same forwards on its shard of a checkpoint; rank files hold what each computed."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ForwardBatch, load_model
from mpprefill.model.parallel import init_tp_group

POOL = 256


def scenario(model: CausalLM, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Logits of: every prompt whole in one ragged batch; the longest prompt in chunks
    (0-20, 20-21, 21-end) in its own slots; then a prefix hit: the longest prompt's first
    half again, whole, extended by the rest of the prompt over the cached prefix."""
    kv = KVCache.for_model(model.kv_config, POOL)
    starts = [sum(len(p) for p in prompts[:r]) for r in range(len(prompts))]
    slots = [list(range(s, s + len(p))) for s, p in zip(starts, prompts, strict=True)]
    out = {"whole": model(ForwardBatch.build(prompts, [0] * len(prompts), slots), kv)}
    long = max(prompts, key=len)
    base = sum(len(p) for p in prompts)
    chunk_slots = list(range(base, base + len(long)))
    for start, end in [(0, 20), (20, 21), (21, len(long))]:
        fb = ForwardBatch.build([long[start:end]], [start], [chunk_slots[:end]])
        out[f"chunk{end}"] = model(fb, kv)
    half = len(long) // 2
    hit_slots = chunk_slots[:half] + list(range(base + len(long), base + 2 * len(long) - half))
    return out | {"hit": model(_hit_batch(long, half, hit_slots, base + 2 * len(long)), kv)}


def _hit_batch(long: list[int], half: int, hit_slots: list[int], free: int) -> ForwardBatch:
    """The prompt's tail over its cached first half, batched with a fresh 3-token prompt."""
    return ForwardBatch.build(
        [long[half:], long[:3]], [half, 0], [hit_slots, list(range(free, free + 3))]
    )


def rank_main(rank: int, size: int, port: int, paths: list[str], prompts, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_tp_group(rank, size, ("127.0.0.1", port), "gloo", timeout_s=60)
    try:
        results = {p: scenario(load_model(p, tp=tp), prompts) for p in paths}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(size: int, paths: list[str], prompts, out_dir: str, timeout: float = 120):
    """Every rank's results, {path: {name: logits}}; raises if a rank fails or hangs."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, size, store.port, paths, prompts, out_dir))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    codes = [p.exitcode for p in procs]
    if codes != [0] * size:
        raise RuntimeError(f"tensor-parallel ranks exited with {codes}")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(size)]

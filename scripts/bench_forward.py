"""Forward-only throughput of the built-in model, and the scheduler's admission cost.

Usage: python scripts/bench_forward.py [--repeats N] [--threads T]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mpprefill.config import ServerArgs
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from mpprefill.sampling.params import SamplingParams
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.api import Worker


def forward_tokens_per_s(batch_tokens: int, repeats: int, req_len: int = 256) -> float:
    model = load_model(None)
    n_req = max(1, batch_tokens // req_len)
    kv = KVCache.for_model(model.config, batch_tokens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (n_req, req_len), generator=g).tolist()
    slots = torch.randperm(batch_tokens, generator=g).view(n_req, req_len).tolist()
    fb = ForwardBatch.build(ids, [0] * n_req, slots)
    times = []
    with torch.inference_mode():
        model(fb, kv)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(fb, kv)
            times.append(time.perf_counter() - t0)
    return batch_tokens / statistics.median(times)


def admission_us_per_req(
    n_waiting: int, shared_frac: float = 0.8, prompt_len: int = 1000, groups: int = 10
) -> float:
    args = ServerArgs(
        max_total_tokens=(n_waiting + groups) * prompt_len,
        page_size=16,
        max_running_requests=64,
        max_prefill_tokens=16384,
        chunked_prefill_size=-1,
        context_length=prompt_len + 16,
    )
    from mpprefill.model import ModelConfig

    s = Scheduler(args, ModelConfig.tiny(), Worker(), transfer=None)
    rng = random.Random(0)
    sys_len = int(prompt_len * shared_frac)
    systems = [[rng.randrange(1, 4096) for _ in range(sys_len)] for _ in range(groups)]
    for sp in systems:  # warm the cache with every system prompt
        s.tree.insert(sp, s.allocator.alloc(sys_len // 16 * 16))
    reqs = [
        Req(
            f"r{i}",
            rng.choice(systems) + [rng.randrange(1, 4096) for _ in range(prompt_len - sys_len)],
            SamplingParams(),
        )
        for i in range(n_waiting)
    ]
    s.reqs.waiting.extend(reqs)
    spent = 0.0
    while s.reqs.waiting:
        t0 = time.perf_counter()
        batch = s.get_next_batch_to_run()
        spent += time.perf_counter() - t0
        if batch is None:
            raise RuntimeError("admission stalled")
        for r in batch.reqs:  # as if finished: rows and KV go back (not timed)
            s.reqs.release_finished(r)
    return spent / n_waiting * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"{'tokens/batch':>12} | {'forward tokens/s':>16}")
    for n in (512, 2048, 8192):
        print(f"{n:>12} | {forward_tokens_per_s(n, args.repeats):>16,.0f}")
    print(f"\n{'waiting reqs':>12} | {'admission us/req':>16}   (80% shared prefix, 1000 tokens)")
    for n in (100, 1000):
        runs = [admission_us_per_req(n) for _ in range(3)]
        print(f"{n:>12} | {statistics.median(runs):>16.1f}")


if __name__ == "__main__":
    main()

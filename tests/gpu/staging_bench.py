"""Pinned vs cuda-ipc staging on a GPU, offline (no router, no decode side).

`python -m tests.gpu.staging_bench --model DIR --json OUT.json`: the same shared-prefix
workload through proc and proc-ahead with each staging; reports uncached tokens/s and
the scheduler's mean submit and collect-wait times per batch. Used by scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from mpprefill.bench.workload import solve_for_hit_rate
from mpprefill.engine import PrefillEngine

ENGINE_KW = dict(
    device="cuda",
    max_total_tokens=32768,
    chunked_prefill_size=2048,
    max_prefill_tokens=4096,
    max_running_requests=16,
)


def run(model: str | None, mode: str, staging: str, prompts: list[list[int]]) -> dict:
    with PrefillEngine(model, forward_mode=mode, staging=staging, **ENGINE_KW) as eng:
        eng.prefill(prompts[:8])  # warm-up: kernels, allocator, pinned pages
        eng.flush_cache()
        m = eng.scheduler.metrics
        before = dict(m.phase_s), m.num_batches, m.forward_s
        t0 = time.perf_counter()
        outs = eng.prefill(prompts, timeout=120)
        wall = time.perf_counter() - t0
    batches = m.num_batches - before[1]
    per_batch = {p: (m.phase_s[p] - before[0].get(p, 0.0)) / batches for p in ("submit", "collect")}
    uncached = sum(o.prompt_tokens - o.cached_tokens for o in outs)
    return {
        "mode": mode,
        "staging": staging,
        "uncached_itps": uncached / wall,
        "wall_s": wall,
        "num_batches": batches,
        "t_fwd_ms": (m.forward_s - before[2]) / batches * 1e3,
        "submit_ms": per_batch["submit"] * 1e3,
        "collect_wait_ms": per_batch["collect"] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level="WARNING")
    work = solve_for_hit_rate(0.5, a.num_requests, a.prompt_len, 16, seed=1)
    prompts = [r.input_ids for r in work.requests]
    rows = [
        run(a.model, mode, staging, prompts)
        for mode in ("proc", "proc-ahead")
        for staging in ("pinned", "cuda-ipc")
    ]
    for r in rows:
        print(
            f"{r['mode']:>10} {r['staging']:>8}  {r['uncached_itps']:10.0f} tok/s  "
            f"fwd {r['t_fwd_ms']:7.2f} ms  submit {r['submit_ms']:6.3f} ms  "
            f"collect-wait {r['collect_wait_ms']:7.2f} ms  ({r['num_batches']} batches)"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

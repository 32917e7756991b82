"""Host KV store and batched staging, side by side, on a dense and a sliding-window model.

End to end: the bench's workload with a device cache too small for its working set, run
without a host store, with one (batched staging) and with one staging each request apart;
configurations interleaved, medians of --repeats. Each run's batches are then replayed
through the forward alone, and its uncached ITPS is also given as a fraction of that bound
(a higher hit rate makes each uncached token attend over a longer prefix). Then the
staging itself: for N finishing requests per batch, the write-back of their pages (and SWA
checkpoints) as one batched copy or N copies, in ms per batch on the scheduler thread
(planning) and on the copy thread.

    python scripts/bench_host_store.py --repeats 3 [--json out.json]
    python scripts/bench_host_store.py --smoke      # a tiny run: does it work at all

On the emulated accelerator (`--device emulated`: an emulated model on an emulated GPU,
the tier's copies timed over its PCIe link; every figure from it is emulated):

    python scripts/bench_host_store.py --device emulated --emulate-model Llama-3.1-8B \
        --models dense --num-requests 4096 --max-total-tokens 131072 \
        --host-store-size 524288 --chunked-prefill-size 8192 --transfer-backend fake
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from mpprefill.bench.replay import forward_bound, load_shapes
from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import solve_for_hit_rate
from mpprefill.config import ServerArgs
from mpprefill.emulation.setup import host_link_for
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.host.store import HostKVStore
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.req_to_token import ReqToTokenPool
from mpprefill.scheduling.host_tier import HostTier
from mpprefill.scheduling.kv_pools import make_kv_pools
from mpprefill.scheduling.req import Req
from mpprefill.worker.build import worker_model_config

CONFIGS = {
    "no host store": dict(host_store_size=0),
    "host store, batched staging": dict(disable_batched_writeback=False),
    "host store, per-request staging": dict(disable_batched_writeback=True),
}
SMOKE = dict(
    num_requests=16,
    prompt_len=128,
    max_total_tokens=1024,
    host_store_size=8192,
    repeats=1,
    staging_reqs="1,2",
    staging_batches=2,
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="proc-ahead")
    ap.add_argument("--models", default="dense,swa", help="dense and/or swa, comma separated")
    ap.add_argument("--sliding-window", type=int, default=256, help="the SWA model's window")
    ap.add_argument("--swa-layers", default="sf", help="the SWA model's sliding layers")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--hit-rate", type=float, default=0.8)
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="device KV pool")
    ap.add_argument("--host-store-size", type=int, default=262144)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "emulated"))
    ap.add_argument("--emulate-model", default="Qwen2.5-0.5B", help="with --device emulated")
    ap.add_argument("--emulate-gpu", default="h200", help="with --device emulated")
    ap.add_argument("--chunked-prefill-size", type=int, default=None, help="and max prefill")
    ap.add_argument("--transfer-backend", default="shm", choices=("shm", "fake"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--staging-reqs", default="1,2,4,8", help="finishing requests per batch")
    ap.add_argument("--staging-batches", type=int, default=20, help="batches timed per point")
    ap.add_argument("--skip-e2e", action="store_true", help="the staging table only")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    return args


def main() -> None:
    args = parse_args()
    out: dict = {"args": vars(args), "models": {}}
    for model in args.models.split(","):
        base = server_args(args, model)
        result = {"staging": staging_table(args, base)}
        if not args.skip_e2e:
            result["e2e"] = end_to_end(args, base, model)
        out["models"][model] = result
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def server_args(args: argparse.Namespace, model: str) -> ServerArgs:
    if model not in ("dense", "swa"):
        sys.exit(f"--models: dense or swa, got {model!r}")
    swa = dict(sliding_window=args.sliding_window, swa_layers=args.swa_layers)
    emulated = dict(emulate_model=args.emulate_model, emulate_gpu=args.emulate_gpu)
    chunk = args.chunked_prefill_size
    sizes = dict(chunked_prefill_size=chunk, max_prefill_tokens=chunk) if chunk else {}
    return ServerArgs(
        max_total_tokens=args.max_total_tokens,
        host_store_size=args.host_store_size,
        disaggregation_transfer_backend=args.transfer_backend,
        worker_threads=args.worker_threads,
        device=args.device,
        **(emulated if args.device == "emulated" else {}),
        **sizes,
        **(swa if model == "swa" else {}),
    )


# ---- end to end ----------------------------------------------------------------------------


def end_to_end(args: argparse.Namespace, base: ServerArgs, model: str) -> dict:
    work = solve_for_hit_rate(
        args.hit_rate, args.num_requests, args.prompt_len, base.page_size, seed=args.seed
    )
    trials: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for i in range(args.repeats):  # interleaved, so drift in the machine hits all alike
        for name, kw in CONFIGS.items():
            cfg = BenchConfig(base.replace(**kw), [args.mode])
            with tempfile.TemporaryDirectory(prefix="mpp-host-bench-") as tmp:
                record = os.path.join(tmp, "batches.json")
                run = run_mode(cfg, args.mode, work, record)
                if not run["leaks"]["ok"] or run["num_failed"]:
                    sys.exit(f"{name}: run {i} failed or leaked: {run['leaks']} {run['errors']}")
                # the same batches through the forward alone: a higher hit rate makes each
                # uncached token attend over a longer prefix, so the bound moves with it
                shapes = load_shapes(record)[run["warmup_batches"] :]
                run["forward_bound_itps"] = forward_bound(shapes, cfg.server)["itps"]
            trials[name].append(run)
            print(f"[{model} {i + 1}/{args.repeats}] {name}: {summary(run)}", file=sys.stderr)
    rows = {name: medians(runs) for name, runs in trials.items()}
    title = f"{base.worker_device.label}, {model} model, {args.mode}"
    print(f"\n{title}, end to end (medians of {args.repeats})")
    head = f"{'configuration':34s} {'uncached ITPS':>13s} {'total ITPS':>11s}"
    print(f"{head} {'hit rate':>8s} {'P ms/batch':>10s} {'fwd bound':>10s} {'of bound':>8s}")
    for name, r in rows.items():
        line = f"{name:34s} {r['uncached_itps']:13,.0f} {r['total_itps']:11,.0f}"
        line += f" {r['hit_rate']:8.2f} {r['p_ms']:10.2f}"
        print(f"{line} {r['forward_bound_itps']:10,.0f} {r['of_bound']:8.2f}")
    return {"medians": rows, "trials": trials}


def summary(run: dict) -> str:
    p = run["phase_ms_per_batch"]["process"]
    of_bound = run["uncached_itps"] / run["forward_bound_itps"]
    return (
        f"uncached ITPS {run['uncached_itps']:,.0f} ({of_bound:.2f} of the forward bound),"
        f" hit {run['cache_hit_rate']:.2f}, P {p:.2f} ms"
    )


def medians(runs: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs)
    return {
        "uncached_itps": med([r["uncached_itps"] for r in runs]),
        "total_itps": med([r["total_itps"] for r in runs]),
        "hit_rate": med([r["cache_hit_rate"] for r in runs]),
        "p_ms": med([r["phase_ms_per_batch"]["process"] for r in runs]),
        "duration_s": med([r["duration_s"] for r in runs]),
        "forward_bound_itps": med([r["forward_bound_itps"] for r in runs]),
        "of_bound": med([r["uncached_itps"] / r["forward_bound_itps"] for r in runs]),
    }


# ---- staging alone ----------------------------------------------------------------------


def staging_table(args: argparse.Namespace, base: ServerArgs) -> list[dict]:
    """Batched vs per-request staging of N finishing requests' pages, ms per batch."""
    counts = [int(x) for x in args.staging_reqs.split(",")]
    rows = []
    for n in counts:
        row = {"finishing_reqs": n}
        for batched in (True, False):
            plan, copy = time_staging(args, base, n, batched)
            key = "batched" if batched else "per_request"
            row[key] = {"plan_ms": plan, "copy_ms": copy}
        rows.append(row)
    kind = "SWA" if base.sliding_window else "dense"
    title = f"{base.worker_device.label}, {kind} model"
    print(f"\n{title}: staging of finishing requests' write-back, ms per batch (medians)")
    head = f"{'finishing reqs':>14s} {'batched plan':>12s} {'batched copy':>12s}"
    print(f"{head} {'per-req plan':>12s} {'per-req copy':>12s}")
    for r in rows:
        b, s = r["batched"], r["per_request"]
        line = f"{r['finishing_reqs']:14d} {b['plan_ms']:12.3f} {b['copy_ms']:12.3f}"
        print(f"{line} {s['plan_ms']:12.3f} {s['copy_ms']:12.3f}")
    return rows


def time_staging(
    args: argparse.Namespace, base: ServerArgs, num_reqs: int, batched: bool
) -> tuple[float, float]:
    """(scheduler-thread ms, copy-thread ms) per batch of num_reqs fresh prompts, each
    wholly computed, cached as result processing caches it and written back."""
    # room for the whole batch in both pools (the SWA pool is a fraction of the full one)
    need = num_reqs * (args.prompt_len + base.page_size) / base.swa_full_tokens_ratio
    pages = cdiv(int(need), base.page_size)
    base = base.replace(max_total_tokens=max(base.max_total_tokens, pages * base.page_size))
    config = worker_model_config(base.worker_config())
    pool = ReqToTokenPool(num_reqs + 1, args.prompt_len + 1)
    allocator, tree = make_kv_pools(base.pool_config(), config, pool)
    kv = KVCache.for_model(config, allocator.size, num_swa_slots=allocator.swa_size or None)
    kv.storage.normal_()
    store = HostKVStore(args.host_store_size, base.page_size, kv, host_link_for(base.worker_device))
    tier = HostTier(store, tree, allocator, kv, batched)
    gen = torch.Generator().manual_seed(args.seed)
    plan_ms, copy_ms = [], []
    for _ in range(args.staging_batches):
        reqs = [finished_req(pool, allocator, tree, args.prompt_len, gen) for _ in range(num_reqs)]
        t0 = time.perf_counter()
        tier.write_back(reqs)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        tier.retire(wait=True)
        copies = list(tier.staging_log)[-(1 if batched else num_reqs) :]
        copy_ms.append(sum(s for _, s in copies) * 1e3)
        for req in reqs:
            tree.cache_finished_req(req)
            pool.free(req.req_pool_idx)
        tree.evict(allocator.size)
    tier.close()
    return statistics.median(plan_ms), statistics.median(copy_ms)


def finished_req(pool, allocator, tree, prompt_len: int, gen: torch.Generator) -> Req:
    """A fresh prompt whose only chunk ran: its KV slots cached, the tree lock held."""
    ids = torch.randint(0, 32000, (prompt_len,), generator=gen).tolist()
    req = Req(f"s{len(ids)}-{ids[0]}", ids)
    req.last_node, req.prefix_indices = tree.root, torch.empty(0, dtype=torch.int64)
    req.req_pool_idx = pool.alloc()
    slots = allocator.alloc_extend([0], [prompt_len], [-1])
    if slots is None:
        raise RuntimeError(f"the staging pool cannot hold another {prompt_len}-token prompt")
    pool.write(req.req_pool_idx, 0, slots)
    req.fill_ids = ids
    tree.cache_unfinished_req(req)
    return req


if __name__ == "__main__":
    main()

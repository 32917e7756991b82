"""Host KV store and batched staging, side by side: the bench's workload with a device cache
too small for its working set, run without a host store, with one (batched staging) and with
one staging each request apart; configurations interleaved, medians of --repeats.

    python scripts/bench_host_store.py --repeats 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import solve_for_hit_rate
from mpprefill.config import ServerArgs

CONFIGS = {
    "no host store": dict(host_store_size=0),
    "host store, batched write-back": dict(disable_batched_writeback=False),
    "host store, per-request write-back": dict(disable_batched_writeback=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="proc-ahead")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--hit-rate", type=float, default=0.8)
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="device KV pool")
    ap.add_argument("--host-store-size", type=int, default=262144)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = ServerArgs(
        max_total_tokens=args.max_total_tokens,
        host_store_size=args.host_store_size,
        disaggregation_transfer_backend="shm",
        worker_threads=args.worker_threads,
    )
    work = solve_for_hit_rate(
        args.hit_rate, args.num_requests, args.prompt_len, base.page_size, seed=args.seed
    )
    trials: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for i in range(args.repeats):  # interleaved, so drift in the machine hits all alike
        for name, kw in CONFIGS.items():
            cfg = BenchConfig(base.replace(**kw), [args.mode])
            run = run_mode(cfg, args.mode, work)
            if not run["leaks"]["ok"] or run["num_failed"]:
                sys.exit(f"{name}: run {i} failed or leaked: {run['leaks']} {run['errors']}")
            trials[name].append(run)
            print(f"[{i + 1}/{args.repeats}] {name}: {summary(run)}", file=sys.stderr)
    rows = {name: medians(runs) for name, runs in trials.items()}
    print(f"{'configuration':34s} {'uncached ITPS':>13s} {'hit rate':>8s} {'P ms/batch':>10s}")
    for name, r in rows.items():
        print(f"{name:34s} {r['uncached_itps']:13,.0f} {r['hit_rate']:8.2f} {r['p_ms']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "medians": rows, "trials": trials}, f, indent=1)


def summary(run: dict) -> str:
    p = run["phase_ms_per_batch"]["P"]
    return (
        f"uncached ITPS {run['uncached_itps']:,.0f}, hit {run['cache_hit_rate']:.2f}, P {p:.2f} ms"
    )


def medians(runs: list[dict]) -> dict:
    med = lambda xs: statistics.median(xs)
    return {
        "uncached_itps": med([r["uncached_itps"] for r in runs]),
        "total_itps": med([r["total_itps"] for r in runs]),
        "hit_rate": med([r["cache_hit_rate"] for r in runs]),
        "p_ms": med([r["phase_ms_per_batch"]["P"] for r in runs]),
        "duration_s": med([r["duration_s"] for r in runs]),
    }


if __name__ == "__main__":
    main()

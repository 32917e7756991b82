"""Scheduler time at scale: a real Scheduler over a warm radix cache, on the emulated device.

One process, the `normal` loop, `--device emulated` (the model's code at a tiny width on the
CPU, device time on a virtual clock), so the forwards cost little and the scheduler's own
Python is what is measured:

  fill    prefill --fill-prompts distinct prompts of --prompt-len tokens into the cache
          (100 x 1,024: ~100k cached tokens);
  depths  queue 100, 1,000 and 4,000 requests at once and time the first --depth-batches
          batches of each: admission A per admitted request should not grow with the queue;
  gc      queue --requests requests at once (a prefix of a cached prompt plus a fresh tail,
          hit rate --hit-rate) and run them to the end, with the heap frozen after warm-up
          and without, interleaved, --repeats each: A and P per batch, t_sched per batch
          (the loop's time less the forward's; "rest" is t_sched - A - P: early sends, the
          inflight queue, snapshot, bootstrap), and the cyclic GC's pauses (GcWatch), with
          the time of one forced full collection after each run.

Tables print medians over the repeats; --json PATH writes every run.

Usage (defaults shown; about a minute on two cores):
    python scripts/bench_sched.py [--requests 1000] [--repeats 5] [--depths 100,1000,4000]
                                  [--depth-batches 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from mpprefill.engine import PrefillEngine
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.trace.gc import GcWatch, freeze_heap

logger = logging.getLogger("bench_sched")

FORWARD_PHASES = ("collect", "device-wait")  # the forward's time, not the scheduler's
MODES = {False: "unfrozen", True: "frozen"}


# ---- workload ---------------------------------------------------------------------------


class Workload:
    """Seeded prompts: the cache's fill, then requests that share a prefix with it."""

    def __init__(self, vocab: int, prompt_len: int, page_size: int, seed: int):
        self.vocab = vocab
        self.prompt_len = prompt_len
        self.page_size = page_size
        self.gen = torch.Generator().manual_seed(seed)
        self.fill: list[list[int]] = []
        self.count = 0

    def tokens(self, rows: int, cols: int) -> list[list[int]]:
        # NOTE: token 0 is never drawn, as in the bench workloads.
        return torch.randint(1, self.vocab, (rows, cols), generator=self.gen).tolist()

    def make_fill(self, n: int) -> list[list[int]]:
        self.fill = self.tokens(n, self.prompt_len)
        return self.fill

    def shared_len(self, hit_rate: float) -> int:
        """Prefix tokens a request shares with the cache: whole pages only match."""
        pages = int(hit_rate * self.prompt_len) // self.page_size
        return min(pages * self.page_size, self.prompt_len - self.page_size)

    def requests(self, n: int, hit_rate: float) -> list[Req]:
        shared = self.shared_len(hit_rate)
        tails = self.tokens(n, self.prompt_len - shared)
        reqs = []
        for tail in tails:
            prefix = self.fill[self.count % len(self.fill)][:shared]
            reqs.append(Req(f"bench-{self.count}", prefix + tail))
            self.count += 1
        return reqs


# ---- one iteration of the loop per row --------------------------------------------------


@dataclass(slots=True)
class BatchRow:
    depth: int  # requests queued when the iteration began
    reqs: int  # requests in its batch
    a_s: float
    p_s: float
    sched_s: float  # the iteration's wall time less the forward's
    phases: dict[str, float]  # the scheduler's own phases (A, P, early-send, ...)


class Mark(NamedTuple):
    t: float
    phase_s: dict[str, float]
    batches: int
    depth: int


class Iterations:
    """`until` for a scheduler loop: one BatchRow per iteration that ran a batch. Stops when
    the scheduler has drained, or after `max_batches` batches."""

    def __init__(self, s: Scheduler, max_batches: int | None = None):
        self.s = s
        self.max_batches = max_batches
        self.rows: list[BatchRow] = []
        if s.metrics.batch_shapes is None:
            s.metrics.batch_shapes = []  # (prefix, extend) lengths: a batch's request count
        self._mark = self._read()

    def _read(self) -> Mark:
        s = self.s
        depth = len(s.reqs.waiting) + len(s.reqs.bootstrap_queue)
        batches = len(s.metrics.batch_shapes)
        return Mark(time.perf_counter(), dict(s.metrics.phase_s), batches, depth)

    def __call__(self) -> bool:
        mark = self._read()
        if mark.batches > self._mark.batches:
            self.rows.append(self._row(self._mark, mark))
        self._mark = mark
        if self.max_batches is not None and len(self.rows) >= self.max_batches:
            return True
        return not self.s.reqs.live and self.s.forwards_in_flight == 0

    def _row(self, before: Mark, after: Mark) -> BatchRow:
        spent = {k: v - before.phase_s.get(k, 0.0) for k, v in after.phase_s.items()}
        forward = sum(spent.get(k, 0.0) for k in FORWARD_PHASES)
        prefix_lens, _ = self.s.metrics.batch_shapes[before.batches]
        return BatchRow(
            depth=before.depth,
            reqs=len(prefix_lens),
            a_s=spent.get("build", 0.0),
            p_s=spent.get("process", 0.0),
            sched_s=after.t - before.t - forward,
            phases={k: v for k, v in spent.items() if v and k not in FORWARD_PHASES},
        )


def run_requests(eng: PrefillEngine, reqs: list[Req], max_batches: int | None = None) -> Iterations:
    """Queue `reqs` at once and run the loop; with `max_batches`, abort what is left
    afterwards and drain, so the next run starts from an idle scheduler."""
    s = eng.scheduler
    for r in reqs:
        s.add_request(r)
    log = Iterations(s, max_batches)
    LOOPS[eng.mode.name](s, log)
    if s.reqs.live:
        drain(eng)
    return log


def drain(eng: PrefillEngine) -> None:
    s = eng.scheduler
    for r in list(s.reqs.waiting):  # in queue order: each abort finds its request first in line
        s.reqs.abort(r.rid, "bench: measured enough batches")
    LOOPS[eng.mode.name](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)


# ---- steps ------------------------------------------------------------------------------


def build_engine(args: argparse.Namespace) -> PrefillEngine:
    return PrefillEngine(
        forward_mode="normal",
        device="emulated",
        emulate_model=args.emulate_model,
        max_total_tokens=args.max_total_tokens,
        chunked_prefill_size=args.chunk,
        max_prefill_tokens=args.chunk,
        # NOTE: one torch thread: on two cores its pool's spinning costs the host forward
        # several times over, and it would take the scheduler's core.
        worker_threads=1,
        random_seed=args.seed,
    )


def fill_cache(eng: PrefillEngine, work: Workload, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    prompts = work.make_fill(args.fill_prompts)
    for i in range(0, len(prompts), 20):
        eng.prefill(prompts[i : i + 20])
        logger.info("fill: %d/%d prompts", min(i + 20, len(prompts)), len(prompts))
    cached = eng.scheduler.tree.total_size()
    return {"prompts": len(prompts), "cached_tokens": cached, "s": time.perf_counter() - t0}


def warm_up(eng: PrefillEngine, work: Workload, args: argparse.Namespace) -> dict:
    """One unmeasured run: the KV pool reaches capacity, so every later admission evicts
    as a long-running server's does."""
    t0 = time.perf_counter()
    run_requests(eng, work.requests(args.requests, args.hit_rate))
    tree = eng.scheduler.tree
    free = eng.scheduler.allocator.available_size()
    return {"cached_tokens": tree.total_size(), "free_tokens": free, "s": time.perf_counter() - t0}


def depth_run(eng: PrefillEngine, work: Workload, n: int, args: argparse.Namespace) -> dict:
    reqs = work.requests(n, args.hit_rate)
    with GcWatch() as watch:
        log = run_requests(eng, reqs, args.depth_batches)
    return {"depth": n, "gc": watch.to_dict(), "rows": [asdict(r) for r in log.rows]}


def gc_run(eng: PrefillEngine, work: Workload, frozen: bool, args: argparse.Namespace) -> dict:
    frozen_objects = prepare_heap(frozen)
    reqs = work.requests(args.requests, args.hit_rate)  # work arrives after the warm-up
    t0 = time.perf_counter()
    with GcWatch() as watch:
        log = run_requests(eng, reqs)
    wall = time.perf_counter() - t0
    hit_rate = finished_hit_rate(reqs)
    del reqs  # a server drops finished requests: the forced collection should not walk them
    return {
        "frozen": frozen,
        "frozen_objects": frozen_objects,
        "requests": args.requests,
        "wall_s": wall,
        "hit_rate": hit_rate,
        "gc": watch.to_dict(),
        "forced_full_ms": forced_full_ms(),
        "rows": [asdict(r) for r in log.rows],
    }


def finished_hit_rate(reqs: list[Req]) -> float:
    failed = [r for r in reqs if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    return sum(r.cached_tokens for r in reqs) / sum(r.prompt_len for r in reqs)


def prepare_heap(frozen: bool) -> int:
    """Both modes start right after a full collection; the frozen one then freezes."""
    if frozen:
        return freeze_heap()
    gc.unfreeze()
    gc.collect()
    return 0


def forced_full_ms() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t0) * 1e3


# ---- summaries --------------------------------------------------------------------------


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def batch_summary(rows: list[dict]) -> dict:
    """Medians per batch, and per admitted request."""
    return {
        "batches": len(rows),
        "reqs_per_batch": median(r["reqs"] for r in rows),
        "a_ms": median(r["a_s"] * 1e3 for r in rows),
        "a_us_per_req": median(r["a_s"] / r["reqs"] * 1e6 for r in rows),
        "p_ms": median(r["p_s"] * 1e3 for r in rows),
        "p_us_per_req": median(r["p_s"] / r["reqs"] * 1e6 for r in rows),
        "rest_ms": median((r["sched_s"] - r["a_s"] - r["p_s"]) * 1e3 for r in rows),
        "sched_ms": median(r["sched_s"] * 1e3 for r in rows),
        "sched_max_ms": max((r["sched_s"] * 1e3 for r in rows), default=float("nan")),
        "sched_us_per_req": median(r["sched_s"] / r["reqs"] * 1e6 for r in rows),
    }


def gc_summary(watches: list[dict]) -> dict:
    """Gen-2 pauses over runs: how many, and the longest."""
    g2 = [w["gen2"] for w in watches]
    return {
        "gen2_n": sum(g["count"] for g in g2),
        "gen2_max_ms": max((g["max_ms"] for g in g2), default=0.0),
    }


def run_summary(run: dict) -> dict:
    g = run["gc"]
    return {
        **batch_summary(run["rows"]),
        "wall_s": run["wall_s"],
        "hit_rate": run["hit_rate"],
        "sched_total_s": sum(r["sched_s"] for r in run["rows"]),
        "gen2_n": g["gen2"]["count"],
        "gen2_total_ms": g["gen2"]["total_ms"],
        "gen2_max_ms": g["gen2"]["max_ms"],
        "young_total_ms": g["gen0"]["total_ms"] + g["gen1"]["total_ms"],
        "forced_full_ms": run["forced_full_ms"],
        "frozen_objects": run["frozen_objects"],
    }


def medians(summaries: list[dict]) -> dict:
    return {k: median(s[k] for s in summaries) for k in summaries[0]}


DEPTH_COLS = [
    ("queued", "queued", "{:>7,d}"),
    ("batches", "batches", "{:>8d}"),
    ("reqs/batch", "reqs_per_batch", "{:>11.0f}"),
    ("A ms/batch", "a_ms", "{:>11.2f}"),
    ("A us/req", "a_us_per_req", "{:>9.1f}"),
    ("P ms/batch", "p_ms", "{:>11.2f}"),
    ("rest ms/batch", "rest_ms", "{:>14.2f}"),
    ("t_sched ms/batch", "sched_ms", "{:>17.2f}"),
    ("t_sched us/req", "sched_us_per_req", "{:>15.1f}"),
    ("gen-2 n", "gen2_n", "{:>8d}"),
    ("gen-2 max ms", "gen2_max_ms", "{:>13.1f}"),
]

GC_ROWS = [
    ("run wall s", "wall_s", "{:.2f}"),
    ("hit rate", "hit_rate", "{:.3f}"),
    ("batches", "batches", "{:.0f}"),
    ("reqs/batch", "reqs_per_batch", "{:.0f}"),
    ("A ms/batch", "a_ms", "{:.2f}"),
    ("A us/req", "a_us_per_req", "{:.1f}"),
    ("P ms/batch", "p_ms", "{:.2f}"),
    ("P us/req", "p_us_per_req", "{:.1f}"),
    ("rest ms/batch", "rest_ms", "{:.2f}"),
    ("t_sched ms/batch", "sched_ms", "{:.2f}"),
    ("t_sched max ms/batch", "sched_max_ms", "{:.2f}"),
    ("t_sched total s", "sched_total_s", "{:.3f}"),
    ("gen-2 pauses", "gen2_n", "{:.0f}"),
    ("gen-2 total ms", "gen2_total_ms", "{:.1f}"),
    ("gen-2 max ms", "gen2_max_ms", "{:.1f}"),
    ("gen-0/1 total ms", "young_total_ms", "{:.1f}"),
    ("forced full collect ms", "forced_full_ms", "{:.2f}"),
    ("frozen objects", "frozen_objects", "{:,.0f}"),
]


def print_depths(depths: dict[int, dict]) -> None:
    print("admission by queue depth (medians over the first batches of each run)")
    print(" ".join(f"{h:>{len(fmt.format(0))}s}" for h, _, fmt in DEPTH_COLS))
    for row in depths.values():
        print(" ".join(fmt.format(row[k]) for _, k, fmt in DEPTH_COLS))


def print_gc(modes: dict[str, dict], requests: int) -> None:
    print(f"\n{requests:,} requests queued at once, run to the end (medians over repeats)")
    print(f"{'':24s}" + "".join(f"{name:>14s}" for name in modes))
    for label, key, fmt in GC_ROWS:
        cells = "".join(f"{fmt.format(m[key]):>14s}" for m in modes.values())
        print(f"{label:24s}{cells}")


# ---- main -------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fill-prompts", type=int, default=100, help="distinct prompts cached")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=1000, help="requests per gc run")
    ap.add_argument("--hit-rate", type=float, default=0.8)
    ap.add_argument("--depths", default="100,1000,4000", help="queue depths, comma-separated")
    ap.add_argument("--depth-batches", type=int, default=3, help="batches timed per depth run")
    ap.add_argument("--repeats", type=int, default=5, help="runs per mode and per depth")
    ap.add_argument("--max-total-tokens", type=int, default=262144)
    ap.add_argument("--chunk", type=int, default=8192, help="chunked and max prefill tokens")
    ap.add_argument("--emulate-model", default="Qwen2.5-0.5B")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every run here")
    return ap.parse_args()


class Steps:
    """Progress on stderr, one line per finished step: `[k/total] what (elapsed)`."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.t0 = time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        logger.info("[%d/%d] %s (%.0f s)", self.done, self.total, what, elapsed)


def run_depths(
    eng: PrefillEngine, work: Workload, args: argparse.Namespace, depths: list[int], step: Steps
) -> tuple[dict[int, dict], list[dict]]:
    runs = []
    for rep in range(args.repeats):  # interleaved and rotated: drift hits every depth alike
        for n in depths[rep % len(depths) :] + depths[: rep % len(depths)]:
            runs.append(depth_run(eng, work, n, args))
            a_us = batch_summary(runs[-1]["rows"])["a_us_per_req"]
            step(f"depth {n:,}, repeat {rep + 1}: A {a_us:.1f} us/req")
    rows = {}
    for n in depths:
        mine = [run for run in runs if run["depth"] == n]
        rows[n] = batch_summary([r for run in mine for r in run["rows"]])
        rows[n].update(gc_summary([run["gc"] for run in mine]), queued=n)
    return rows, runs


def run_gc(
    eng: PrefillEngine, work: Workload, args: argparse.Namespace, step: Steps
) -> tuple[dict[str, dict], list[dict]]:
    runs = []
    for rep in range(args.repeats):
        order = (False, True) if rep % 2 == 0 else (True, False)  # each mode goes first too
        for frozen in order:
            runs.append(gc_run(eng, work, frozen, args))
            s = run_summary(runs[-1])
            step(
                f"{MODES[frozen]}, repeat {rep + 1}: {s['wall_s']:.1f} s,"
                f" {s['gen2_n']} gen-2 pauses, forced full {s['forced_full_ms']:.0f} ms"
            )
    gc.unfreeze()
    modes = {}
    for frozen, name in MODES.items():
        modes[name] = medians([run_summary(r) for r in runs if r["frozen"] == frozen])
    return modes, runs


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logger.setLevel(logging.INFO)
    depths = [int(d) for d in args.depths.split(",") if d]
    with build_engine(args) as eng:
        vocab = eng.model_config.vocab_size
        work = Workload(vocab, args.prompt_len, eng.args.page_size, args.seed)
        fill = fill_cache(eng, work, args)
        logger.info("fill: %(cached_tokens)d cached tokens in %(s).1f s", fill)
        warm = warm_up(eng, work, args)
        logger.info("warm-up: %(cached_tokens)d cached, %(free_tokens)d free, %(s).1f s", warm)
        step = Steps(args.repeats * (len(depths) + 2))
        depth_rows, depth_runs = run_depths(eng, work, args, depths, step)
        modes, gc_runs = run_gc(eng, work, args, step)
        eng.check_invariants()
    print_depths(depth_rows)
    print_gc(modes, args.requests)
    if args.json:
        runs = {"depth_runs": depth_runs, "gc_runs": gc_runs}
        write_json(args, {"fill": fill, "warm_up": warm}, depth_rows, modes, runs)


def write_json(
    args: argparse.Namespace, setup: dict, depth_rows: dict, modes: dict, runs: dict
) -> None:
    out = {
        "args": vars(args),
        **setup,
        "depths": {str(n): row for n, row in depth_rows.items()},
        "gc": modes,
        **runs,
    }
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

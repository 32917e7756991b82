"""TP staging micro-benchmark: one staging slot shared by every rank, or a copy per rank.

For each TP size N and batch size, through the project's staging over host shared memory
(`ShmStaging.write`, `read_slot`):

(a) write: the scheduler's cost per batch of writing one shared slot (its barrier and record
    over every rank, as `GroupOrder` does) against N slots, one per rank, each under that
    rank's own order; median us over --iters batches, the two alternating.
(b) read: N spawned reader processes hold both designs' slots open (a forward process opens
    its slots once). Once a batch is written each reader is signalled through its pipe,
    calls `read_slot` and copies every tensor out: on the CPU a forward reads the slot in
    place and with pinned staging it copies it in, so the copy stands for that touch of the
    bytes. `read`: median us from a reader's signal to its copies; `wall`: median us from
    "written" until the last of the N readers has its tensors. A batch's hand-off is its
    write plus its wall.

Batches: requests of 256-1024 new tokens behind page-aligned cached prefixes (a quarter
cold), filling the token budget (the last one a chunk), KV slots on scattered pages as
req_to_token rows are, sampling parameters from a mix through `SamplingBatchInfo.from_params`
as the scheduler builds them.

Usage: python scripts/bench_tp_staging.py [--iters N] [--tp 2,4,8] [--tokens 512,8192]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import statistics
import struct
import time

import torch
import zmq

import ipc
from mpprefill.config import ServerArgs
from mpprefill.model import ForwardBatch
from mpprefill.model.forward_batch import TENSORS
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.worker.device import DevicePlan
from mpprefill.worker.events import NUM_EVENTS, NUM_SLOTS, SchedulerOrder, make_events
from mpprefill.worker.group import GroupOrder
from mpprefill.worker.staging import ShmStaging, make_staging, read_slot, staging_specs

DESIGNS = ("shared", "per_rank")
PAGE = 16
VOCAB = 128256  # Llama 3's
EXTEND_LENS = (256, 1024)
PREFIX_LENS = (256, 3072)  # a cached system prompt or earlier turns, whole pages
COLD = 0.25  # the share of requests with nothing cached
SAMPLING_MIX = (
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50, seed=1234),
    SamplingParams(temperature=0.6, top_p=0.95, min_p=0.05),
)
WAIT_S = 60.0
SIGNAL = struct.Struct("<5q")  # design (-1: exit), slot, tokens, requests, KV indices
STAMPS = struct.Struct("<2d")  # a reader's start and done, on the system-wide clock


def make_batch(tokens: int, rng: random.Random) -> tuple[ForwardBatch, SamplingBatchInfo]:
    extends = _extend_lens(tokens, rng)
    prefixes = [_prefix_len(rng) for _ in extends]
    rows = _kv_rows([p + e for p, e in zip(prefixes, extends, strict=True)], rng)
    ids = [[rng.randrange(1, VOCAB) for _ in range(e)] for e in extends]
    fb = ForwardBatch.build(ids, prefixes, rows)
    params = [rng.choice(SAMPLING_MIX) for _ in extends]
    return fb, SamplingBatchInfo.from_params(params, VOCAB)


def _extend_lens(tokens: int, rng: random.Random) -> list[int]:
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(min(rng.randint(*EXTEND_LENS), tokens - sum(lens)))
    return lens


def _prefix_len(rng: random.Random) -> int:
    if rng.random() < COLD:
        return 0
    return rng.randint(PREFIX_LENS[0] // PAGE, PREFIX_LENS[1] // PAGE) * PAGE


def _kv_rows(seq_lens: list[int], rng: random.Random) -> list[list[int]]:
    """Each request's KV slots on its own pages, drawn at random from a pool twice as large."""
    counts = [-(-n // PAGE) for n in seq_lens]
    pages = rng.sample(range(2 * sum(counts)), sum(counts))
    rows, used = [], 0
    for n, count in zip(seq_lens, counts, strict=True):
        own = pages[used : used + count]
        used += count
        rows.append([p * PAGE + i for p in own for i in range(PAGE)][:n])
    return rows


def batch_bytes(fb: ForwardBatch, sampling: SamplingBatchInfo) -> int:
    """What one copy of the batch writes into a slot."""
    tensors = [getattr(fb, name) for name in TENSORS]
    return sum(t.nbytes for t in (*tensors, *sampling.to_tensors().values()))


class Rig:
    """The scheduler's side: one shared staging and one per rank, an event table per rank.
    No forward records "reads done", so `release` does it for every rank the batch went to."""

    def __init__(self, specs: ipc.bundle.Specs, prefix: str, ranks: int):
        plan = DevicePlan.of("cpu", "shm")
        self.shared = make_staging(specs, prefix, plan)
        self.own = [make_staging(specs, prefix, plan) for _ in range(ranks)]
        tables = [torch.zeros(NUM_EVENTS, dtype=torch.int64) for _ in range(ranks)]
        events = [make_events(plan, "scheduler", t)[0] for t in tables]
        self.orders = [SchedulerOrder(e, alive=lambda: True) for e in events]
        self.groups = {n: GroupOrder(self.orders[:n]) for n in range(1, ranks + 1)}
        self.seq = 0

    def write(self, design: str, ranks: int, fb: ForwardBatch, sampling) -> tuple[int, tuple]:
        """The batch staged for `ranks` ranks; returns its slot and counts."""
        self.seq += 1
        slot = self.seq % NUM_SLOTS
        if design == "shared":
            counts = self.shared.write(slot, self.seq, fb, sampling, self.groups[ranks])
            return slot, counts
        for staging, order in zip(self.own[:ranks], self.orders[:ranks], strict=True):
            counts = staging.write(slot, self.seq, fb, sampling, order)
        return slot, counts

    def release(self, slot: int, ranks: int) -> None:
        for order in self.orders[:ranks]:
            order.events.reads_done[slot].record(self.seq)

    @property
    def slot_bytes(self) -> int:
        return next(iter(self.shared.handles[0].values())).nbytes

    def unlink(self) -> None:
        for staging in (self.shared, *self.own):
            staging.unlink()


def _handle_dicts(staging: ShmStaging) -> list[dict[str, dict]]:
    """NOTE: handles travel as plain dicts, as in `WorkerSetup`."""
    return [{k: h.to_dict() for k, h in slot.items()} for slot in staging.handles]


def _open(slots: list[dict[str, dict]]) -> list[dict[str, torch.Tensor]]:
    return [
        ipc.open_bundle({k: ipc.TensorHandle.from_dict(d) for k, d in s.items()}) for s in slots
    ]


def _copy_out(fb: ForwardBatch, sampling: SamplingBatchInfo) -> list[torch.Tensor]:
    tensors = [getattr(fb, name) for name in TENSORS]
    return [t.clone() for t in (*tensors, *sampling.to_tensors().values())]


def _reader(endpoint: str, shared: list[dict], own: list[dict]) -> None:
    """One rank: both designs' slots opened once, then one read per signal until told to
    exit (or the parent is silent for WAIT_S). One thread: a slot's copy is too small to split."""
    torch.set_num_threads(1)
    slots = (_open(shared), _open(own))
    conn = zmq.Context.instance().socket(zmq.PAIR)
    conn.setsockopt(zmq.LINGER, 1000)
    conn.connect(endpoint)
    conn.send(b"ready")
    while conn.poll(WAIT_S * 1000):
        design, slot, num_tokens, num_reqs, num_kv = SIGNAL.unpack(conn.recv())
        if design < 0:
            break
        start = time.monotonic()
        fb, sampling, _ = read_slot(slots[design][slot], num_tokens, num_reqs, num_kv)
        _copy_out(fb, sampling)
        conn.send(STAMPS.pack(start, time.monotonic()))
    conn.close()


def _recv(conn: zmq.Socket, what: str) -> bytes:
    if not conn.poll(WAIT_S * 1000):
        raise TimeoutError(f"no {what} from a reader within {WAIT_S}s")
    return conn.recv()


class Readers:
    """`n` spawned reader processes, reader r reading the shared slot or rank r's own."""

    def __init__(self, rig: Rig, n: int):
        self.conns, self.procs, self.endpoints = [], [], []
        try:
            self._start(rig, n)
        except BaseException:
            self.close()
            raise

    def _start(self, rig: Rig, n: int) -> None:
        ctx = mp.get_context("spawn")
        shared = _handle_dicts(rig.shared)
        tag = ipc.new_prefix("tpr")
        for r in range(n):
            conn = zmq.Context.instance().socket(zmq.PAIR)
            conn.setsockopt(zmq.LINGER, 0)
            endpoint = ipc.ipc_endpoint(f"{tag}-{r}")
            conn.bind(endpoint)
            self.conns.append(conn)
            self.endpoints.append(endpoint)
            args = (endpoint, shared, _handle_dicts(rig.own[r]))
            proc = ctx.Process(target=_reader, args=args, name=f"tp-reader{r}", daemon=True)
            proc.start()
            self.procs.append(proc)
        for conn in self.conns:
            if _recv(conn, "ready") != b"ready":
                raise RuntimeError("a reader did not start")

    def read(self, design: str, ranks: int, slot: int, counts: tuple) -> list[tuple]:
        """Signal the first `ranks` readers at once; each one's (start, done) stamps."""
        msg = SIGNAL.pack(DESIGNS.index(design), slot, *counts)
        for conn in self.conns[:ranks]:
            conn.send(msg)
        return [STAMPS.unpack(_recv(conn, "read")) for conn in self.conns[:ranks]]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(zmq.ZMQError):  # that reader is gone already
                conn.send(SIGNAL.pack(-1, 0, 0, 0, 0), zmq.NOBLOCK)
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn, endpoint in zip(self.conns, self.endpoints):
            conn.close()
            ipc.remove_ipc_endpoint(endpoint)


def _warmup(iters: int) -> int:
    return max(3, iters // 10)


def _alternate(i: int) -> tuple[str, ...]:
    """Both designs each iteration; which goes first alternates."""
    return DESIGNS if i % 2 == 0 else DESIGNS[::-1]


def _us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def time_writes(rig: Rig, ranks: int, fb, sampling, iters: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {d: [] for d in DESIGNS}
    for i in range(_warmup(iters) + iters):
        for design in _alternate(i):
            t0 = time.perf_counter()
            slot, _ = rig.write(design, ranks, fb, sampling)
            spent = time.perf_counter() - t0
            rig.release(slot, ranks)
            if i >= _warmup(iters):
                samples[design].append(spent)
    return {d: _us(s) for d, s in samples.items()}


def time_reads(rig: Rig, readers: Readers, ranks: int, fb, sampling, iters: int) -> dict:
    """Per design: the median read (over every reader) and the median wall, in us."""
    reads: dict[str, list[float]] = {d: [] for d in DESIGNS}
    walls: dict[str, list[float]] = {d: [] for d in DESIGNS}
    for i in range(_warmup(iters) + iters):
        for design in _alternate(i):
            slot, counts = rig.write(design, ranks, fb, sampling)
            written = time.monotonic()  # NOTE: CLOCK_MONOTONIC, the readers' clock too
            stamps = readers.read(design, ranks, slot, counts)
            rig.release(slot, ranks)
            if i >= _warmup(iters):
                reads[design] += [done - start for start, done in stamps]
                walls[design].append(max(done for _, done in stamps) - written)
    return {
        "read_us": {d: _us(s) for d, s in reads.items()},
        "wall_us": {d: _us(s) for d, s in walls.items()},
    }


def run(tps: list[int], tokens: list[int], iters: int, seed: int) -> dict:
    rng = random.Random(seed)
    batches = {n: make_batch(n, rng) for n in tokens}
    max_kv = max(len(fb.kv_indices) for fb, _ in batches.values())
    max_reqs = ServerArgs().max_running_requests
    specs = staging_specs(max(tokens), max_reqs, max_kv)
    prefix = ipc.new_prefix("mppbench")
    rig = None
    readers = None
    out = {"cpus": os.cpu_count(), "iters": iters, "rows": []}
    try:
        rig = Rig(specs, prefix, max(tps))
        out["slot_bytes"] = rig.slot_bytes
        readers = Readers(rig, max(tps))
        for ranks in tps:
            for n, (fb, sampling) in batches.items():
                row = {"tp": ranks, "tokens": n, "reqs": fb.batch_size, "kv": len(fb.kv_indices)}
                row["batch_bytes"] = batch_bytes(fb, sampling)
                row["write_us"] = time_writes(rig, ranks, fb, sampling, iters)
                row.update(time_reads(rig, readers, ranks, fb, sampling, iters))
                out["rows"].append(row)
    finally:
        if readers is not None:
            readers.close()
        if rig is not None:
            rig.unlink()
        ipc.remove_prefix(prefix)
    return out


def print_table(out: dict) -> None:
    print(
        f"slot capacity {out['slot_bytes'] / 1024:.0f} KiB (sized for the largest batch), "
        f"{out['cpus']} CPUs, {out['iters']} iterations; medians in us, shared / per-rank"
    )
    print(
        f"{'tp':>2} | {'tokens':>6} | {'reqs':>4} | {'batch KiB':>9} | "
        f"{'(a) write':>17} | {'(b) read':>17} | {'(b) wall':>17}"
    )
    for row in out["rows"]:
        cells = [row[k] for k in ("write_us", "read_us", "wall_us")]
        pairs = " | ".join(f"{c['shared']:7.1f} / {c['per_rank']:7.1f}" for c in cells)
        print(
            f"{row['tp']:>2} | {row['tokens']:>6} | {row['reqs']:>4} | "
            f"{row['batch_bytes'] / 1024:>9.1f} | {pairs}"
        )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300, help="batches timed per point and design")
    ap.add_argument("--tp", type=_ints, default=[2, 4, 8], help="TP sizes, comma separated")
    ap.add_argument("--tokens", type=_ints, default=[512, 8192], help="new tokens per batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    out = run(args.tp, args.tokens, args.iters, args.seed)
    print_table(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

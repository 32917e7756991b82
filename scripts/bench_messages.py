"""Message micro-benchmark: encode and decode time per frame of each channel's typical
messages, and the mailbox round trip (Submit there, Done back) between two processes.

Channels: the worker mailbox (Submit, Done), the request protocol (a generate frame of 1k
and of 32k input ids, a done reply) and the disagg transfer wire (Bootstrap, TransferDone).
Each figure is the median over `--runs` runs of the mean over a run's iterations.

Usage: python scripts/bench_messages.py [--runs N] [--iters N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable

import ipc
from mpprefill import protocol
from mpprefill.disagg import wire
from mpprefill.sampling.token_logprob import TokenLogprob
from mpprefill.worker.messages import Done, Exit, Submit


def _frames() -> list[tuple[str, Callable[[], bytes], Callable[[bytes], object]]]:
    """(name, encode, decode) of each typical frame."""
    submit = Submit(41, 1, 512, 8, 600, False, True, 3)
    done = Done(41, 0.0123, True, 1_700_000_000, 1_700_000_900, 0.01, 0.002)
    sampling = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 16}
    logprobs = [TokenLogprob(-0.25, [[5, -0.25], [9, -1.5]])]
    boot = wire.Bootstrap(123456789, 2, [[0, 4], [4, 8]], "bfloat16")
    tdone = wire.TransferDone(123456789, 42, 17, "abcdef0123456789", -0.25, [[42, -0.25]])
    return [
        ("mailbox Submit", lambda: ipc.encode(submit), ipc.decode),
        ("mailbox Done", lambda: ipc.encode(done), ipc.decode),
        (
            "generate 1k ids",
            lambda: protocol.generate_frame("req-1k", list(range(1000)), sampling, 7),
            protocol.parse_frame,
        ),
        (
            "generate 32k ids",
            lambda: protocol.generate_frame("req-32k", list(range(32_000)), sampling, 7),
            protocol.parse_frame,
        ),
        (
            "done reply",
            lambda: protocol.done_reply("req-1k", 5, 1000, 512, None, None, logprobs, True),
            None,
        ),
        ("wire Bootstrap", lambda: wire.encode(boot), wire.decode),
        ("wire TransferDone", lambda: wire.encode(tdone), wire.decode),
    ]


def _mean_us(fn: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def _median(fn: Callable[[], object], iters: int, runs: int) -> float:
    fn()
    return statistics.median(_mean_us(fn, iters) for _ in range(runs))


def codec_table(runs: int, iters: int) -> list[tuple[str, int, float, float | None]]:
    rows = []
    for name, enc, dec in _frames():
        n = max(5, iters // 100) if "32k" in name else iters
        frame = enc()
        dec_us = None if dec is None else _median(lambda f=frame, d=dec: d(f), n, runs)
        rows.append((name, len(frame), _median(enc, n, runs), dec_us))
    return rows


def _peer(endpoint: str, parent: int) -> None:
    box = ipc.Channel(endpoint, bind=False, peer_pid=parent, peer_is_parent=True)
    while True:
        msg = box.get(timeout=60)
        if isinstance(msg, Exit):
            break
        box.put(Done(msg.seq, 0.001, False, 1, 2, 0.0005, 0.0), timeout=60)
    box.close()


def round_trip_us(runs: int, iters: int) -> float:
    endpoint = ipc.ipc_endpoint(f"msgbench-{uuid.uuid4().hex[:8]}")
    box = ipc.Channel(endpoint, bind=True)
    proc = mp.get_context("spawn").Process(target=_peer, args=(endpoint, os.getpid()))
    proc.start()
    box.set_peer(proc.pid)
    seq = [0]

    def once() -> None:
        seq[0] += 1
        box.put(Submit(seq[0], seq[0] % 2, 512, 8, 600, False, True), timeout=10)
        if box.get(timeout=10).seq != seq[0]:
            raise RuntimeError("the peer answered another message")

    try:
        return _median(once, iters, runs)
    finally:
        box.put(Exit("done"), timeout=10)
        proc.join(10)
        box.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    print(f"{'frame':<18} | {'bytes':>7} | {'encode us':>10} | {'decode us':>10}")
    for name, size, enc, dec in codec_table(args.runs, args.iters):
        shown = "-" if dec is None else f"{dec:10.2f}"
        print(f"{name:<18} | {size:>7} | {enc:10.2f} | {shown:>10}")
    rt = round_trip_us(args.runs, max(50, args.iters // 10))
    print(f"{'mailbox round trip':<18} | {'':>7} | {rt:10.2f} us (Submit there, Done back)")


if __name__ == "__main__":
    main()

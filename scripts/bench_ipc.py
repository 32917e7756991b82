"""Mailbox micro-benchmark: round-trip latency of three ways to hand a tensor over.

(a) raw ZeroMQ ipc:// ping-pong of a 64-byte frame;
(b) one-slot mailbox round trip carrying a shared-tensor handle; the receiver opens
    the handle (cached after the first time) and reads the sequence number the
    sender stamped into the tensor's first and last elements;
(c) the same tensor's bytes sent through ZeroMQ and echoed with a 64-byte reply.

Usage: python scripts/bench_ipc.py [--iters N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import uuid

import torch
import zmq

import ipc

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


@ipc.message
class Ping(ipc.Message, tag=True):
    seq: int
    handle: ipc.TensorHandle | None = None


def _peer(raw_ep: str, box_ep: str, parent: int) -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PAIR)
    raw.connect(raw_ep)
    box = ipc.Channel(box_ep, bind=False, peer_pid=parent)
    while True:
        frame = raw.recv(copy=False)
        if len(frame) == 1:
            break
        raw.send(b"x" * 64)
    while True:
        msg = box.get(timeout=60)
        if msg.handle is None:
            break
        t = ipc.open_handle(msg.handle)
        ok = int(t[0]) == msg.seq and int(t[-1]) == msg.seq
        box.put(Ping(msg.seq if ok else -1), timeout=60)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e6, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6


def _time(fn, iters: int) -> tuple[float, float]:
    for _ in range(max(3, iters // 10)):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return _percentiles(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    tag = uuid.uuid4().hex[:8]
    raw_ep, box_ep = ipc.ipc_endpoint(f"raw-{tag}"), ipc.ipc_endpoint(f"box-{tag}")
    raw = zmq.Context.instance().socket(zmq.PAIR)
    raw.bind(raw_ep)
    box = ipc.Channel(box_ep, bind=True)
    proc = mp.get_context("spawn").Process(target=_peer, args=(raw_ep, box_ep, os.getpid()))
    proc.start()
    box.set_peer(proc.pid)
    prefix = ipc.new_prefix("mppbench")
    rows = []
    try:
        rows = _run(raw, box, prefix, args.iters)
    finally:
        box.put(Ping(0), timeout=10)
        proc.join(10)
        ipc.remove_prefix(prefix)
    print(
        f"{'size':>6} | {'(a) raw zmq p50/p99 us':>22} | {'(b) mailbox+handle':>20} | "
        f"{'(c) bytes via zmq':>20} | b/a p50"
    )
    for name, a, b, c in rows:
        print(
            f"{name:>6} | {a[0]:9.1f} / {a[1]:9.1f} | {b[0]:8.1f} / {b[1]:9.1f} | "
            f"{c[0]:8.1f} / {c[1]:9.1f} | {b[0] / a[0]:.2f}"
        )


def _run(raw, box, prefix, iters):
    def raw_ping(payload=b"x" * 64):
        raw.send(payload, copy=len(payload) < 65536)
        raw.recv(copy=False)

    def count(nbytes):
        return iters if nbytes <= (1 << 20) else max(30, iters // 10)

    raw_rows = {}
    for name, nbytes in SIZES.items():
        payload = bytes(nbytes)
        raw_rows[name] = (
            _time(raw_ping, count(nbytes)),
            _time(lambda p=payload: raw_ping(p), count(nbytes)),
        )
    raw.send(b"q")  # the peer moves on to the mailbox
    rows = []
    seq = [0]
    for name, nbytes in SIZES.items():
        st = ipc.SharedTensor.create((nbytes // 8,), torch.int64, prefix)

        def box_rt(st=st):
            seq[0] += 1
            st.tensor[0] = seq[0]
            st.tensor[-1] = seq[0]
            box.put(Ping(seq[0], st.handle), timeout=10)
            if box.get(timeout=10).seq != seq[0]:
                raise RuntimeError("receiver read the wrong bytes")

        a, c = raw_rows[name]
        rows.append((name, a, _time(box_rt, count(nbytes)), c))
        st.unlink()
    return rows


if __name__ == "__main__":
    main()

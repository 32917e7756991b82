"""KV transfer throughput: GiB of pages through each backend vs a plain in-process torch copy.

Every row moves the same scattered source pages in the same chunks (one gather/scatter or
one batch per chunk): "torch copy" into a tensor of this process with a fresh gather
tensor per chunk, "torch staged" the same through one reused gather buffer (as the shm
backend does), "shm" into a decode receiver's segment (bootstrap, sends, transfer_done and
ack included), "mooncake" through the transfer engine over loopback TCP. One warm-up run,
then the median of --repeats.

Usage: python scripts/bench_transfer.py [--gib 1] [--repeats 3] [--no-mooncake]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from mpprefill.bench.procs import free_port
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.mooncake_backend import unavailable_reason
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.shm_backend import plane_view
from mpprefill.memory.kv_cache import KVCache

logger = logging.getLogger("bench_transfer")


def model_dir(args, root: str) -> str:
    """A config.json only: the decode side sizes its pool from it (no weights needed)."""
    hidden = args.kv_heads * args.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 1024,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.kv_heads,
        "num_key_value_heads": args.kv_heads,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1 << 20,
    }
    Path(root, "config.json").write_text(json.dumps(config))
    return root


class Decode:
    """A decode receiver subprocess and a router socket talking to it."""

    def __init__(self, backend: str, model: str, tokens: int, page: int):
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "mpprefill.decode", "--receiver-port", str(port)]
        cmd += ["--zmq-port", "0"]
        cmd += ["--model-path", model, "--max-total-tokens", str(tokens), "--page-size", str(page)]
        cmd += ["--disaggregation-transfer-backend", backend, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{self.address}")
        self._wait_ready(60.0)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.send({"type": "ping"})
            if self.sock.poll(500):
                self.sock.recv()
                return
        raise RuntimeError("decode receiver did not start")

    def send(self, obj: dict) -> None:
        self.sock.send(json.dumps(obj).encode())

    def recv_reply(self, timeout: float = 60.0) -> dict:
        """The next router reply (pongs of the start-up pings are skipped)."""
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = json.loads(self.sock.recv())
            if "rid" in msg:
                return msg
        raise TimeoutError("no reply from the decode receiver")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        self.proc.terminate()
        self.proc.wait(30)


class Req:
    def __init__(self, rid: str, room: int, prompt_len: int):
        self.rid, self.bootstrap_room, self.prompt_len = rid, room, prompt_len


def run_backend(backend, decode: Decode, src_pages, chunk: int, room: int, page: int) -> float:
    n = len(src_pages)
    decode.send({"type": "register", "rid": f"b{room}", "bootstrap_room": room,
                 "input_ids": [0] * (n * page)})  # fmt: skip
    sender = backend.create_sender(Req(f"b{room}", room, n * page))
    wait(sender, (KVPoll.WaitingForInput,), 60)
    sender.init(n)
    t0 = time.perf_counter()
    for i in range(0, n, chunk):
        last = i + chunk >= n
        sender.send(src_pages[i : i + chunk], last=last, first_token=0 if last else None)
    state = wait(sender, (KVPoll.Success, KVPoll.Failed), 600)
    elapsed = time.perf_counter() - t0
    if state != KVPoll.Success:
        raise RuntimeError(f"transfer failed: {sender.failure_reason()}")
    if decode.recv_reply()["status"] != "done":
        raise RuntimeError("the decode side did not confirm")
    return elapsed


def wait(sender, states, timeout: float) -> KVPoll:
    deadline = time.monotonic() + timeout
    while sender.poll() not in states:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sender stuck in {sender.poll().name}")
        time.sleep(0.0005)
    return sender.poll()


def run_torch(kv: KVCache, dst: torch.Tensor, src_pages, chunk: int, page: int, stage=None):
    """The same page gather/scatter in this process; `stage` reuses one gather buffer."""
    src_v, dst_v = plane_view(kv.buffer, page), plane_view(dst, page)
    dst_pages = torch.arange(len(src_pages))
    t0 = time.perf_counter()
    for i in range(0, len(src_pages), chunk):
        s, d = src_pages[i : i + chunk], dst_pages[i : i + chunk]
        if stage is None:
            dst_v.index_copy_(1, d, src_v.index_select(1, s))
        else:
            out = stage[: src_v.shape[0] * len(s) * src_v.shape[2]].view(src_v.shape[0], len(s), -1)
            dst_v.index_copy_(1, d, torch.index_select(src_v, 1, s, out=out))
    return time.perf_counter() - t0


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first touch of the destination pages
    return [fn() for _ in range(repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-pages", type=int, default=64, help="pages per send")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-mooncake", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    page = args.page_size
    kv = KVCache(args.layers, page, args.kv_heads, args.head_dim)
    page_bytes = kv.bytes_per_slot * page
    n = int(args.gib * (1 << 30)) // page_bytes
    kv = KVCache(args.layers, n * page, args.kv_heads, args.head_dim)
    kv.buffer.uniform_()
    src_pages = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    chunk = args.chunk_pages
    rows = [
        ("torch copy", bench_torch(kv, src_pages, chunk, args, staged=False)),
        ("torch staged", bench_torch(kv, src_pages, chunk, args, staged=True)),
    ]
    backends = ["shm"] + ([] if args.no_mooncake or mooncake_missing() else ["mooncake"])
    with tempfile.TemporaryDirectory() as tmp:
        for name in backends:
            rows.append((name, bench_backend(name, kv, model_dir(args, tmp), src_pages, args)))
    print_table(rows, n * page_bytes, n, chunk)


def bench_torch(kv: KVCache, src_pages, chunk: int, args, staged: bool) -> list[float]:
    dst = torch.empty_like(kv.buffer)
    stage = torch.empty(kv.buffer.numel() * chunk // len(src_pages) + 1) if staged else None
    run = lambda: run_torch(kv, dst, src_pages, chunk, args.page_size, stage)
    return timed(run, args.repeats)


def bench_backend(name: str, kv: KVCache, model: str, src_pages, args) -> list[float]:
    page, n = args.page_size, len(src_pages)
    decode = Decode(name, model, n * page, page)
    backend = make_transfer(name, kv, page, decode.address, bootstrap_timeout=60.0)
    rooms = iter(range(1, 1000))
    try:
        run = lambda: run_backend(backend, decode, src_pages, args.chunk_pages, next(rooms), page)
        return timed(run, args.repeats)
    finally:
        backend.close()
        decode.close()


def mooncake_missing() -> bool:
    reason = unavailable_reason()
    if reason:
        logger.warning("skipping mooncake: %s", reason)
    return reason is not None


def print_table(rows, nbytes: int, pages: int, chunk: int) -> None:
    print(f"\n{nbytes / (1 << 30):.2f} GiB in {pages} pages, {chunk} pages per send")
    print(f"{'path':<12} {'median s':>9} {'GB/s':>7} {'min s':>7} {'max s':>7}")
    for name, times in rows:
        med = statistics.median(times)
        line = f"{name:<12} {med:>9.3f} {nbytes / med / 1e9:>7.2f}"
        print(f"{line} {min(times):>7.3f} {max(times):>7.3f}")


if __name__ == "__main__":
    main()

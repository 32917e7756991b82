"""Helpers of the disagg tests: a decode receiver subprocess, a router, a filled pool."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import zmq

import ipc
from mpprefill.bench.procs import free_port
from mpprefill.disagg.sender import KVPoll
from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, load_model
from tests import slow_decode

PAGE = 16
PROMPT_LENS = (33, 16, 47, 5)


class DecodeProc:
    """`python -m mpprefill.decode` in a subprocess, ready once it answers a ping.
    `port`: its receiver socket; `zmq_port` its request socket; `http_port` (optional) its
    HTTP front."""

    def __init__(
        self,
        *flags: str,
        max_total_tokens: int = 4096,
        backend: str = "shm",
        port: int = 0,
        http_port: int = 0,
        delay_ms: float = 0.0,
    ):
        self.port = port or free_port()
        self.zmq_port = free_port()
        self.http_port = http_port
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        # NOTE: with a test delay, the same server through the launcher that injects it
        launcher = (
            slow_decode.command(delay_ms)
            if delay_ms
            else [sys.executable, "-m", "mpprefill.decode"]
        )
        cmd = [*launcher, "--receiver-port", str(self.port)]
        cmd += ["--zmq-port", str(self.zmq_port), "--port", str(http_port)]
        cmd += ["--page-size", str(PAGE), "--max-total-tokens", str(max_total_tokens)]
        cmd += ["--disaggregation-transfer-backend", backend, "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> DecodeProc:
        with Router(self.address) as r:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"decode exited ({self.proc.returncode}): {self.output()}")
                r.send({"type": "ping"})
                if r.recv(0.5, missing_ok=True) == {"type": "pong"}:
                    return self
        raise TimeoutError(f"decode not ready in {timeout} s: {self.output()}")

    @property
    def prefix(self) -> str:
        return f"mppdecode_{self.proc.pid}_"

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def close(self) -> list[str]:
        """Stop it; return (and remove) the segments it left behind."""
        self.stop()
        left = ipc.list_segments(self.prefix)
        ipc.remove_prefix(self.prefix)
        self.log.close()
        return left


class Router:
    """A DEALER playing the router: JSON frames in and out, every wait bounded."""

    def __init__(self, address: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")

    def send(self, obj) -> None:
        self.send_raw(json.dumps(obj).encode())

    def send_raw(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def register(self, rid: str, room: int, input_ids: list[int]) -> None:
        self.send({"type": "register", "rid": rid, "bootstrap_room": room, "input_ids": input_ids})

    def recv(self, timeout: float = 10.0, missing_ok: bool = False) -> dict | None:
        if self.sock.poll(int(timeout * 1000)):
            return json.loads(self.sock.recv())
        if missing_ok:
            return None
        raise TimeoutError(f"no reply within {timeout} s")

    def sync(self, timeout: float = 10.0) -> None:
        """Ping and wait for the pong: everything sent before has been handled."""
        self.send({"type": "ping"})
        while self.recv(timeout) != {"type": "pong"}:
            pass

    def recv_many(self, n: int, timeout: float = 20.0) -> dict[str, dict]:
        deadline, out = time.monotonic() + timeout, {}
        while len(out) < n:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            out[msg["rid"]] = msg
        return out

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class FakeReq:
    rid: str
    bootstrap_room: int | None
    prompt_len: int


@dataclass
class Prompt:
    ids: list[int]
    pages: torch.Tensor  # source pages in the prefill pool
    first_token: int

    @property
    def num_pages(self) -> int:
        return cdiv(len(self.ids), PAGE)


def filled_pool(lens=PROMPT_LENS, num_pages: int = 64, seed: int = 0):
    """A prefill KVCache filled by the real model over prompts on scattered pages."""
    model = load_model(None)
    kv = KVCache.for_model(model.config, num_pages * PAGE)
    alloc = PagedTokenAllocator(num_pages, PAGE)
    alloc.alloc_pages(3)  # pages 0-2 stay unused, so page ids != prompt order
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lens:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        pages = alloc.alloc_pages(cdiv(n, PAGE)).flip(0)
        slots = alloc.slots_of(pages)[:n].tolist()
        logits = model(ForwardBatch.build([ids], [0], [slots]), kv)
        prompts.append(Prompt(ids, pages, int(logits[0].argmax())))
    return kv, prompts


def wait_state(sender, states, timeout: float = 10.0) -> KVPoll:
    states = (states,) if isinstance(states, KVPoll) else tuple(states)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sender.poll() in states:
            return sender.poll()
        time.sleep(0.005)
    raise TimeoutError(f"sender stayed {sender.poll().name}, wanted {[s.name for s in states]}")


def send_chunks(sender, prompt: Prompt, chunk_pages: int = 1) -> None:
    """Whole pages in non-final sends, then the rest (tail page included) with the token."""
    pages, n = prompt.pages, prompt.num_pages
    cut = max(0, n - 1)
    for i in range(0, cut, chunk_pages):
        sender.send(pages[i : min(i + chunk_pages, cut)], last=False)
    sender.send(pages[cut:], last=True, first_token=prompt.first_token)


def bootstrap(sender, prompt: Prompt, timeout: float = 10.0) -> None:
    """What the scheduler's pop_bootstrapped does once the decode side answered."""
    wait_state(sender, KVPoll.WaitingForInput, timeout)
    prefix = sender.pop_decode_prefix_len()
    sender.init(cdiv(len(prompt.ids) - prefix, PAGE))


def step(rx, timeout_ms: int) -> None:
    """One turn of a decode receiver, as the decode server's loop gives it."""
    if rx.sock.poll(timeout_ms):
        rx.read()
    rx.tick()


@contextlib.contextmanager
def serving(rx):
    """A decode receiver serving on a thread for the block; stopped, joined, closed after."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            step(rx, 10 if rx.busy else 100)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield rx
    finally:
        stop.set()
        thread.join(5)
        rx.close()
    assert not thread.is_alive()

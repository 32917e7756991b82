"""Layer-wise KV send: the real scheduler loops with `--disaggregation-layerwise-send`.

Through a verifying decode receiver (the KV that arrives is the model's, every page with
every layer), and on the emulated device, whose clock makes each layer of a forward take
time: no layer of a page is read before the forward's counter says it is written, layers
go out while later ones still compute, and the decode pool ends up with the prefill pool's
bytes.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.sender import KVPoll
from mpprefill.disagg.shm_backend import ShmTransfer
from mpprefill.emulation.setup import transfer_link_for
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.modes import MODES
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.streams import HostStream
from mpprefill.worker.factory import make_worker
from mpprefill.worker.layers import layer_gen, local_layers
from tests.disagg.helpers import PAGE, FakeReq, Router, bootstrap, send_chunks, serving, wait_state

pytestmark = pytest.mark.timeout(120)


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(4096) for _ in range(40)]
    return [system + [rng.randrange(4096) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(s: Scheduler, mode: str, reqs: list[Req], router: Router) -> None:
    for r in reqs:
        router.register(r.rid, r.bootstrap_room, r.origin_input_ids)
        s.add_request(r)
    LOOPS[mode](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)


@pytest.mark.usefixtures("no_prefill_segments")
@pytest.mark.parametrize("mode", ["normal", "proc-ahead"])
def test_layerwise_send_passes_verify(mode, decode, router):
    """Chunked prompts with shared prefixes: cached prefixes go early and whole, middle and
    last chunks layer by layer; the decode verifies the KV against its own model."""
    args = ServerArgs(
        forward_mode=mode,
        page_size=PAGE,
        chunked_prefill_size=32,
        max_total_tokens=2048,
        disaggregation_transfer_backend="shm",
        decode_address=decode.address,
        disaggregation_layerwise_send=True,
        worker_threads=1,
    )
    worker, config = make_worker(args, MODES[mode])
    progress = worker.layer_progress
    transfer = make_transfer(
        "shm", worker.kv_cache, PAGE, decode.address, fence=worker.kv_fence, layers=progress
    )
    index = ["normal", "proc-ahead"].index(mode)
    base = 20_000 + 100 * index
    prompts = _prompts(seed=10 + index, n=6, lo=1, hi=60)
    reqs = [Req(f"lw-{mode}-{i}", p, bootstrap_room=base + i) for i, p in enumerate(prompts)]
    try:
        s = Scheduler(args, config, worker, transfer)
        assert s.layerwise
        _run(s, mode, reqs, router)
        replies = router.recv_many(len(reqs))
        forwards = s.batch_seq
    finally:
        transfer.close()
        worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert sum(r.cached_tokens for r in reqs) > 0  # some pages went early, whole
    # every forward published each of its layers
    assert progress.layers_done(forwards) == config.num_hidden_layers
    for r in reqs:
        reply = replies[r.rid]
        assert reply["status"] == "done" and reply["first_token"] == r.first_token, reply
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
        assert r.sender.layerwise and r.sender.pages_sent == cdiv(r.prompt_len, PAGE)


class WatchedShm(ShmTransfer):
    """The shm backend, noting for every layer it writes the forward's counter as it stood
    right before the write, and every (source, destination) pages it wrote."""

    def __init__(self, *a, **kw):
        self.seen: list[tuple[int, int, int]] = []  # (forward, layer, counter)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        super().__init__(*a, **kw)

    def _write_layer(self, x, layer: int) -> None:
        counter = min(c.value() for c in self.layers.counters)
        self.seen.append((x.seq, layer, counter))
        super()._write_layer(x, layer)

    def _write(self, remote, src, dst, planes) -> None:
        self.pairs.append((src.clone(), dst.clone()))
        super()._write(remote, src, dst, planes)


def _slots(pages: torch.Tensor) -> torch.Tensor:
    return (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()


def test_no_layer_is_read_before_the_forward_wrote_it():
    """A 70B model's 80 layers on the emulated H100: each layer takes the clock's time, so
    the transfer reads layer i while later layers run, and never before the counter says
    layer i is written; each layer's bytes go on the emulated link (400 Gb/s) as it does.
    Every slot starts random (the stand-in writes few of them), and no page is reused on
    either side, so the decode pool must equal the prefill pool on every page sent."""
    mode = "thread"
    args = ServerArgs(
        forward_mode=mode,
        device="emulated",
        emulate_model="Llama-3.1-70B",
        emulate_gpu="h100",
        emulate_link_gbps=400,
        page_size=PAGE,
        chunked_prefill_size=256,
        max_total_tokens=4096,
        disaggregation_transfer_backend="shm",
        disaggregation_layerwise_send=True,
        worker_threads=1,
    )
    worker, config = make_worker(args, MODES[mode])
    kv = worker.kv_cache
    gen = torch.Generator().manual_seed(3)
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=gen).to(kv.buffer.dtype))
    decode_args = DecodeArgs(
        receiver_port=0, page_size=PAGE, max_total_tokens=4096, emulate_model="Llama-3.1-70B"
    )
    rx = DecodeReceiver(decode_args)
    rng = random.Random(5)
    prompts = [[rng.randrange(4096) for _ in range(rng.randrange(300, 440))] for _ in range(4)]
    reqs = [Req(f"lw-emu-{i}", p, bootstrap_room=30_000 + i) for i, p in enumerate(prompts)]
    with serving(rx), Router(rx.address) as router:
        layers = worker.layer_progress
        link = transfer_link_for(args.link_config(), args.worker_device)
        transfer = WatchedShm(kv, PAGE, rx.address, fence=worker.kv_fence, layers=layers, link=link)
        try:
            _run(Scheduler(args, config, worker, transfer), mode, reqs, router)
            replies = router.recv_many(len(reqs))
            decode_kv = rx.pool.kv.buffer.clone()
        finally:
            transfer.close()
            worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert all(replies[r.rid]["status"] == "done" for r in reqs), replies
    num_layers = config.num_hidden_layers
    seen = transfer.seen
    assert {layer for _, layer, _ in seen} == set(range(num_layers))
    for seq, layer, counter in seen:  # the counter said layer `layer` of `seq` was written
        assert counter >= layer_gen(seq, layer + 1, num_layers), (seq, layer, counter)
    # layers went out while the same forward still computed later ones
    assert any(counter < layer_gen(seq, num_layers, num_layers) for seq, _, counter in seen)
    sent = sum(len(src) for src, _ in transfer.pairs) // num_layers
    # every layer's pages went on the emulated link (the 70B model's bytes), and little else
    kv_bytes = sent * PAGE * link.kv_bytes_per_token * num_layers
    assert kv_bytes <= transfer.out.link.bytes_carried < kv_bytes + 64 * 1024
    assert sent == sum(cdiv(r.prompt_len, PAGE) for r in reqs)
    for src, dst in transfer.pairs:
        assert torch.equal(kv.buffer[:, :, _slots(src)], decode_kv[:, :, _slots(dst)])


def test_the_decode_takes_a_layerwise_room_only_with_every_layer_of_every_page():
    """A layer-wise bootstrap makes the room count each page's layers: transfer_done before
    the last page's layers were announced is refused; with them, the room is done."""
    rx = DecodeReceiver(DecodeArgs(receiver_port=0, max_total_tokens=4 * PAGE))
    layers = rx.layout.num_layers
    with serving(rx), Router(rx.address) as router, Router(rx.address) as prefill:
        for room in (1, 2):
            router.register(f"r{room}", room, [1] * (PAGE + 3))  # 2 pages
        router.sync()
        for room in (1, 2):
            prefill.send({"type": "bootstrap", "room": room, "layerwise": True})
            assert prefill.recv()["status"] == "ready"
        written = {"type": "layers_written", "instance": rx.instance, "layers": layers}
        done = {"type": "transfer_done", "first_token": 9, "num_pages": 2, "instance": rx.instance}
        # room 1: page 0 whole, page 1 only up to its last layer but one
        prefill.send({**written, "room": 1, "first_page": 0, "num_pages": 1})
        prefill.send({**written, "room": 1, "first_page": 1, "num_pages": 1, "layers": layers - 1})
        prefill.send({**done, "room": 1})
        ack = prefill.recv()
        assert ack["ok"] is False and f"page 1 has {layers - 1} of {layers} layers" in ack["error"]
        assert router.recv()["status"] == "error"
        # room 2: pages past the room are refused; then both pages with every layer
        prefill.send({**written, "room": 2, "first_page": 1, "num_pages": 2})
        assert prefill.recv()["ok"] is False and router.recv()["status"] == "error"
        router.register("r3", 3, [1] * (PAGE + 3))
        router.sync()
        prefill.send({"type": "bootstrap", "room": 3, "layerwise": True})
        assert prefill.recv()["status"] == "ready"
        prefill.send({**written, "room": 3, "first_page": 0, "num_pages": 2})
        prefill.send({**done, "room": 3})
        assert prefill.recv() == {
            "type": "ack",
            "room": 3,
            "ok": True,
            "error": None,
            "instance": rx.instance,
        }
        done = router.recv()
        assert (done["rid"], done["status"], done["first_token"]) == ("r3", "done", 9)


def test_a_pool_with_sliding_window_layers_sends_whole_pages(caplog):
    """Its last window goes with the last send, known only then: the backend keeps no
    per-layer counter, bootstraps do not say layerwise, and the scheduler sends whole."""
    swa = KVCache(4, 8 * PAGE, 2, 8, swa_layers=(0, 2), num_swa_slots=4 * PAGE)
    full = KVCache(4, 8 * PAGE, 2, 8)
    progress = local_layers(HostStream(), 4)[1]
    for kv, layerwise in ((swa, False), (full, True)):
        transfer = ShmTransfer(kv, PAGE, "127.0.0.1:9", layers=progress)
        try:
            assert (transfer.layers is not None) is layerwise
            assert transfer.pages.bootstrap(1).layerwise is layerwise
        finally:
            transfer.close()
    assert "layer-wise send off: the KV pool has sliding-window layers" in caplog.text


def test_a_send_whose_forward_never_ends_lets_its_sender_go(pool, decode, router, room):
    """The worker died mid-forward: the counter never reaches the send's layers. Once the
    request fails, the sender is let go (its pages may then be freed) and the decode hears
    of it; the commands queued behind the send do not stay stuck."""
    kv, prompts = pool
    progress = local_layers(HostStream(), kv.num_layers)[1]  # no forward ever publishes
    backend = make_transfer("shm", kv, PAGE, decode.address, layers=progress)
    try:
        p = prompts[0]
        r = room()
        router.register("stuck", r, p.ids)
        s = backend.create_sender(FakeReq("stuck", r, len(p.ids)))
        bootstrap(s, p)
        s.send(p.pages, layer_seq=1)  # every page, layer by layer, of forward 1
        s.send(p.pages[:0], last=True, first_token=p.first_token)  # waits behind them
        time.sleep(0.3)
        assert s.poll() == KVPoll.Transferring and not s.settled() and s.pages_sent == 0
        s.abort("the forward process died")
        deadline = time.monotonic() + 10
        while not s.settled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.settled() and s.poll() == KVPoll.Failed
        assert router.recv()["status"] == "error"
        q = prompts[1]
        r = room()
        router.register("after", r, q.ids)
        s2 = backend.create_sender(FakeReq("after", r, len(q.ids)))
        bootstrap(s2, q)
        send_chunks(s2, q)
        assert wait_state(s2, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        assert router.recv()["status"] == "done"
    finally:
        backend.close()

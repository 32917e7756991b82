"""A sliding-window model end to end: the real scheduler sends through shm and mooncake to
an in-process verifying decode receiver, whose received KV is checked here as well.

Window 32, pages of 16, chunks of 64 and prompts of 100-200 tokens: SWA pages leave the
window while a request is still computed; only the last window's SWA pages are sent.
"""

from __future__ import annotations

import random

import pytest

import ipc
from mpprefill.config import ServerArgs
from mpprefill.decode.args import DecodeArgs
from mpprefill.decode.receiver import DecodeReceiver
from mpprefill.disagg.backends import make_transfer
from mpprefill.disagg.plane_map import window_first_page
from mpprefill.memory.allocator import cdiv
from mpprefill.modes import MODES
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE, Router, serving
from tests.disagg.swa_helpers import PATTERN, WINDOW, assert_window_kv
from tests.mooncake_check import skip_without_mooncake

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(
    params=[("shm", PATTERN), ("mooncake", PATTERN), ("shm", "all")],
    ids=["shm", "mooncake", "shm-all-layers"],
)
def receiver(request):
    """A verifying decode receiver on a thread; `received` collects (ids, prefix, KV).
    With every layer sliding the full-attention pool has no planes at all."""
    backend, pattern = request.param
    if backend == "mooncake":
        skip_without_mooncake()
    args = DecodeArgs(
        receiver_port=0,
        page_size=PAGE,
        max_total_tokens=4096,
        verify=True,
        sliding_window=WINDOW,
        swa_layers=pattern,
        disaggregation_transfer_backend=backend,
    )
    rx = DecodeReceiver(args)
    rx.received = []
    submit = rx.verifier.submit
    rx.verifier.submit = lambda ids, prefix, kv: (
        rx.received.append((ids, prefix, kv.clone())) or submit(ids, prefix, kv)
    )
    with serving(rx):
        yield rx
    if backend == "shm":
        assert not ipc.list_segments(rx.pool.shared.handle.name.lstrip("/"))


def workload(n: int = 6) -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(4096) for _ in range(80)]
    return [system + [rng.randrange(4096) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


def test_scheduler_sends_only_the_last_window(receiver):
    backend = receiver.args.disaggregation_transfer_backend
    args = ServerArgs(
        forward_mode="overlap",
        page_size=PAGE,
        chunked_prefill_size=64,
        max_total_tokens=2048,
        disaggregation_transfer_backend=backend,
        decode_address=receiver.address,
        worker_threads=1,
        sliding_window=WINDOW,
        swa_layers=receiver.args.swa_layers,
        swa_full_tokens_ratio=0.12,  # 15 pages: out-of-window pages must make room
    )
    worker, config = make_worker(args, MODES["overlap"])
    assert config.has_sliding_layers
    transfer = make_transfer(backend, worker.kv_cache, PAGE, receiver.address)
    windows = {}
    put = transfer.commands.put

    def spy(cmd):  # the window pages each request's last send carries
        if cmd is not None and cmd.swa_src is not None:
            windows[cmd.sender.rid] = len(cmd.swa_src)
        put(cmd)

    transfer.commands.put = spy
    try:
        s = Scheduler(args, config, worker, transfer)
        dropped, free_swa = [], s.allocator.free_swa
        s.allocator.free_swa = lambda slots: dropped.append(len(slots)) or free_swa(slots)
        reqs = [Req(f"w{i}", p, bootstrap_room=300 + i) for i, p in enumerate(workload())]
        with Router(receiver.address) as router:
            for r in reqs:
                router.register(r.rid, r.bootstrap_room, r.origin_input_ids)
            router.sync()
            for r in reqs:
                s.add_request(r)
            LOOPS["overlap"](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)
            replies = router.recv_many(len(reqs))
    finally:
        transfer.close()
        worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert sum(dropped) > 0  # out-of-window SWA pages were freed while requests ran
    for r in reqs:
        reply = replies[r.rid]
        assert reply["status"] == "done" and reply["first_token"] == r.first_token, reply
        assert reply["verified"] is True, reply
        n = r.prompt_len
        assert r.sender.pages_sent == cdiv(n, PAGE)
        assert windows[r.rid] == cdiv(n, PAGE) - window_first_page(n, WINDOW, PAGE)
    assert len(receiver.received) == len(reqs)
    for ids, prefix, kv in receiver.received:
        assert assert_window_kv(receiver.verifier.model, ids, kv, prefix) >= 64

"""The real scheduler loops sending through the shm backend to a verifying decode receiver.

Shared prefixes make the radix cache hit, so cached prefixes go out early; a small chunk
size makes requests send page-aligned middle chunks before the final one.
"""

from __future__ import annotations

import random

import pytest

from mpprefill.config import ServerArgs
from mpprefill.disagg.backends import make_transfer
from mpprefill.memory.allocator import cdiv
from mpprefill.modes import MODES
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req, ReqStatus
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.factory import make_worker
from tests.disagg.helpers import PAGE

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_prefill_segments")]


def workload(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(4096) for _ in range(40)]
    return [system + [rng.randrange(4096) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


@pytest.mark.parametrize("mode", ["overlap", "proc-ahead"])
def test_scheduler_sends_every_request(mode, decode, router):
    args = ServerArgs(
        forward_mode=mode,
        page_size=PAGE,
        chunked_prefill_size=32,
        max_total_tokens=2048,
        disaggregation_transfer_backend="shm",
        decode_address=decode.address,
        worker_threads=1,
    )
    worker, config = make_worker(args, MODES[mode])
    # As the server does: an early send may name pages a forward in flight still writes.
    transfer = make_transfer("shm", worker.kv_cache, PAGE, decode.address, fence=worker.kv_fence)
    try:
        s = Scheduler(args, config, worker, transfer)
        index = ["overlap", "proc-ahead"].index(mode)
        prompts, base = workload(seed=index), 10_000 + 100 * index
        reqs = [Req(f"{mode}-{i}", p, bootstrap_room=base + i) for i, p in enumerate(prompts)]
        for r in reqs:
            router.register(r.rid, r.bootstrap_room, r.origin_input_ids)
            s.add_request(r)
        LOOPS[mode](s, lambda: not s.reqs.live and s.forwards_in_flight == 0)
        replies = router.recv_many(len(reqs))
    finally:
        transfer.close()
        worker.close()
    assert all(r.status == ReqStatus.DONE for r in reqs), [(r.rid, r.error) for r in reqs]
    assert sum(r.cached_tokens for r in reqs) > 0  # early sends of cached prefixes happened
    for r in reqs:
        reply = replies[r.rid]
        assert reply["status"] == "done" and reply["first_token"] == r.first_token, reply
        assert reply["verified"] is True and reply["max_abs_err"] < 1e-4, reply
        assert r.sender.pages_sent == cdiv(r.prompt_len, PAGE)

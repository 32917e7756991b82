"""The front's link to the scheduler, against a ROUTER in this process: replies reach their
request whatever their order, a cancelled or timed-out request is aborted there, and a
client that disconnects cancels its work."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
import zmq.asyncio

from mpprefill import protocol
from mpprefill.bench.procs import free_port
from mpprefill.http.link import FrameTooLarge, NoReply, RidInFlight, SchedulerLink

pytestmark = pytest.mark.timeout(60)


def _run(test) -> None:
    """test(link, router) in a fresh event loop, sockets closed after."""

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = free_port()
        router.bind(f"tcp://127.0.0.1:{port}")
        link = SchedulerLink(f"127.0.0.1:{port}")
        link.start()
        try:
            await asyncio.wait_for(test(link, router), 30)
        finally:
            await link.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())


async def _recv(router) -> tuple[bytes, dict]:
    ident, frame = await router.recv_multipart()
    return ident, json.loads(frame)


def _done(rid: str, token: int) -> bytes:
    return protocol.done_reply(rid, token, 3, 0)


def test_replies_reach_their_requests_in_any_order():
    async def test(link, router):
        tasks = [
            asyncio.ensure_future(link.generate(f"r{i}", [1, 2, 3], {}, None, 10)) for i in range(3)
        ]
        got = [await _recv(router) for _ in range(3)]
        assert sorted(m["rid"] for _, m in got) == ["r0", "r1", "r2"]
        ident = got[0][0]
        for i in (2, 0, 1):
            await router.send_multipart([ident, _done(f"r{i}", 100 + i)])
        replies = await asyncio.gather(*tasks)
        assert [r["first_token"] for r in replies] == [100, 101, 102]
        assert not link.rids()

    _run(test)


def test_rids_are_the_generates_in_flight_whatever_their_names():
    async def test(link, router):
        gen = asyncio.ensure_future(link.generate("stats-mine", [1], {}, None, 10))
        ident, _ = await _recv(router)
        flush = asyncio.ensure_future(link.control("flush_cache", 10))
        _, frame = await _recv(router)
        assert link.rids() == ["stats-mine"]  # the control request is not one to abort
        ok = json.dumps({"rid": frame["rid"], "status": "ok"}).encode()
        await router.send_multipart([ident, ok])
        await router.send_multipart([ident, _done("stats-mine", 5)])
        assert (await flush)["status"] == "ok"
        assert (await gen)["first_token"] == 5
        assert link.rids() == []

    _run(test)


def test_a_rid_in_flight_is_refused_and_unknown_rid_replies_dropped():
    async def test(link, router):
        first = asyncio.ensure_future(link.generate("dup", [1], {}, None, 10))
        ident, _ = await _recv(router)
        with pytest.raises(RidInFlight):
            await link.generate("dup", [1], {}, None, 10)
        # the answer to a late abort must not end the request of that rid
        await router.send_multipart([ident, protocol.error_reply("dup", "unknown rid")])
        await router.send_multipart([ident, _done("dup", 7)])
        assert (await first)["first_token"] == 7

    _run(test)


def test_cancelled_and_timed_out_requests_are_aborted():
    async def test(link, router):
        task = asyncio.ensure_future(link.generate("c1", [1], {}, None, 10))
        await _recv(router)
        task.cancel()
        _, abort = await _recv(router)
        assert abort == {"type": "abort", "rid": "c1"}
        with pytest.raises(NoReply):
            await link.generate("t1", [1], {}, None, 0.2)
        assert (await _recv(router))[1]["type"] == "generate"
        assert (await _recv(router))[1] == {"type": "abort", "rid": "t1"}
        assert not link.in_flight("c1") and not link.in_flight("t1")

    _run(test)


def test_a_frame_over_the_protocols_limit_is_never_sent():
    async def test(link, router):
        with pytest.raises(FrameTooLarge):
            await link.generate("huge", [1000] * (protocol.MAX_FRAME_BYTES // 4), {}, None, 10)
        assert not link.in_flight("huge")
        small = asyncio.ensure_future(link.generate("small", [1], {}, None, 10))
        ident, first = await _recv(router)
        assert first["rid"] == "small"  # the first frame the scheduler sees
        await router.send_multipart([ident, _done("small", 3)])
        assert (await small)["first_token"] == 3

    _run(test)


def test_a_disconnected_client_cancels_its_work():
    pytest.importorskip("fastapi")
    from mpprefill.http.app import ClientGone, until_disconnect

    class GoneRequest:
        async def receive(self):
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    async def main():
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(ClientGone):
            await until_disconnect(GoneRequest(), work())
        assert cancelled.is_set()

    asyncio.run(asyncio.wait_for(main(), 10))

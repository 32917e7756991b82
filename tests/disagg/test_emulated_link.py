"""The emulated transfer link: its arithmetic, and completions held until the link would have
delivered them, on a clock the test sets (no wall time is asserted)."""

from __future__ import annotations

import math

import pytest
import torch
import zmq

from mpprefill.config import ServerArgs
from mpprefill.devices import Device, Emulation
from mpprefill.disagg import wire
from mpprefill.disagg.decode_links import DecodeLinks
from mpprefill.disagg.emulated_link import EmulatedLink
from mpprefill.disagg.live_rooms import LiveRooms
from mpprefill.disagg.page_writes import PageWrites
from mpprefill.disagg.rank_pools import ShippedKV
from mpprefill.disagg.transfer_deadlines import TransferDeadlines
from mpprefill.disagg.transfer_link import TransferLink, pool_bytes_per_token
from mpprefill.disagg.transfer_sender import CommandQueue, TransferSender
from mpprefill.emulation.setup import transfer_link_for
from mpprefill.layer_configs import LinkConfig
from mpprefill.memory.kv_cache import KVCache

PAGE = 4
MB = 1_000_000


def test_one_message_takes_its_bytes_over_the_bandwidth_plus_the_latency():
    link = EmulatedLink(gbps=8.0, latency_us=5.0)  # 1 GB/s: 1 MB in 1 ms
    assert link.carry(MB, now=10.0) == pytest.approx(10.0 + 1e-3 + 5e-6)
    assert link.free_at == pytest.approx(10.001)


def test_messages_queue_behind_each_others_bytes_but_not_their_latency():
    link = EmulatedLink(gbps=8.0, latency_us=100.0)
    first = link.carry(MB, now=0.0)
    second = link.carry(MB, now=0.0)  # waits for the wire, not for first's latency
    third = link.carry(0, now=0.0)  # an empty message still pays the latency
    assert first == pytest.approx(1e-3 + 1e-4)
    assert second == pytest.approx(2e-3 + 1e-4)
    assert third == pytest.approx(2e-3 + 1e-4)
    assert link.bytes_carried == 2 * MB


def test_a_message_on_an_idle_link_starts_when_it_is_handed():
    link = EmulatedLink(gbps=100.0, latency_us=5.0)
    link.carry(MB, now=0.0)  # on the wire until 80 us
    later = link.carry(MB, now=1.0)
    assert later == pytest.approx(1.0 + 8e6 / 100e9 + 5e-6)


@pytest.mark.parametrize("gbps, latency", [(0.0, 5.0), (-1.0, 5.0), (math.inf, 5.0), (1.0, -1.0)])
def test_a_bad_link_is_refused(gbps, latency):
    with pytest.raises(ValueError):
        EmulatedLink(gbps, latency)
    with pytest.raises(ValueError, match="--emulate-link"):
        LinkConfig(gbps, latency)


def test_serve_flags_make_the_link_and_refuse_a_bad_one():
    assert ServerArgs().link_config() is None
    args = ServerArgs(emulate_link_gbps=100.0, emulate_link_latency_us=2.0)
    assert args.link_config() == LinkConfig(100.0, 2.0)
    assert ServerArgs(emulate_link_gbps=25.0).link_config().latency_us == 5.0
    with pytest.raises(ValueError, match="--emulate-link-gbps"):
        ServerArgs(emulate_link_gbps=0.0)


def test_the_emulated_device_puts_its_models_kv_on_the_wire():
    link = LinkConfig(100.0, 5.0)
    assert transfer_link_for(link, Device("cpu")) is link
    assert transfer_link_for(None, Device("cpu", Emulation("Llama-3.1-8B", "h200"))) is None
    on_h200 = transfer_link_for(link, Device("cpu", Emulation("Llama-3.1-8B", "h200")))
    # K and V of 8 KV heads of 128 in bfloat16 per token and layer
    assert on_h200.kv_bytes_per_token == 2 * 8 * 128 * 2
    tp2 = transfer_link_for(link, Device("cpu", Emulation("Llama-3.1-8B", "h200", tp_size=2)))
    assert tp2.kv_bytes_per_token == 2 * 4 * 128 * 2  # one rank's heads, its own NIC


class Decode:
    """A ROUTER where the link to the decode connects, and what arrived on it."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.address = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self) -> wire.Message:
        assert self.sock.poll(5000), "nothing arrived"
        return wire.decode(self.sock.recv_multipart()[1])

    def quiet(self) -> bool:
        return not self.sock.poll(100)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def thread_parts():
    """(decode, rooms, pages, sender(room), clock): the transfer thread's real rooms on a
    link to a ROUTER, a pool of 2 layers x 2 heads x 8 float32, a clock the test moves."""
    ctx = zmq.Context()
    decode = Decode(ctx)
    pages = PageWrites(ShippedKV.of(KVCache(2, 64, 2, 8)), PAGE)
    deadlines = TransferDeadlines(transfer_timeout=60.0, dead_timeout=60.0, heartbeat_interval=30)
    links = DecodeLinks(ctx, zmq.Poller(), deadlines, decode.address)
    rooms = LiveRooms(links, None, deadlines, pages)
    commands = CommandQueue()

    def sender(room: int) -> TransferSender:
        s = TransferSender(f"r{room}", room, commands, pages.limits(10.0, 60.0))
        rooms.start(s)
        rooms.tick(0.0)
        assert isinstance(decode.recv(), wire.Bootstrap)
        s.ready(None, torch.arange(4), 0, 0, "run-1")
        s.init(4)
        return s

    yield decode, rooms, pages, sender, Clock()
    links.close()
    commands.close()
    decode.sock.close(linger=0)
    ctx.term()


def done_of(s: TransferSender) -> wire.TransferDone:
    return wire.TransferDone(s.room, 3, 4, "run-1")


def test_without_a_link_a_completion_goes_out_at_once(thread_parts):
    decode, rooms, pages, sender, clock = thread_parts
    out = TransferLink(rooms, None, pages.layout, clock)
    s = sender(7)
    assert out.handed(torch.arange(4), pages.planes[0][0]) is None
    out.done(s, done_of(s))
    assert decode.recv() == done_of(s) and out.held == 0
    assert out.poll_ms(20, clock.now) == 20


def test_a_completion_is_held_until_the_last_byte_is_delivered(thread_parts):
    decode, rooms, pages, sender, clock = thread_parts
    out = TransferLink(rooms, LinkConfig(gbps=0.01, latency_us=5.0), pages.layout, clock)
    planes = pages.planes[0][0]
    s = sender(7)
    # 4 pages x 4 planes (K, V of 2 layers) x 4 tokens x 2 heads x 8 float32 = 4 KiB
    assert out.write_bytes(4, planes) == 4 * 4 * PAGE * 2 * 8 * 4 == 4096
    last_byte = out.handed(torch.arange(4), planes)
    assert last_byte == pytest.approx(100.0 + 4096 * 8 / 0.01e9 + 5e-6)  # 3.28 ms
    msg = done_of(s)
    out.done(s, msg)
    due = last_byte + len(wire.encode(msg)) * 8 / 0.01e9
    assert out.held == 1
    assert out.poll_ms(20, clock.now) == math.ceil((due - clock.now) * 1e3)
    out.release(last_byte)  # the pages are in, the completion still on the wire
    assert decode.quiet() and out.held == 1
    out.release(due)
    assert decode.recv() == msg and out.held == 0
    assert out.poll_ms(20, due) == 20


def test_completions_leave_in_order_and_a_failed_senders_is_dropped(thread_parts):
    decode, rooms, pages, sender, clock = thread_parts
    out = TransferLink(rooms, LinkConfig(gbps=1.0, latency_us=50.0), pages.layout, clock)
    planes = pages.planes[0][0]
    first, failed, last = sender(7), sender(8), sender(9)
    for s in (first, failed, last):
        out.handed(torch.arange(4), planes)
        out.done(s, done_of(s))
    rooms.fail(failed, "client gone")  # its abort goes out at once, its completion never
    assert decode.recv() == wire.Abort(8)
    assert out.poll_ms(200, clock.now) == 1  # 3 x 4 KiB at 1 Gb/s + 50 us, rounded up
    out.release(clock.now + 1.0)
    assert [decode.recv(), decode.recv()] == [done_of(first), done_of(last)]
    assert decode.quiet() and out.held == 0


def test_the_emulated_models_bytes_set_the_link_time(thread_parts):
    _, rooms, pages, _, clock = thread_parts
    wide = LinkConfig(gbps=100.0, latency_us=0.0, kv_bytes_per_token=4096)  # Llama-3.1-8B
    out = TransferLink(rooms, wide, pages.layout, clock)
    assert pool_bytes_per_token(pages.layout) == 2 * 2 * 8 * 4
    # 4 pages of 4 tokens, 2 layers, 4096 bytes a token and layer
    assert out.write_bytes(4, pages.planes[0][0]) == 4 * PAGE * 2 * 4096
    assert out.handed(torch.arange(4), pages.planes[0][0]) == pytest.approx(
        100.0 + 4 * PAGE * 2 * 4096 * 8 / 100e9
    )

"""The host tier's copy thread: page-wise moves equal slot-wise ones, and on the emulated
accelerator each copy lasts the real model's KV over the GPU's host link."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mpprefill.emulation.device import EmulatedHostLink
from mpprefill.emulation.roofline import GPUS, DeviceClock, host_copy_time_s
from mpprefill.emulation.shapes import resolve_shape
from mpprefill.memory.host.copier import HostCopier, SlotCopy, gather, scatter, whole_pages
from mpprefill.memory.host.writeback import WritebackBuffers

PS = 4
LAYERS, HEADS, DIM = 3, 2, 5


def pool(num_slots: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, num_slots, HEADS, DIM, generator=gen)


def page_slots(pages: list[int]) -> torch.Tensor:
    return (torch.tensor(pages)[:, None] * PS + torch.arange(PS)).reshape(-1)


def test_whole_pages_are_recognised_and_anything_else_is_not():
    assert torch.equal(whole_pages(page_slots([5, 0, 3]), PS), torch.tensor([5, 0, 3]))
    assert whole_pages(page_slots([5, 0])[:-1], PS) is None  # a page cut short
    assert whole_pages(page_slots([5, 0]) + 1, PS) is None  # not page-aligned
    swapped = page_slots([2])[[1, 0, 2, 3]]
    assert whole_pages(swapped, PS) is None  # a page's slots out of order
    assert whole_pages(page_slots([2]), 1) is None  # page size 1: slots are the pages


@pytest.mark.parametrize("aligned", [True, False])
def test_gather_and_scatter_move_what_slot_indexing_moves(aligned):
    src, dst = pool(64, seed=1), pool(64, seed=2)
    src_slots = page_slots([7, 2, 11]) if aligned else torch.tensor([3, 9, 40, 41, 17])
    dst_slots = page_slots([0, 15, 4]) if aligned else torch.tensor([1, 2, 60, 33, 5])
    want = dst.clone()
    want[:, :, dst_slots] = src[:, :, src_slots]
    out = torch.empty(2, LAYERS, len(src_slots), HEADS, DIM)
    gather(src, src_slots, out, PS)
    assert torch.equal(out, src[:, :, src_slots])
    scatter(dst, dst_slots, out, PS)
    assert torch.equal(dst, want)


class CountingLink:
    def __init__(self):
        self.calls: list[tuple[int, int, bool]] = []

    def start(self, num_tokens: int, num_layers: int, to_device: bool):
        self.calls.append((num_tokens, num_layers, to_device))
        return lambda: None


def test_each_copy_with_slots_charges_the_link_its_tokens_and_layers():
    link = CountingLink()
    copier = HostCopier(torch.device("cpu"), link)
    buffers = WritebackBuffers(LAYERS, HEADS, DIM, torch.float32)
    src, dst = pool(64), torch.zeros(2, LAYERS, 64, HEADS, DIM)
    slots = page_slots([1, 3])
    empty = torch.empty(0, dtype=torch.int64)
    copies = [
        SlotCopy(src, slots, dst, slots, buffers, PS),
        SlotCopy(src, empty, dst, empty, buffers, PS),  # nothing to move: no charge
    ]
    copier.write(copies).result(timeout=10)
    copier.load(copies[:1]).result(timeout=10)
    copier.close()
    assert link.calls == [(2 * PS, LAYERS, False), (2 * PS, LAYERS, True)]
    assert torch.equal(dst[:, :, slots], src[:, :, slots])


class WriteGate:
    """A link whose device-to-host copies wait for `open` (10 s at most)."""

    def __init__(self):
        self.open = threading.Event()

    def start(self, num_tokens: int, num_layers: int, to_device: bool):
        return (lambda: None) if to_device else (lambda: self.open.wait(10))


def test_a_write_back_waits_for_the_loads_before_it_and_a_load_never_for_a_write():
    link = WriteGate()
    copier = HostCopier(torch.device("cpu"), link)
    host, device = pool(64, seed=3), pool(64, seed=4)
    slots = page_slots([2])

    def load(before=None):
        buffers = WritebackBuffers(LAYERS, HEADS, DIM, torch.float32)
        return copier.load([SlotCopy(host, slots, device, slots, buffers, PS)], before)

    def write():
        buffers = WritebackBuffers(LAYERS, HEADS, DIM, torch.float32)
        return copier.write([SlotCopy(device, page_slots([5]), host, slots, buffers, PS)])

    link.open.set()
    gate = threading.Event()
    first = load(gate.wait)
    later = write()  # rewrites the host page that load reads
    time.sleep(0.1)
    assert not first.done() and not later.done()  # the write-back waits for the load
    want = host[:, :, slots].clone()
    gate.set()
    later.result(timeout=10)
    assert torch.equal(device[:, :, slots], want)  # the load read the page before
    link.open.clear()
    stuck = write()  # the write lane is held by its link
    load().result(timeout=5)  # a load does not queue behind it
    assert not stuck.done()
    link.open.set()
    stuck.result(timeout=10)
    copier.close()


def test_the_emulated_link_charges_the_real_models_kv_over_pcie():
    now = [100.0]

    def clock() -> DeviceClock:
        return DeviceClock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))

    shape = resolve_shape("Llama-3.1-8B")
    link = EmulatedHostLink(shape, "h200", make_clock=clock)
    done = link.start(880, 32, to_device=True)
    want = host_copy_time_s(shape, GPUS["h200"], 880, 32)
    # 880 tokens x 32 layers x 4 KiB of K and V at 80% of 64 GB/s: about 2.3 ms
    assert want == pytest.approx(880 * 32 * 4096 / 51.2e9, rel=0.02)
    now[0] += want / 2  # the tiny copy takes half the link's time: it runs beside it
    done()
    assert now[0] == pytest.approx(100.0 + want) and link.busy_s == pytest.approx(want)
    link.start(880, 32, to_device=True)()  # back to back on the same direction's clock
    assert now[0] == pytest.approx(100.0 + 2 * want)
    done = link.start(880, 32, to_device=True)
    now[0] += 2 * want  # a tiny copy slower than the link: the link adds nothing
    before = now[0]
    done()
    assert now[0] == before
    assert link.clocks[False].busy_until == float("-inf")  # the other direction is idle


def test_host_copy_time_scales_with_bytes_and_splits_over_tensor_parallel_ranks():
    shape, gpu = resolve_shape("Llama-3.1-8B"), GPUS["h200"]
    one = host_copy_time_s(shape, gpu, 4096, 32)
    floor = host_copy_time_s(shape, gpu, 1, 1) - shape.kv_bytes_per_token / gpu.host_link_rate
    assert host_copy_time_s(shape, gpu, 8192, 32) - floor == pytest.approx(2 * (one - floor))
    # 8 KV heads over 8 ranks: each rank moves its one head over its own link
    assert host_copy_time_s(shape, gpu, 4096, 32, tp=8) - floor == pytest.approx((one - floor) / 8)
    assert host_copy_time_s(shape, gpu, 0, 32) == 0.0
    with pytest.raises(ValueError):
        host_copy_time_s(shape, gpu, -1, 32)

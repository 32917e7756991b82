"""Helpers of the sliding-window (SWA) disagg tests: a model, a filled prefill pool, checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpprefill.decode.verify import reference_kv
from mpprefill.disagg.plane_map import window_first_page
from mpprefill.memory.allocator import cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from mpprefill.model import ForwardBatch, load_model
from mpprefill.scheduling.kv_pools import add_swa_slots
from tests.disagg.helpers import PAGE, Prompt

WINDOW = 32
PATTERN = "sf"  # layers 0, 2 slide: pool order differs from model order
SWA_FLAGS = ("--sliding-window", str(WINDOW), "--swa-layers", PATTERN)
SWA_LENS = (150, 100, 40, 7)


def swa_model():
    return load_model(None, sliding_window=WINDOW, swa_layers=PATTERN)


@dataclass
class SwaPrompt(Prompt):
    swa_pages: torch.Tensor  # SWA-pool page of each page, prompt order

    @property
    def window_start(self) -> int:
        """Its first page (prompt order) whose SWA KV is sent."""
        return window_first_page(len(self.ids), WINDOW, PAGE)

    @property
    def window(self) -> torch.Tensor:
        return self.swa_pages[self.window_start :]


def filled_swa_pool(lens=SWA_LENS, num_pages: int = 64, seed: int = 1):
    """(KVCache, prompts): the SWA model's KV over prompts on scattered pages of both pools."""
    model = swa_model()
    kv = KVCache.for_model(model.config, num_pages * PAGE, num_swa_slots=num_pages * PAGE)
    alloc = SwaPagedAllocator(num_pages, PAGE, num_pages)
    alloc.alloc_pages(3)  # pages 0-2 stay unused, so page ids != prompt order
    alloc.swa.alloc_pages(5)  # and SWA page ids != full page ids
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lens:
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
        pages = alloc.alloc_pages(cdiv(n, PAGE)).flip(0)
        slots = alloc.slots_of(pages)[:n]
        fb = ForwardBatch.build([ids], [0], [slots.tolist()])
        add_swa_slots(alloc, fb)
        first = int(model(fb, kv)[0].argmax())
        prompts.append(SwaPrompt(ids, pages, first, alloc.swa_page_of[pages].clone()))
    return kv, prompts


def send_swa_chunks(sender, p: SwaPrompt, window: torch.Tensor | None = None) -> None:
    """Full pages one at a time, then the tail page with the window's SWA pages."""
    for i in range(p.num_pages - 1):
        sender.send(p.pages[i : i + 1], last=False)
    state = p.window if window is None else window
    sender.send(p.pages[-1:], last=True, first_token=p.first_token, state_indices=state)


def assert_window_kv(model, ids: list[int], received: torch.Tensor, prefix_len: int = 0):
    """Full layers equal the dense reference everywhere past the prefix, SWA layers in the
    last window; SWA positions before the pages sent are still NaN (never written)."""
    want, n = reference_kv(model, ids, PAGE), len(ids)
    swa = list(KVCache.swa_layers_of(model.config))
    full = [i for i in range(model.config.num_hidden_layers) if i not in swa]
    assert swa  # full may be empty: every layer slides
    got = received[:, :, prefix_len:]
    torch.testing.assert_close(got[:, full], want[:, full, prefix_len:], rtol=1e-4, atol=1e-4)
    start = max(prefix_len, n - WINDOW + 1)
    torch.testing.assert_close(received[:, swa, start:], want[:, swa, start:])
    lo = max(prefix_len, window_first_page(n, WINDOW, PAGE) * PAGE)
    assert received[:, swa, prefix_len:lo].isnan().all()
    return lo - prefix_len  # SWA positions never sent

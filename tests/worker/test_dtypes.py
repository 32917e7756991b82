"""The KV pool in its own dtype: the forward process's shared segment, the scheduler's view
of it, and the emulated device's pool and roofline."""

from __future__ import annotations

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.emulation.roofline import GPUS, host_copy_time_s
from mpprefill.emulation.setup import emulated_shape
from mpprefill.emulation.shapes import PRESETS
from mpprefill.engine import PrefillEngine

pytestmark = pytest.mark.timeout(180)
PROMPTS = [[(7 * i) % 4000 + 1 for i in range(n)] for n in (5, 40, 77)]


def segment_bytes(kv: torch.Tensor) -> int:
    """Bytes of the shared segment behind the scheduler's view of a pool."""
    assert kv.untyped_storage().nbytes() == kv.numel() * kv.element_size()
    return kv.numel() * kv.element_size()


def test_the_shared_kv_segment_in_bfloat16_is_half_of_float32():
    sizes, firsts = {}, {}
    for dtype in ("float32", "bfloat16"):
        kw = dict(forward_mode="proc", max_total_tokens=2048, worker_threads=1)
        with PrefillEngine(dtype=dtype, **kw) as eng:
            kv = eng.worker.kv_cache  # opened in the scheduler process, dtype checked
            assert kv.dtype == getattr(torch, dtype) and eng.model_config.dtype == dtype
            sizes[dtype] = (tuple(kv.storage.shape), segment_bytes(kv.storage))
            firsts[dtype] = [o.first_token for o in eng.prefill(PROMPTS)]
    assert sizes["float32"][0] == sizes["bfloat16"][0]  # same slots at --max-total-tokens
    assert sizes["bfloat16"][1] * 2 == sizes["float32"][1]
    assert all(0 <= t < 4096 for t in firsts["bfloat16"])


def test_the_pool_may_differ_from_the_model():
    kw = dict(forward_mode="proc", max_total_tokens=1024, worker_threads=1)
    with PrefillEngine(kv_cache_dtype="bfloat16", **kw) as eng:
        assert eng.model_config.dtype == "float32"
        assert eng.worker.kv_cache.dtype == torch.bfloat16
        outs = eng.prefill(PROMPTS, return_logits=True)
    with PrefillEngine(forward_mode="normal", max_total_tokens=1024) as eng:
        ref = eng.prefill(PROMPTS, return_logits=True)
    for o, r in zip(outs, ref, strict=True):
        assert o.logits.dtype == torch.float32
        # float32 math over keys and values rounded to bfloat16: close, not equal
        torch.testing.assert_close(o.logits, r.logits, atol=2e-2, rtol=0)


def test_tensor_parallel_ranks_hold_their_shards_in_the_kv_dtype():
    """Each rank's segment, opened by the scheduler (the transfer reads every one), is of
    the pool's dtype; the group's logits are the single rank's up to bfloat16 rounding."""
    kw = dict(dtype="bfloat16", max_total_tokens=1024, worker_threads=1)
    with PrefillEngine(forward_mode="proc", tp_size=2, **kw) as eng:
        shards = eng.worker.kv_shards()
        assert [kv.dtype for kv, _ in shards] == [torch.bfloat16] * 2
        assert [heads for _, heads in shards] == [range(0, 1), range(1, 2)]
        outs = eng.prefill(PROMPTS, return_logits=True)
    with PrefillEngine(forward_mode="normal", **kw) as eng:
        ref = eng.prefill(PROMPTS, return_logits=True)
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o.logits, r.logits, atol=5e-2, rtol=0)


def test_the_emulated_roofline_charges_kv_bytes_at_the_pools_itemsize():
    def bytes_of(**kw) -> tuple[int, int]:
        shape = emulated_shape(ServerArgs(device="emulated", **kw).worker_device.emulation)
        return shape.dtype_bytes, shape.kv_dtype_bytes

    assert bytes_of() == (2, 2)  # auto: the emulated model's own bfloat16
    assert bytes_of(kv_cache_dtype="float32") == (2, 4)
    assert bytes_of(dtype="float32") == (4, 4)
    assert bytes_of(dtype="float32", kv_cache_dtype="float16") == (4, 2)
    wide = emulated_shape(
        ServerArgs(device="emulated", kv_cache_dtype="float32").worker_device.emulation
    )
    narrow = PRESETS["Qwen2.5-0.5B"]
    assert wide.kv_bytes_per_token == 2 * narrow.kv_bytes_per_token
    h200 = GPUS["h200"]
    assert host_copy_time_s(wide, h200, 4096, 24) > 1.9 * host_copy_time_s(narrow, h200, 4096, 24)


@pytest.mark.parametrize("mode", ["overlap", "proc-ahead"])
def test_the_emulated_device_serves_its_pool_in_the_kv_dtype(mode):
    kw = dict(device="emulated", forward_mode=mode, max_total_tokens=4096, worker_threads=1)
    with PrefillEngine(kv_cache_dtype="bfloat16", **kw) as eng:
        assert eng.worker.kv_cache.dtype == torch.bfloat16
        assert len(eng.prefill(PROMPTS)) == len(PROMPTS)

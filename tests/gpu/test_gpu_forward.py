"""The forward on a GPU in bfloat16: no host-device synchronization inside it (torch's
sync debug mode set to "error"), both attention backends agreeing, and its host and device
times per forward printed for the record."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch, LlamaForCausalLM, ModelConfig
from mpprefill.model.attention import TorchNative, TorchVarlen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]
SLOTS = 1 << 15
SHAPE = dict(  # a Qwen2.5-0.5B-like layer, 8 layers
    vocab_size=32000,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=8,
    num_attention_heads=14,
    num_key_value_heads=2,
    attention_bias=True,
    max_position_embeddings=8192,
    dtype="bfloat16",
)


def model_and_pool(backend: str, **changes) -> tuple[LlamaForCausalLM, KVCache]:
    cfg = dataclasses.replace(ModelConfig(**SHAPE), **changes)
    model = LlamaForCausalLM(cfg, device="cuda")
    model.init_random_weights(seed=0)
    model.set_attention_backend(backend)
    return model, KVCache.for_model(cfg, SLOTS, "cuda", num_swa_slots=SLOTS)


def batch(num_reqs: int, extend: int, prefix: int) -> ForwardBatch:
    gen = torch.Generator().manual_seed(num_reqs)
    slots = torch.randperm(SLOTS, generator=gen)[: num_reqs * (prefix + extend)]
    ids = torch.randint(0, SHAPE["vocab_size"], (num_reqs, extend), generator=gen)
    fb = ForwardBatch.build(ids.tolist(), [prefix] * num_reqs, slots.view(num_reqs, -1).tolist())
    # the sliding-window layers' slots: the same as the full layers'
    fb.swa_out_cache_loc, fb.swa_kv_indices = fb.out_cache_loc, fb.kv_indices
    return fb.to("cuda")


def forward_without_sync(model, kv, fb) -> tuple[torch.Tensor, float, float]:
    """Logits, host seconds to issue the forward, device seconds to run it."""
    model(fb, kv)  # warm-up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        start.record()
        logits = model(fb, kv)
        end.record()
        host_s = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return logits, host_s, start.elapsed_time(end) / 1e3


@pytest.mark.parametrize("window", [None, 256], ids=["full", "sliding"])
@pytest.mark.parametrize("shape", [(64, 16, 512), (4, 256, 512), (8, 1024, 0)])
def test_bf16_forward_issues_without_a_sync_and_the_backends_agree(shape, window):
    changes = {}
    if window is not None:
        changes = dict(sliding_window=window, layer_types=("sliding_attention",) * 8)
    results = {}
    for backend in ("torch_varlen", "torch_native"):
        model, kv = model_and_pool(backend, **changes)
        fb = batch(*shape)
        results[backend] = forward_without_sync(model, kv, fb)
        _, host_s, device_s = results[backend]
        print(
            f"{backend} {shape} window={window}: host {host_s * 1e3:.2f} ms,"
            f" device {device_s * 1e3:.2f} ms"
        )
    varlen, native = results["torch_varlen"][0], results["torch_native"][0]
    torch.testing.assert_close(varlen, native, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("window", [None, 64], ids=["full", "sliding"])
def test_bf16_sinks_agree_between_the_backends_without_a_sync(window):
    """torch_varlen takes the sink correction from the kernel's log-sum-exp (read as
    [H, T]); torch_native computes its own. A wrong layout shows as a mismatch here."""
    fb = batch(6, 96, 200)
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    q = torch.randn(fb.num_tokens, heads, dim, device="cuda", generator=gen).bfloat16()
    k_pool = torch.randn(SLOTS, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    v_pool = torch.randn(SLOTS, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    sinks = 2.0 * torch.randn(heads, device="cuda", generator=gen)
    outs = []
    for backend in (TorchVarlen(), TorchNative()):
        plan = backend.plan(fb, fb.kv_indices, window)
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs.append(backend.attend(q, k_pool, v_pool, plan, sinks))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)

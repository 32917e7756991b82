"""Defaults for a GPU host: `--device auto` made concrete once, and the KV pool sized from
free device memory by `--mem-fraction-static` (a fake free-memory figure: no GPU here)."""

from __future__ import annotations

import pytest

from mpprefill.commands import size_kv_pool
from mpprefill.config import DEFAULT_MAX_TOTAL_TOKENS, ServerArgs, kv_pool_tokens, resolve_device
from mpprefill.decode.args import DecodeArgs
from mpprefill.worker.build import kv_bytes_per_token, worker_model_config

GiB = 2**30
# The built-in model (ModelConfig.tiny, float32), counted by hand:
#   KV per token: 2 (k, v) x 4 layers x 2 KV heads x 32 head dim x 4 bytes = 2,048
#   weights: embedding and head 2 x 4096 x 256; a layer's q, k, v, o 256 x (256 + 64 +
#   64) + 256 x 256, MLP 3 x 256 x 704, two norms 2 x 256; the final norm 256:
#   (2,097,152 + 4 x 705,024 + 256) parameters x 4 bytes = 19,670,016
TINY_KV_PER_TOKEN = 2048
TINY_WEIGHTS = 19_670_016


class FakeMemory:
    """`device_memory`'s stand-in: a fixed (free, total), the devices it was asked about."""

    def __init__(self, free: int, total: int):
        self.answer = (free, total)
        self.asked: list[list[str]] = []

    def __call__(self, devices):
        self.asked.append(list(devices))
        return self.answer


@pytest.mark.parametrize(
    "given, cuda, expected",
    [
        ("auto", True, "cuda"),
        ("auto", False, "cpu"),
        ("cpu", True, "cpu"),
        ("emulated", True, "emulated"),
        ("cuda:1", False, "cuda:1"),
    ],
)
def test_auto_is_cuda_where_torch_sees_one_else_cpu(given, cuda, expected):
    assert resolve_device(given, cuda_available=cuda) == expected


def test_server_args_resolve_auto_once_and_everything_sees_the_device():
    import torch

    from mpprefill.emulation.setup import clock_for, host_link_for

    here = "cuda" if torch.cuda.is_available() else "cpu"
    args = ServerArgs()
    dev = args.worker_device
    assert args.device == here and dev.label == here and dev.torch_device == here
    assert not dev.emulated and clock_for(dev) is None and host_link_for(dev) is None
    assert args.replace(page_size=32).device == here
    assert ServerArgs(device="emulated").device == "emulated"  # only when asked


def test_the_decode_resolves_auto_to_the_cpu_and_refuses_cuda():
    assert DecodeArgs().device == "cpu"
    with pytest.raises(ValueError, match="generates on the CPU"):
        DecodeArgs(device="cuda")


def test_off_cuda_the_pool_keeps_its_default_and_memory_is_not_asked():
    memory = FakeMemory(8 * GiB, 16 * GiB)
    for device in ("cpu", "emulated"):
        args = size_kv_pool(ServerArgs(device=device), memory)
        assert args.max_total_tokens == DEFAULT_MAX_TOTAL_TOKENS
    assert memory.asked == []


def test_a_given_max_total_tokens_wins_on_cuda():
    memory = FakeMemory(8 * GiB, 16 * GiB)
    args = size_kv_pool(ServerArgs(device="cuda", max_total_tokens=4096), memory)
    assert args.max_total_tokens == 4096 and memory.asked == []


def test_an_unsized_cuda_pool_is_refused_before_use():
    args = ServerArgs(device="cuda")
    assert args.max_total_tokens is None
    with pytest.raises(ValueError, match="not sized"):
        args.pool_config().num_pages  # noqa: B018


def test_the_arithmetic():
    # 0.5 of 1 GiB for weights and pool, 256 MiB held by others, 100 MiB of weights:
    # 512 - 256 - 100 = 156 MiB = 163,577,856 bytes, at 2,048 a token 79,872 tokens,
    # a multiple of the 16-token page already.
    tokens = kv_pool_tokens(768 * 2**20, GiB, 100 * 2**20, 2048, 0.5, 16)
    assert tokens == 79_872
    # 1,000 bytes a token: 163,577 whole tokens, 163,568 in whole pages of 16.
    assert kv_pool_tokens(768 * 2**20, GiB, 100 * 2**20, 1000, 0.5, 16) == 163_568


def test_too_little_memory_for_a_page_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match="mem-fraction-static"):
        kv_pool_tokens(GiB // 2, GiB, 10 * 2**20, 2048, 0.5, 16)  # nothing left
    with pytest.raises(ValueError, match="mem-fraction-static"):
        kv_pool_tokens(GiB, GiB, 0, 2048, 15 * 2048 / GiB, 16)  # 15 tokens: under a page


def test_the_pool_takes_what_the_fraction_leaves_of_free_memory():
    memory = FakeMemory(GiB, GiB)
    args = size_kv_pool(ServerArgs(device="cuda", mem_fraction_static=0.5), memory)
    assert memory.asked == [["cuda"]]
    # (2**29 - 19,670,016) // 2,048 = 252,539 tokens, 252,528 in whole pages of 16
    assert args.max_total_tokens == 252_528
    assert args.pool_config().num_pages == 252_528 // 16
    half = FakeMemory(GiB // 2 + 2**28, GiB)  # 256 MiB more held by others
    smaller = size_kv_pool(ServerArgs(device="cuda", mem_fraction_static=0.5), half)
    assert (
        smaller.max_total_tokens == (2**29 - 2**28 - TINY_WEIGHTS) // TINY_KV_PER_TOKEN // 16 * 16
    )


def test_bytes_per_token_follow_the_pool_dtype_the_swa_share_and_the_rank():
    args = ServerArgs(device="cuda")
    assert _per_token(args) == TINY_KV_PER_TOKEN
    half = ServerArgs(device="cuda", kv_cache_dtype="bfloat16")
    assert _per_token(half) == TINY_KV_PER_TOKEN // 2
    # layers 0 and 2 slide, their pool 0.8 of the full one: 512 bytes a layer-token x
    # (2 + 2 x 0.8) = 1843.2, rounded up
    swa = ServerArgs(device="cuda", sliding_window=64, swa_layers="0,2")
    assert _per_token(swa) == 1844


def test_a_tensor_parallel_group_asks_every_rank_and_counts_one_rank():
    memory = FakeMemory(GiB, GiB)
    args = ServerArgs(device="cuda", tp_size=2, forward_mode="proc", mem_fraction_static=0.5)
    sized = size_kv_pool(args, memory)
    assert memory.asked == [["cuda:0", "cuda:1"]]
    # a rank: one KV head (1,024 bytes a token); weights with the vocabulary, heads and MLP
    # halved: (2 x 2048 x 256 + 4 x 352,768 + 256) x 4 = 9,839,616 bytes
    assert sized.max_total_tokens == (2**29 - 9_839_616) // 1024 // 16 * 16


def test_the_flags_reach_the_sizing():
    from mpprefill.cli import build_parser
    from mpprefill.flags import from_namespace

    ns = build_parser().parse_args(["serve", "--device", "cuda", "--mem-fraction-static", "0.7"])
    args = from_namespace(ServerArgs, ns)
    assert (args.device, args.mem_fraction_static, args.max_total_tokens) == ("cuda", 0.7, None)
    with pytest.raises(ValueError, match="mem-fraction-static"):
        ServerArgs(mem_fraction_static=1.5)


def test_the_memory_probe_asks_a_child_process():
    import torch

    from mpprefill.worker.device import device_memory

    if torch.cuda.is_available():
        free, total = device_memory(["cuda:0"])
        assert 0 < free <= total
        assert not torch.cuda.is_initialized()  # the child made the context, not this one
    else:
        with pytest.raises(RuntimeError, match="free memory of cuda:0"):
            device_memory(["cuda:0"])


def test_the_offline_engine_keeps_its_pool_default():
    from mpprefill.engine import PrefillEngine

    with PrefillEngine(forward_mode="normal") as eng:
        assert eng.args.max_total_tokens == DEFAULT_MAX_TOTAL_TOKENS


def _per_token(args: ServerArgs) -> int:
    cfg = args.worker_config()
    return kv_bytes_per_token(cfg, worker_model_config(cfg))

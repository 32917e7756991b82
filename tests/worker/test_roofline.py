"""The emulated accelerator's roofline and virtual device queue, on hand-checked numbers."""

from __future__ import annotations

import json
import threading
import time

import pytest

from mpprefill.worker.roofline import (
    GEMM_EFFICIENCY,
    GPUS,
    KERNELS_PER_LAYER,
    MEMORY_EFFICIENCY,
    PRESETS,
    DeviceClock,
    GpuSpec,
    ModelShape,
    head_parts_s,
    layer_parts_s,
    resolve_shape,
)

LLAMA = PRESETS["Llama-3.1-8B"]
QWEN_SMALL = PRESETS["Qwen2.5-0.5B"]
H200 = GPUS["h200"]
QWEN_CONFIG = {
    "num_hidden_layers": 24,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
}


class FakeTime:
    def __init__(self, t: float = 100.0):
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.mark.parametrize(
    ("name", "dims"),
    [
        ("Qwen2.5-0.5B", (24, 896, 4864, 14, 2, 64, 151936)),
        ("Llama-3.1-8B", (32, 4096, 14336, 32, 8, 128, 128256)),
        ("Qwen2.5-14B", (48, 5120, 13824, 40, 8, 128, 152064)),
    ],
)
def test_preset_dims(name, dims):
    s = PRESETS[name]
    got = (s.num_layers, s.hidden, s.intermediate, s.num_heads, s.num_kv_heads, s.head_dim)
    assert (*got, s.vocab) == dims
    assert s.dtype_bytes == 2
    assert s.name == name


def test_llama_params_per_layer():
    # q 4096², k and v 4096·1024 each, o 4096², gate/up/down 3·4096·14336
    assert LLAMA.params_per_layer == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert LLAMA.kv_bytes_per_token == 2 * 8 * 128 * 2


def test_from_hf_config_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_CONFIG))
    by_file = ModelShape.from_hf_config(tmp_path / "config.json")
    by_dir = ModelShape.from_hf_config(str(tmp_path))
    assert by_file == by_dir
    assert by_file.head_dim == 64
    assert by_file.params_per_layer == QWEN_SMALL.params_per_layer


def test_from_hf_config_defaults_and_explicit_head_dim():
    mha = ModelShape.from_hf_config({k: v for k, v in QWEN_CONFIG.items() if "key_value" not in k})
    assert mha.num_kv_heads == 14
    explicit = ModelShape.from_hf_config({**QWEN_CONFIG, "head_dim": 128})
    assert explicit.head_dim == 128
    nested = ModelShape.from_hf_config({"text_config": QWEN_CONFIG})
    assert nested.num_layers == 24


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": None}, "lacks vocab_size"),
        ({"hidden_size": "896"}, "hidden_size must be a positive int"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive int"),
        ({"num_attention_heads": 13}, "not a multiple of 13 heads"),
        ({"num_key_value_heads": 3}, "not a multiple of kv heads"),
    ],
)
def test_from_hf_config_rejects_bad_fields(change, message):
    config = {k: v for k, v in {**QWEN_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelShape.from_hf_config(config)


def test_from_hf_config_rejects_bad_files(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        ModelShape.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        ModelShape.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="no model config"):
        ModelShape.from_hf_config(tmp_path / "missing")


def test_resolve_shape(tmp_path):
    assert resolve_shape("llama-3.1-8b") is LLAMA
    (tmp_path / "config.json").write_text(json.dumps(QWEN_CONFIG))
    assert resolve_shape(str(tmp_path)).hidden == 896
    assert resolve_shape(str(tmp_path / "config.json")).name == tmp_path.name
    with pytest.raises(ValueError, match="Qwen2.5-0.5B, Llama-3.1-8B, Qwen2.5-14B"):
        resolve_shape("gpt-5")
    with pytest.raises(ValueError, match="no model config"):
        resolve_shape(str(tmp_path.parent))


def test_bad_batches_and_gpus():
    with pytest.raises(ValueError, match="2 extend lengths but 1"):
        layer_parts_s(LLAMA, H200, [1, 2], [0])
    with pytest.raises(ValueError, match="empty"):
        layer_parts_s(LLAMA, H200, [], [])
    with pytest.raises(ValueError, match="positive"):
        layer_parts_s(LLAMA, H200, [0], [0])
    with pytest.raises(ValueError, match="num_reqs"):
        head_parts_s(LLAMA, H200, 0)
    with pytest.raises(ValueError, match="efficiencies"):
        GpuSpec("x", 1e12, 1e12, gemm_efficiency=1.5)


@pytest.mark.parametrize("shape", list(PRESETS.values()), ids=list(PRESETS))
def test_monotonic_in_tokens_and_prefix(shape):
    by_tokens = [sum(layer_parts_s(shape, H200, [e], [0])) for e in (1, 64, 512, 4096, 16384)]
    by_prefix = [sum(layer_parts_s(shape, H200, [512], [p])) for p in (0, 1024, 8192, 65536)]
    by_reqs = [sum(layer_parts_s(shape, H200, [512] * n, [2048] * n)) for n in (1, 2, 8, 32)]
    for times in (by_tokens, by_prefix, by_reqs):
        assert times == sorted(times)
        assert times[0] < times[-1]


def test_large_batch_is_compute_bound():
    tokens = 8192
    by_hand = 2 * LLAMA.params_per_layer * tokens / (989e12 * GEMM_EFFICIENCY)
    got = sum(layer_parts_s(LLAMA, H200, [1024] * 8, [0] * 8))
    assert by_hand <= got <= 1.2 * by_hand
    # Compute bound: the same peak FLOP/s gives the same time whatever the bandwidth.
    assert sum(layer_parts_s(LLAMA, GPUS["h100"], [1024] * 8, [0] * 8)) == pytest.approx(got)


def test_one_token_is_memory_or_floor_bound():
    weights_s = LLAMA.layer_weight_bytes / (4.8e12 * MEMORY_EFFICIENCY)
    assert sum(layer_parts_s(LLAMA, H200, [1], [0])) == pytest.approx(weights_s, rel=0.01)
    # The 0.5B layer's ~30 MB stream in under 10 µs: below ten kernels' floor.
    floor = KERNELS_PER_LAYER * H200.kernel_floor_s
    assert sum(layer_parts_s(QWEN_SMALL, H200, [1], [0])) == floor


def test_gpu_ordering():
    def by_gpu(extend_lens: list[int]) -> dict[str, float]:
        prefixes = [0] * len(extend_lens)
        return {
            name: sum(layer_parts_s(LLAMA, gpu, extend_lens, prefixes))
            for name, gpu in GPUS.items()
        }

    mem = by_gpu([1])
    comp = by_gpu([1024] * 8)
    assert mem["b200"] < mem["h200"] < mem["h100"]
    assert comp["b200"] < comp["h200"] == pytest.approx(comp["h100"])


def test_head():
    head = sum(head_parts_s(LLAMA, H200, 1))
    assert head == pytest.approx(128256 * 4096 * 2 / (4.8e12 * MEMORY_EFFICIENCY), rel=0.01)
    assert sum(head_parts_s(LLAMA, H200, 4096)) > head


def test_clock_queues_back_to_back():
    t = FakeTime()
    clock = DeviceClock(now=t.now, sleep=t.sleep)
    assert clock.issue(1.0) == 101.0
    t.t = 100.5
    assert clock.issue(2.0) == 103.0  # issued early: starts at the first's end
    t.t = 110.0
    assert clock.issue(0.5) == 110.5  # issued late: starts at issue time
    assert clock.busy_until == 110.5


def test_clock_wait_until_with_injected_and_real_time():
    t = FakeTime()
    clock = DeviceClock(now=t.now, sleep=t.sleep)
    clock.wait_until(clock.issue(0.25))
    assert t.t >= 100.25
    real = DeviceClock()
    end = real.issue(0.002)
    real.wait_until(end)
    assert time.monotonic() >= end
    with pytest.raises(ValueError, match="negative"):
        real.issue(-1.0)


def test_clock_is_thread_safe():
    t = FakeTime(0.0)
    clock = DeviceClock(now=t.now, sleep=t.sleep)

    def issue_many() -> None:
        for _ in range(500):
            clock.issue(1.0)

    threads = [threading.Thread(target=issue_many) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=10)
    # Every piece queued behind the one before: no two pieces share a start.
    assert clock.busy_until == 2000.0


# NOTE: the times these dense layers took before the roofline learnt experts; they must
# not move (float equality: the same arithmetic in the same order).
DENSE_PINS = [
    ("Llama-3.1-8B", 1, (0.0005591173736796186, 0.0), (0.0001628679641791045, 0.0)),
    ("Qwen2.5-0.5B", 2, (3e-05, 2.809386666666667e-05), (3e-05, 2.0009955555555558e-05)),
    ("Llama-3.1-70B", 1, (0.002103347892527517, 0.0), (0.0006387406328358209, 0.0)),
    (
        "Llama-3.1-70B",
        2,
        (0.0010516739462637585, 9.400106666666666e-05),
        (0.00031940088358208956, 2.0091022222222222e-05),
    ),
]


@pytest.mark.parametrize(("name", "tp", "batch", "one_windowed"), DENSE_PINS)
def test_dense_layer_times_are_pinned(name, tp, batch, one_windowed):
    shape = PRESETS[name]
    assert layer_parts_s(shape, H200, [512, 300, 1], [0, 4096, 9000], tp) == batch
    assert layer_parts_s(shape, GPUS["h100"], [1], [0], tp, 64) == one_windowed

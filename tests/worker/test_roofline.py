"""The emulated accelerator's roofline and virtual device queue, on hand-checked numbers."""

from __future__ import annotations

import json
import threading
import time

import pytest

from mpprefill.emulation.roofline import (
    GPUS,
    MEMORY_EFFICIENCY,
    PEAK_GEMM_EFFICIENCY,
    DeviceClock,
    GpuSpec,
    head_kernels,
    head_parts_s,
    layer_kernels,
    layer_parts_s,
)
from mpprefill.emulation.shapes import KERNELS_PER_HEAD, PRESETS, ModelShape, resolve_shape

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
        GpuSpec("x", 1e12, 1e12, peak_gemm_efficiency=1.5)


@pytest.mark.parametrize("shape", list(PRESETS.values()), ids=list(PRESETS))
def test_monotonic_in_tokens_and_prefix(shape):
    by_tokens = [sum(layer_parts_s(shape, H200, [e], [0])) for e in (1, 64, 512, 4096, 16384)]
    by_prefix = [sum(layer_parts_s(shape, H200, [512], [p])) for p in (0, 1024, 8192, 65536)]
    by_reqs = [sum(layer_parts_s(shape, H200, [512] * n, [2048] * n)) for n in (1, 2, 8, 32)]
    for times in (by_tokens, by_prefix, by_reqs):
        assert times == sorted(times)
        assert times[0] < times[-1]


def test_large_batch_is_compute_bound():
    """8192 tokens of Llama-3.1-8B: the GEMMs and attention are compute-bound; the GEMMs
    take their FLOPs at a little under the curve's peak (0.8, less the K ramp and
    quantization), and the compute-bound kernels take the same on an H100 as on an H200
    (the same peak FLOP/s), the streams longer."""
    extend, prefix = [1024] * 8, [0] * 8
    by_gpu = {g: layer_kernels(LLAMA, GPUS[g], extend, prefix) for g in ("h100", "h200")}
    gemms = [k for k in by_gpu["h200"] if k.name.endswith("proj")]
    assert {k.bound for k in gemms} == {"compute"}
    at_peak = 2 * LLAMA.params_per_layer * 8192 / (989e12 * PEAK_GEMM_EFFICIENCY)
    assert at_peak < sum(k.seconds for k in gemms) < 1.1 * at_peak
    for k100, k200 in zip(by_gpu["h100"], by_gpu["h200"], strict=True):
        if k200.bound == "compute":
            assert k100.seconds == pytest.approx(k200.seconds)
        else:
            assert k100.seconds > k200.seconds


def test_one_token_is_bound_by_weights_and_floors():
    """One token: each GEMM takes at least its weights' read, every other kernel a floor."""
    for shape in (LLAMA, QWEN_SMALL):
        kernels = layer_kernels(shape, H200, [1], [0])
        weights_s = shape.layer_weight_bytes / (4.8e12 * MEMORY_EFFICIENCY)
        gemms = [k for k in kernels if k.name.endswith("proj")]
        assert sum(k.seconds for k in gemms) > weights_s
        assert all(k.bound == "floor" for k in kernels if k not in gemms)


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
    assert comp["b200"] < comp["h200"] < comp["h100"] < 1.05 * comp["h200"]


def test_head():
    """One request: the LM head's weights stream (plus its float32 logits) and two floors
    for the gather and the norm; more requests cost more."""
    kernels = head_kernels(LLAMA, H200, 1)
    assert len(kernels) == KERNELS_PER_HEAD
    nbytes = 128256 * 4096 * 2 + 4096 * 2 + 128256 * 4
    want = nbytes / (4.8e12 * MEMORY_EFFICIENCY) + 2 * 3e-6
    head = sum(head_parts_s(LLAMA, H200, 1))
    assert head == pytest.approx(want)
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


# NOTE: the times these dense layers take kernel by kernel; they must not move unless the
# model does (float equality: the same arithmetic in the same order).
DENSE_PINS = [
    ("Llama-3.1-8B", 1, (0.0006278932373225479, 0.0), (0.00018086490746268657, 0.0)),
    (
        "Qwen2.5-0.5B",
        2,
        (5.0372846995811065e-05, 2.809386666666667e-05),
        (3.0285683582089553e-05, 2.0009955555555558e-05),
    ),
    ("Llama-3.1-70B", 1, (0.0021993909193771485, 0.0), (0.0006566382328358209, 0.0)),
    (
        "Llama-3.1-70B",
        2,
        (0.0011311650820141556, 9.400106666666666e-05),
        (0.0003373619104477612, 2.0091022222222222e-05),
    ),
]


@pytest.mark.parametrize(("name", "tp", "batch", "one_windowed"), DENSE_PINS)
def test_dense_layer_times_are_pinned(name, tp, batch, one_windowed):
    shape = PRESETS[name]
    assert layer_parts_s(shape, H200, [512, 300, 1], [0, 4096, 9000], tp) == batch
    assert layer_parts_s(shape, GPUS["h100"], [1], [0], tp, 64) == one_windowed

"""Device times for an emulated accelerator: a roofline of a real model on a named GPU,
kernel by kernel.

The host runs the model at tiny width; the device is a `DeviceClock` whose pieces of
work last what this roofline says the real model would take. A decoder layer of one
ragged prefill batch costs the sum of its kernels (`layer_kernels`), each charged on its
own as the slowest of its compute, its memory traffic and a launch floor:

    seconds = max(FLOPs / (peak · eff), bytes / (bandwidth · 0.8), 3 µs)

peak being the GPU's dense BF16 FLOP/s whatever the dtype. On one rank, with T = Σ e
new tokens, h hidden, q = heads·d and kv = kv_heads·d (d the head dim), I the MLP's
rows, b the bytes of a weight or activation, kv_row = 2·kv·b_kv the K and V of one
token (b_kv the KV pool's bytes per element), and GEMM(M, N, K) an M x K by K x N
product: 2·M·N·K FLOPs over (K·N + M·K + M·N)·b bytes (weights, input, output):

| kernel              | work                                      | FLOP rate        |
|---------------------|-------------------------------------------|------------------|
| input norm          | 4·T·h·b bytes                             |                  |
| qkv                 | GEMM(T, q + 2·kv, h)                      | peak·gemm(M,N,K) |
| rope                | 2·T·(q + kv)·b bytes                      |                  |
| KV write            | 2·T·kv·b + T·kv_row bytes                 |                  |
| attention           | 4·q·pairs FLOPs, 2·T·q·b + rows·kv_row B  | peak·0.5         |
| o_proj              | GEMM(T, h, q)                             | peak·gemm(M,N,K) |
| post-attention norm | 4·T·h·b bytes                             |                  |
| gate_up             | GEMM(T, 2·I, h)                           | peak·gemm(M,N,K) |
| act (SiLU · up)     | 3·T·I·b bytes                             |                  |
| down                | GEMM(T, h, I)                             | peak·gemm(M,N,K) |

The norms are fused with the residual add (read the residual and the hidden, write
both); the elementwise kernels' few FLOPs per byte are counted as none. Attention runs at
a flat half of peak (softmax, masking and tiling keep flash kernels further from it than
GEMMs; no shape curve for it).

A mixture-of-experts layer (E experts of I_e rows, each token routed to k of them:
R = T·k routed rows, n of the experts hit) replaces gate_up, act and down by:

| kernel                | work                                                 |
|-----------------------|------------------------------------------------------|
| router                | GEMM(T, E, h)                                        |
| top-k + softmax       | T·E·b + R·8 bytes (an int32 id, a float32 weight)    |
| sort rows by expert   | 2·R·4 bytes                                          |
| expert offsets        | E·4 bytes (the floor)                                |
| gather routed rows    | 2·R·h·b bytes                                        |
| grouped gate_up       | 2·R·2·I_e·h FLOPs, n·h·2·I_e·b + R·h·b + R·2·I_e·b B |
| act                   | 3·R·I_e·b bytes                                      |
| grouped down          | 2·R·h·I_e FLOPs, n·I_e·h·b + R·I_e·b + R·h·b B       |
| scale by route weight | 2·R·h·b + R·4 bytes                                  |
| sum back to tokens    | R·h·b + T·h·b bytes                                  |

A grouped GEMM is n GEMMs of R/n rows each launched together: its efficiency is the
curve's at M = R/n, their tiles sharing the waves. Only the experts the batch hits are
read, n of them in expectation:

    n = E·(1 - (1 - 1/E)^(T·k))

assuming each of the T·k routings picks one of the E experts uniformly and independently
of the others. Real routers are skewed, which hits fewer; a token's k experts are
distinct, which hits a little more (at T = 1, n < k). At prefill sizes (T·k >> E) n is E.

Shared experts (DeepSeek's: I_s rows every token of a sparse layer runs) add a dense MLP's
three kernels of I_s rows after the routed ones, and the sum back to the tokens reads
their T·h·b output too.

Multi-head latent attention (DeepSeek-V3: `kv_lora_rank` c, q's `q_lora_rank` r, the rope
key's width d_r = head_dim, per head an unrotated d_n, q and k of d_q = d_n + d_r and v of
d_v; a token's latent row of c + d_r elements, lat_row = (c + d_r)·b_kv bytes a layer,
whole on every rank) replaces the input norm to o_proj by these, on a rank's H heads, with
keys = Σ (p + e) the rows of every request's keys:

| kernel               | work                                                     |
|----------------------|----------------------------------------------------------|
| input norm           | 4·T·h·b bytes                                            |
| q and latent down    | GEMM(T, r + c + d_r, h), whole on every rank             |
| their norms          | 2·T·(r + c)·b bytes                                      |
| q up                 | GEMM(T, H·d_q, r)                                        |
| rope                 | 2·T·(H + 1)·d_r·b bytes (q's rotated dims and the key's) |
| latent write         | T·(c + d_r)·b + T·lat_row bytes                          |
| latent gather        | keys·lat_row + keys·(c + d_r)·b bytes                    |
| kv_b up              | GEMM(keys, H·(d_n + d_v), c)                             |
| K assembly           | keys·(H·d_n + d_r + H·d_q)·b bytes                       |
| attention            | 2·H·(d_q + d_v)·pairs FLOPs at peak·0.5,                 |
|                      | (T + keys)·H·(d_q + d_v)·b bytes                         |
| o_proj               | GEMM(T, h, H·d_v)                                        |

Prefill decompresses every key's row (`model/layers/mla.py` does the same), so a long
prefix costs kv_b's GEMM over its rows at every chunk; the KV pool holds lat_row bytes a
token and layer, not a K and V per head.

The head (`head_kernels`) runs on the R requests' last positions: a gather of them
(2·R·h·b bytes), the final norm (2·R·h·b) and the LM head, GEMM(R, vocab, h) whose logits
are written as float32 (R·vocab·4 bytes instead of R·vocab·b).

GEMM efficiency. After NVIDIA's Deep Learning Performance Guide, "Matrix Multiplication
Background" (tiled GEMMs; tile quantization and wave quantization; smaller tiles reach a
lower fraction of peak): the output is cut into tm x tn tiles, one per SM at a time, so

    tiles = ⌈M/tm⌉·⌈N/tn⌉,  waves = ⌈tiles / SMs⌉
    gemm(M, N, K) = 0.8 · max over tiles of [tile_eff · M·N / (waves·SMs·tm·tn)] · K / (K + 128)

with the tiles (128 x 256, 1.0), (128 x 128, 0.9) and (64 x 128, 0.7) (a heuristic
picks the best), 0.8 what large BF16 GEMMs reach of an H100's or H200's dense peak, and
K / (K + 128) the main loop's prologue and epilogue (pipeline fill and the output's
store, about two k-blocks of 64). The guide gives the mechanisms and the ranking of
tiles; these numbers are estimates of this model. One tile more than the SMs takes two
waves: about half the rate of exactly one.

Split-K. A GEMM whose tiles leave most SMs idle (few rows, or a narrow N) is cut along K
into s slices (s in 1, 2, 4, 8; each slice at least 256 deep), so s times the tiles share
the waves and each runs K/s of the main loop:

    waves_s = ⌈s·tiles / SMs⌉,  gemm_s = 0.8 · tile_eff · M·N·K / (waves_s·SMs·tm·tn·(K/s + 128))

(gemm_1 is the curve above), at the price of the slices' float32 partial sums, written
and read once more (2·s·M·N·4 bytes on top of the kernel's). The kernel takes the split
with the least time. Without it a one-row GEMM was charged a whole wave of tiles over its
K, well beyond its weights' read; cuBLAS and CUTLASS split K (or stream K) for these.

A request extends e tokens after a cached prefix of p; its j-th new token attends the
p + j + 1 positions up to itself, which sums to pairs = e·(p + (e + 1)/2) query-key
pairs, each 2·d FLOPs for QKᵀ and 2·d for PV per head; the attention reads the q rows,
rows = p + e rows of KV and writes its output. A sliding-window layer of window W
attends min(p + j + 1, W) positions and reads the KV from max(0, p - W + 1) on
(rows = min(p, W - 1) + e). A model whose shape names sliding layers (gpt-oss: window 128
on every even layer) is charged the windowed attention on those layers and the full one
elsewhere. gpt-oss's attention sinks add a learned logit per head to each softmax: a few
elementwise ops on the attention scores, no GEMM and no KV read, so they cost nothing
extra here.

Tensor parallel over N GPUs (`tp`): each rank runs the layer of `ModelShape.shard(N)` (its
heads, KV heads and MLP rows, every expert's 1/N of its I_e rows with the router whole, as
`model/layers/moe.py` shards them, 1/N of the shared experts' rows, a 1/N vocabulary slice of
the head; latent attention's down projections and latent rows whole), then the layer's two
all-reduces of the T x hidden activations (after o_proj and after the MLP) and the
head's all-gather of the logits cross the GPUs' interconnect. A ring all-reduce of B
bytes moves 2·(N-1)/N·B through each GPU's link, an all-gather (N-1)/N·B; each collective
also pays a fixed latency. The ranks run in lockstep, so one rank's time is the group's.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpprefill.emulation.shapes import ModelShape

# Large BF16 GEMMs reach about 75-80% of an H100's or H200's dense peak: the curve's top.
PEAK_GEMM_EFFICIENCY = 0.8
# Output tiles a GEMM heuristic picks among: rows, columns, and the fraction of the
# largest tile's per-SM rate the tile reaches (smaller tiles reuse less of each load).
GEMM_TILES = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.7))
# A GEMM's main-loop prologue and epilogue in units of K: pipeline fill and the output's
# store, about two k-blocks of 64.
K_RAMP = 128
# Split-K: the slice counts a GEMM may be cut into along K, each slice at least this deep.
SPLIT_K = (1, 2, 4, 8)
MIN_SPLIT_DEPTH = 256
# Partial sums of a split GEMM are float32.
PARTIAL_BYTES = 4
# Streaming multiprocessors of an H100 or H200 (SXM): one output tile each at a time.
HOPPER_SMS = 132
# Flash attention kernels run further from peak than GEMMs (softmax, masking, tiling).
ATTENTION_EFFICIENCY = 0.5
# Streaming kernels reach about 80% of the HBM spec bandwidth.
MEMORY_EFFICIENCY = 0.8
# Launch, ramp-up and tail of one kernel: a small kernel cannot finish faster.
KERNEL_FLOOR_S = 3e-6
# A fused residual add + RMSNorm reads the residual and the hidden and writes both.
NORM_PASSES = 4
LOGIT_BYTES = 4  # logits are float32 for sampling
INDEX_BYTES = 4  # an int32 expert id or row index
ROUTE_WEIGHT_BYTES = 4  # a float32 route weight
# NCCL's ring collectives reach about 80% of the NVLink per-direction bandwidth.
LINK_EFFICIENCY = 0.8
# Launch and synchronisation of one collective across the group (small-message floor).
COLLECTIVE_LATENCY_S = 10e-6
# All-reduces per layer: after o_proj and after down_proj.
ALLREDUCES_PER_LAYER = 2
# PCIe Gen5 x16, bytes/s per direction: the host link of an H100, H200 or B200 board.
HOST_LINK_BANDWIDTH = 64e9
# Pinned-memory copies over it reach about 50 GB/s.
HOST_LINK_EFFICIENCY = 0.8
# A host-tier copy is a gather or scatter kernel on the device and one DMA transfer.
KERNELS_PER_HOST_COPY = 2


# NOTE: no slots: a frozen slotted dataclass does not unpickle on Python 3.10 (spawn).
@dataclass(frozen=True)
class GpuSpec:
    name: str
    flops: float  # dense BF16 tensor FLOP/s
    bandwidth: float  # HBM bytes/s
    peak_gemm_efficiency: float = PEAK_GEMM_EFFICIENCY  # a large GEMM's fraction of flops
    attention_efficiency: float = ATTENTION_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    kernel_floor_s: float = KERNEL_FLOOR_S
    link_bandwidth: float = 450e9  # NVLink bytes/s per direction per GPU
    link_efficiency: float = LINK_EFFICIENCY
    collective_latency_s: float = COLLECTIVE_LATENCY_S
    host_link_bandwidth: float = HOST_LINK_BANDWIDTH  # host <-> GPU bytes/s per direction
    host_link_efficiency: float = HOST_LINK_EFFICIENCY
    num_sms: int = HOPPER_SMS  # streaming multiprocessors: GEMM tiles run one per SM

    def __post_init__(self):
        if self.flops <= 0 or self.bandwidth <= 0 or self.kernel_floor_s < 0:
            raise ValueError(f"{self.name}: FLOP/s, bandwidth must be positive; floor not negative")
        if self.link_bandwidth <= 0 or self.collective_latency_s < 0:
            raise ValueError(f"{self.name}: link bandwidth must be positive, latency not negative")
        if not 0 < self.link_efficiency <= 1:
            raise ValueError(f"{self.name}: link efficiency must lie in (0, 1]")
        if self.host_link_bandwidth <= 0 or not 0 < self.host_link_efficiency <= 1:
            raise ValueError(f"{self.name}: host link bandwidth positive, efficiency in (0, 1]")
        effs = (self.peak_gemm_efficiency, self.attention_efficiency, self.memory_efficiency)
        if not all(0 < e <= 1 for e in effs):
            raise ValueError(f"{self.name}: efficiencies must lie in (0, 1]")
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms < 1:
            raise ValueError(f"{self.name}: num_sms must be a positive int")

    @property
    def attention_flops(self) -> float:
        return self.flops * self.attention_efficiency

    @property
    def memory_bandwidth(self) -> float:
        return self.bandwidth * self.memory_efficiency

    @property
    def link_rate(self) -> float:
        """Bytes/s a collective achieves through one GPU's link."""
        return self.link_bandwidth * self.link_efficiency

    @property
    def host_link_rate(self) -> float:
        """Bytes/s a pinned copy between host and GPU achieves, either direction."""
        return self.host_link_bandwidth * self.host_link_efficiency


# NVLink 4 (H100, H200): 900 GB/s both ways per GPU; NVLink 5 (B200): 1.8 TB/s.
# SMs: 132 on H100 and H200 SXM, 148 on B200.
GPUS = {
    "h100": GpuSpec("h100", flops=989e12, bandwidth=3.35e12, link_bandwidth=450e9),
    "h200": GpuSpec("h200", flops=989e12, bandwidth=4.8e12, link_bandwidth=450e9),
    "b200": GpuSpec("b200", flops=2250e12, bandwidth=8e12, link_bandwidth=900e9, num_sms=148),
}


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer or head on one rank: its work and the seconds it is charged."""

    name: str
    flops: float
    bytes: float
    seconds: float
    bound: str  # what set `seconds`: "compute", "memory" or "floor"


def layer_kernels(
    shape: ModelShape,
    gpu: GpuSpec,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    tp: int = 1,
    window: int | None = None,
    sparse: bool = False,
) -> list[Kernel]:
    """The kernels of one decoder layer over a ragged prefill batch (the module's tables) on
    one of `tp` tensor-parallel GPUs; with `window`, a sliding-window layer's; with
    `sparse`, a layer whose MLP is the mixture of experts."""
    _check_batch(extend_lens, prefix_lens)
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be positive, got {window}")
    if sparse and not shape.num_experts:
        raise ValueError(f"{shape.name or 'model'} has no experts")
    if window is not None and shape.is_latent:
        raise ValueError(f"{shape.name or 'model'}: latent attention has no sliding window")
    s = shape.shard(tp)
    t, h, b = sum(extend_lens), s.hidden, s.dtype_bytes
    if s.is_latent:
        kernels = _latent_attention_kernels(s, gpu, extend_lens, prefix_lens)
    else:
        kernels = _attention_kernels(s, gpu, extend_lens, prefix_lens, window)
    kernels.append(_stream(gpu, "post_attention_norm", NORM_PASSES * t * h * b))
    if not sparse:
        return kernels + _mlp_kernels(s, gpu, t, s.intermediate)
    kernels += _moe_kernels(s, gpu, t)
    if s.shared_intermediate:
        kernels += _mlp_kernels(s, gpu, t, s.shared_intermediate, "shared_")
    return kernels


def layer_parts_s(
    shape: ModelShape,
    gpu: GpuSpec,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    tp: int = 1,
    window: int | None = None,
    sparse: bool = False,
) -> tuple[float, float]:
    """(compute, all-reduce) seconds of one decoder layer: the sum of `layer_kernels`, and
    the two all-reduces of the T x hidden activations across the `tp` GPUs."""
    kernels = layer_kernels(shape, gpu, extend_lens, prefix_lens, tp, window, sparse)
    activations = sum(extend_lens) * shape.hidden * shape.dtype_bytes
    allreduce = ALLREDUCES_PER_LAYER * allreduce_time_s(gpu, activations, tp)
    return sum(k.seconds for k in kernels), allreduce


def head_kernels(shape: ModelShape, gpu: GpuSpec, num_reqs: int, tp: int = 1) -> list[Kernel]:
    """The kernels of the final norm and LM head on each request's last position, on one
    of `tp` GPUs (each a vocabulary slice)."""
    if num_reqs <= 0:
        raise ValueError(f"num_reqs must be positive, got {num_reqs}")
    s = shape.shard(tp)
    rows = num_reqs * s.hidden * s.dtype_bytes
    return [
        _stream(gpu, "gather_last", 2 * rows),
        _stream(gpu, "final_norm", 2 * rows),
        _gemm(gpu, "lm_head", num_reqs, s.vocab, s.hidden, s.dtype_bytes, out_bytes=LOGIT_BYTES),
    ]


def head_parts_s(
    shape: ModelShape, gpu: GpuSpec, num_reqs: int, tp: int = 1
) -> tuple[float, float]:
    """(compute, all-gather) seconds of the head: the sum of `head_kernels`, then the
    logits' all-gather across the `tp` GPUs."""
    kernels = head_kernels(shape, gpu, num_reqs, tp)
    gather = allgather_time_s(gpu, num_reqs * shape.vocab * LOGIT_BYTES, tp)
    return sum(k.seconds for k in kernels), gather


def gemm_efficiency(
    gpu: GpuSpec,
    m: float,
    n: int,
    k: int,
    groups: float = 1,
    tiles: Sequence[tuple[int, int, float]] = GEMM_TILES,
    split: int = 1,
) -> float:
    """Fraction of `gpu`'s dense peak an M x K by K x N GEMM reaches (the module's curve):
    the best of `tiles` after tile and wave quantization, times the K ramp. `groups` GEMMs
    of that shape launched together (a grouped GEMM's experts) share the waves; `split`
    cuts K into that many slices, each a tile's work of its own."""
    if split < 1:
        raise ValueError(f"split-K must be at least 1, got {split}")
    best = 0.0
    for tm, tn, tile_eff in tiles:
        count = split * groups * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / gpu.num_sms)
        used = split * groups * m * n / (waves * gpu.num_sms * tm * tn)  # of the waves' tiles
        best = max(best, tile_eff * used)
    return gpu.peak_gemm_efficiency * best * k / (k + split * K_RAMP)


def allreduce_time_s(gpu: GpuSpec, nbytes: float, tp: int) -> float:
    """A ring all-reduce of `nbytes` over `tp` GPUs (0 on one)."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * nbytes / gpu.link_rate + gpu.collective_latency_s


def allgather_time_s(gpu: GpuSpec, nbytes: float, tp: int) -> float:
    """A ring all-gather whose result is `nbytes` on every one of `tp` GPUs (0 on one)."""
    if tp == 1:
        return 0.0
    return (tp - 1) / tp * nbytes / gpu.link_rate + gpu.collective_latency_s


def host_copy_time_s(
    shape: ModelShape, gpu: GpuSpec, num_tokens: int, num_layers: int, tp: int = 1
) -> float:
    """Seconds to move the K and V of `num_tokens` tokens in `num_layers` layers between
    host memory and one of `tp` GPUs (each holds its KV heads' shard and copies it over
    its own link, so the group takes one rank's time)."""
    if num_tokens < 0 or num_layers < 0:
        raise ValueError(f"negative copy: {num_tokens} tokens, {num_layers} layers")
    if num_tokens == 0 or num_layers == 0:
        return 0.0
    nbytes = num_tokens * num_layers * shape.shard(tp).kv_bytes_per_token
    return nbytes / gpu.host_link_rate + KERNELS_PER_HOST_COPY * gpu.kernel_floor_s


def _check_batch(extend_lens: Sequence[int], prefix_lens: Sequence[int]) -> None:
    if len(extend_lens) != len(prefix_lens):
        raise ValueError(f"{len(extend_lens)} extend lengths but {len(prefix_lens)} prefixes")
    if not extend_lens:
        raise ValueError("empty batch")
    if min(extend_lens) <= 0 or min(prefix_lens) < 0:
        raise ValueError("extend lengths must be positive and prefix lengths non-negative")


def experts_hit(num_experts: int, routings: int) -> float:
    """Expected distinct experts among `routings` uniform, independent picks of one of
    `num_experts`: E·(1 - (1 - 1/E)^routings)."""
    return num_experts * (1 - (1 - 1 / num_experts) ** routings)


def experts_time_s(shape: ModelShape, gpu: GpuSpec, tokens: int) -> float:
    """Seconds of a sparse layer's MLP kernels, router to the sum back to the tokens (the
    module's second table), for `tokens` tokens on `shape` as one rank holds it."""
    return sum(k.seconds for k in _moe_kernels(shape, gpu, tokens))


def windowed_pairs(extend: int, prefix: int, window: int) -> int:
    """Query-key pairs of `extend` new tokens after `prefix` in a sliding-window layer: the
    j-th sees min(prefix + j + 1, window) positions."""
    first = prefix + 1  # keys of the first new token, before the cap
    uncapped = max(0, min(extend, window - first + 1))  # tokens seeing fewer than window
    below = uncapped * first + uncapped * (uncapped - 1) // 2
    return below + (extend - uncapped) * window


def _attention_kernels(
    s: ModelShape,
    gpu: GpuSpec,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    window: int | None,
) -> list[Kernel]:
    """Input norm to o_proj of attention over K and V heads (the module's first table)."""
    t, h, b = sum(extend_lens), s.hidden, s.dtype_bytes
    q, kv = s.q_width, s.kv_width
    return [
        _stream(gpu, "input_norm", NORM_PASSES * t * h * b),
        _gemm(gpu, "qkv_proj", t, q + 2 * kv, h, b),
        _stream(gpu, "rope", 2 * t * (q + kv) * b),
        _stream(gpu, "kv_write", 2 * t * kv * b + t * s.kv_bytes_per_token),
        _attention(s, gpu, extend_lens, prefix_lens, window),
        _gemm(gpu, "o_proj", t, h, q, b),
    ]


def _latent_attention_kernels(
    s: ModelShape, gpu: GpuSpec, extend_lens: Sequence[int], prefix_lens: Sequence[int]
) -> list[Kernel]:
    """Input norm to o_proj of latent attention (the module's latent table), on a rank's
    heads; the down projections and the latent rows are whole on every rank."""
    t, h, b = sum(extend_lens), s.hidden, s.dtype_bytes
    heads, nope, rope, v = s.num_heads, s.qk_nope_head_dim, s.head_dim, s.v_head_dim
    q_rank, kv_rank, row = s.q_lora_rank, s.kv_lora_rank, s.latent_width
    keys = sum(p + e for e, p in zip(extend_lens, prefix_lens))
    pairs = sum(e * (p + (e + 1) / 2) for e, p in zip(extend_lens, prefix_lens))
    qk = nope + rope
    attention_bytes = (t * heads * (qk + v) + keys * heads * (qk + v)) * b
    return [
        _stream(gpu, "input_norm", NORM_PASSES * t * h * b),
        _gemm(gpu, "q_kv_a_proj", t, q_rank + row, h, b),
        _stream(gpu, "q_kv_a_norm", 2 * t * (q_rank + kv_rank) * b),
        _gemm(gpu, "q_b_proj", t, heads * qk, q_rank, b),
        _stream(gpu, "rope", 2 * t * (heads + 1) * rope * b),
        _stream(gpu, "latent_write", t * row * b + t * s.kv_bytes_per_token),
        _stream(gpu, "latent_gather", keys * s.kv_bytes_per_token + keys * row * b),
        _gemm(gpu, "kv_b_proj", keys, heads * (nope + v), kv_rank, b),
        _stream(gpu, "k_assemble", keys * (heads * nope + rope + heads * qk) * b),
        _kernel(
            gpu, "attention", 2 * heads * (qk + v) * pairs, gpu.attention_flops, attention_bytes
        ),
        _gemm(gpu, "o_proj", t, h, heads * v, b),
    ]


def _mlp_kernels(s: ModelShape, gpu: GpuSpec, t: int, rows: int, prefix: str = "") -> list[Kernel]:
    """A gated MLP of `rows` rows (`prefix` names a shared expert's kernels)."""
    h, b = s.hidden, s.dtype_bytes
    return [
        _gemm(gpu, f"{prefix}gate_up_proj", t, 2 * rows, h, b),
        _stream(gpu, f"{prefix}act", 3 * t * rows * b),
        _gemm(gpu, f"{prefix}down_proj", t, h, rows, b),
    ]


def _moe_kernels(s: ModelShape, gpu: GpuSpec, t: int) -> list[Kernel]:
    h, e, ie, b = s.hidden, s.num_experts, s.moe_intermediate, s.dtype_bytes
    r = t * s.experts_per_tok  # routed rows
    n = experts_hit(e, r)
    outputs = 2 if s.shared_intermediate else 1  # the tokens' rows, and the shared experts'
    return [
        _gemm(gpu, "router", t, e, h, b),
        _stream(gpu, "topk_softmax", t * e * b + r * (INDEX_BYTES + ROUTE_WEIGHT_BYTES)),
        _stream(gpu, "sort_by_expert", 2 * r * INDEX_BYTES),
        _stream(gpu, "expert_offsets", e * INDEX_BYTES),
        _stream(gpu, "gather_rows", 2 * r * h * b),
        _gemm(gpu, "experts_gate_up", r, 2 * ie, h, b, groups=n),
        _stream(gpu, "experts_act", 3 * r * ie * b),
        _gemm(gpu, "experts_down", r, h, ie, b, groups=n),
        _stream(gpu, "scale_rows", 2 * r * h * b + r * ROUTE_WEIGHT_BYTES),
        _stream(gpu, "sum_to_tokens", r * h * b + outputs * t * h * b),
    ]


def _attention(
    s: ModelShape,
    gpu: GpuSpec,
    extend_lens: Sequence[int],
    prefix_lens: Sequence[int],
    window: int | None,
) -> Kernel:
    both = list(zip(extend_lens, prefix_lens))
    if window is None:
        pairs = sum(e * (p + (e + 1) / 2) for e, p in both)
        kv_rows = sum(p + e for e, p in both)
    else:
        pairs = sum(windowed_pairs(e, p, window) for e, p in both)
        kv_rows = sum(min(p, window - 1) + e for e, p in both)
    q_and_out = 2 * sum(extend_lens) * s.q_width * s.dtype_bytes
    nbytes = q_and_out + kv_rows * s.kv_bytes_per_token
    return _kernel(gpu, "attention", 4 * s.q_width * pairs, gpu.attention_flops, nbytes)


def _gemm(
    gpu: GpuSpec,
    name: str,
    m: int,
    n: int,
    k: int,
    b: int,
    groups: float = 1,
    out_bytes: int | None = None,
) -> Kernel:
    """`groups` GEMMs of m / groups rows each, N x K weights apiece, launched as one kernel:
    its FLOPs, the weights, input and output bytes (output elements of `out_bytes`)."""
    out = b if out_bytes is None else out_bytes
    nbytes = groups * k * n * b + m * k * b + m * n * out
    best = None
    for split in SPLIT_K:
        if split > 1 and k < split * MIN_SPLIT_DEPTH:
            break
        rate = gpu.flops * gemm_efficiency(gpu, m / groups, n, k, groups, split=split)
        partials = 2 * split * m * n * PARTIAL_BYTES if split > 1 else 0
        kernel = _kernel(gpu, name, 2 * m * n * k, rate, nbytes + partials)
        if best is None or kernel.seconds < best.seconds:
            best = kernel
    return best


def _stream(gpu: GpuSpec, name: str, nbytes: float) -> Kernel:
    """An elementwise, norm or copy kernel: its bytes only."""
    return _kernel(gpu, name, 0, gpu.flops, nbytes)


def _kernel(gpu: GpuSpec, name: str, flops: float, flop_rate: float, nbytes: float) -> Kernel:
    times = {
        "compute": flops / flop_rate,
        "memory": nbytes / gpu.memory_bandwidth,
        "floor": gpu.kernel_floor_s,
    }
    bound = max(times, key=times.__getitem__)  # ties: compute, then memory
    return Kernel(name, flops, nbytes, times[bound], bound)


class DeviceClock:
    """A virtual device queue: issued work runs back to back on `now`'s clock.

    Each piece starts at max(now, end of the previous piece).
    """

    def __init__(
        self,
        now: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._now = now
        self._sleep = sleep
        self._lock = threading.Lock()
        self._busy_until = -math.inf

    def issue(self, duration_s: float) -> float:
        """Queue `duration_s` of work; returns the time it finishes."""
        if duration_s < 0:
            raise ValueError(f"negative duration {duration_s}")
        with self._lock:
            self._busy_until = max(self._now(), self._busy_until) + duration_s
            return self._busy_until

    @property
    def busy_until(self) -> float:
        """End of the last issued piece (-inf before any)."""
        with self._lock:
            return self._busy_until

    def wait_until(self, t: float) -> None:
        """Sleep until `now` reaches `t`."""
        while (left := t - self._now()) > 0:
            self._sleep(left)

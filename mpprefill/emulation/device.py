"""The emulated accelerator (`--device emulated`): real host work, a virtual device.

Host side: the worker runs the model's own forward code on the CPU, with the emulated
model's layer count at a tiny width, so each forward issues the Python and torch calls
of the real code path, layer by layer and request by request. It computes only the last
new token of each request (attending to itself), because exact attention over long
prefixes at 8k-token chunks would cost the CPU far more than the dispatch it stands for;
the modules, the Python path and the number of torch calls stay those of the full batch.

Device side: a clock (`roofline.DeviceClock`). Each layer's device time comes from a
roofline of the emulated model's real dimensions at the batch's real token counts and
prefix lengths on the named GPU (`roofline.layer_parts_s`). Layer k starts when it is
issued and layer k - 1 is done; the forward is complete when the clock passes the end of
its last piece. A layer slides on the device where the base model's layer does (see
`host_config`) or, when the base model has no sliding layers, where the emulated shape's
does (gpt-oss's even layers): the host stand-in then keeps full attention, and only the
roofline charges the window. Attention sinks (gpt-oss) cost nothing extra: a few
elementwise ops on each layer's attention, next to its GEMMs. Events recorded on the
stream fire at that time, so collect, the KV write fence and the WAR barrier see the
forward as they would see a GPU's.

What still holds in this mode: the request lifecycle, chunk accounting, cache and pool
invariants, and equal first tokens across modes: a request's first token is a function of
its last token and that token's position alone, whatever the chunking, the batch and the
prefix hits (which differ between modes and runs). What does not: the logits and the KV
pages are not the model's (pages of tokens it skips are never written), so `--verify` on
the decode side fails.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ipc.events import GenEvent
from mpprefill.emulation.roofline import (
    GPUS,
    DeviceClock,
    head_parts_s,
    host_copy_time_s,
    layer_parts_s,
)
from mpprefill.emulation.shapes import KERNELS_PER_HEAD, ModelShape, resolve_shape
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import CausalLM, ForwardBatch, ModelConfig, build_model
from mpprefill.streams import HostStream

logger = logging.getLogger(__name__)
# New tokens per request the host computes. One, so that a request's first token does not
# depend on how many of its last tokens its last chunk holds (a prefix hit may leave it 1).
KEEP_TOKENS = 1
# GQA like the real shapes, at a width whose KV pool stays small (1 KiB per token per
# 16 layers) so that pools of a million tokens fit in shared memory.
HOST_WIDTH = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=8,
)
# A latent-attention base (DeepSeek-V3's) at the same width: a K and V per head, decompressed
# from a latent row of 8 + 8 (the rope key) elements a layer, as many as GQA's K and V above.
HOST_LATENT_WIDTH = dict(
    HOST_WIDTH,
    num_key_value_heads=HOST_WIDTH["num_attention_heads"],
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=HOST_WIDTH["head_dim"],
    v_head_dim=8,
)
HOST_Q_LORA_RANK = 16


def host_config(base: ModelConfig, emulate_model: str) -> ModelConfig:
    """The tiny-width stand-in: `base`'s vocabulary, positions and window, the emulated
    model's layer count. With sliding-window layers in `base`, emulated layer i slides
    where layer i mod (base's layer count) does, so a repeating pattern keeps its period.
    The stand-in's MLPs are dense: the roofline, not the host path, charges the experts
    (on the emulated model's sparse layers, whatever the checkpoint's). Without sliding
    layers in `base` the stand-in attends fully even where the emulated shape slides
    (gpt-oss); the roofline alone charges those layers' window. A latent-attention `base`
    (DeepSeek-V3's) keeps its latent attention at ranks as small as the width (q's low-rank
    projection only where `base` has one) and drops its shared experts with the routed
    ones; any other base keeps its attention whatever the emulated shape's."""
    shape = resolve_shape(emulate_model)
    types = None
    if base.has_sliding_layers:
        n = base.num_hidden_layers
        types = tuple(base.layer_types[i % n] for i in range(shape.num_layers))
    width = HOST_WIDTH
    if base.is_latent:
        q_rank = None if base.q_lora_rank is None else HOST_Q_LORA_RANK
        width = dict(HOST_LATENT_WIDTH, q_lora_rank=q_rank)
    return dataclasses.replace(
        base,
        num_hidden_layers=shape.num_layers,
        layer_types=types,
        num_experts=0,
        dense_mlp_layers=(),
        shared_expert_intermediate_size=0,
        **width,
    )


def host_model(config: ModelConfig, seed: int) -> CausalLM:
    model = build_model(config, device="cpu")
    model.init_random_weights(seed)
    return model


def shrink(fb: ForwardBatch, keep: int = KEEP_TOKENS) -> ForwardBatch:
    """The last `keep` new tokens of each request, attending among themselves only.

    | request  | new tokens (rows)   | kept rows            | its keys           |
    |----------|---------------------|----------------------|--------------------|
    | i        | [r_i, r_i + e_i)    | [r_i + e_i - k_i, ..) | the kept rows' slots |

    with k_i = min(e_i, keep).
    """
    kept = [min(e, keep) for e in fb.extend_lens_cpu]
    ends = itertools.accumulate(fb.extend_lens_cpu)
    rows = [i for end, k in zip(ends, kept) for i in range(end - k, end)]
    rows = torch.tensor(rows, dtype=torch.int64, device=fb.input_ids.device)
    out = fb.out_cache_loc.index_select(0, rows)
    small = ForwardBatch(
        input_ids=fb.input_ids.index_select(0, rows),
        positions=fb.positions.index_select(0, rows),
        out_cache_loc=out,
        prefix_lens=torch.zeros_like(fb.prefix_lens),
        extend_lens=torch.tensor(kept, dtype=torch.int64, device=fb.input_ids.device),
        kv_indices=out,
        prefix_lens_cpu=(0,) * len(kept),
        extend_lens_cpu=tuple(kept),
    )
    if fb.has_swa_slots:  # the sliding-window layers' own pool: the same rows there
        small.swa_out_cache_loc = fb.swa_out_cache_loc.index_select(0, rows)
        small.swa_kv_indices = small.swa_out_cache_loc
    return small


class LaunchCost:
    """The driver time of kernel launches (`--emulate-launch-us`), spent where the host
    stand-in issues each layer: one lump of (kernels x cost) of CPU work inside a torch op,
    so with the GIL released, as a launch inside a torch op's dispatch is. It is CPU work,
    not a sleep: a sleep's wake-up on a loaded host adds tens of microseconds, while a
    driver keeps its core.

    The work is Hurwitz's zeta over a small float32 buffer on the calling thread: some 90 ns
    of arithmetic an element here, so a lump of 50 us touches a few KiB and leaves the
    caches to the forward (a streaming op of that length evicted the stand-in's tensors and
    slowed the layer after it). Its length comes from the op's cost on that thread,
    t(n) = a + b·n: a and b first from the medians of CALIBRATION_RUNS calls at n = 0 and
    n = CALIBRATION_LEN, then b follows what each lump took of the thread's CPU time. CPU
    time, not wall time: a thread that waits for the GIL after the op (a forward thread
    beside the scheduler) is not charged less work for it. A lump shorter than a costs a
    (about 3 us here, under the 20 us of 10 launches of 2 us). `asked_s` and `spent_s`
    (the lumps' CPU time) say where the cost landed."""

    CALIBRATION_RUNS = 32
    CALIBRATION_LEN = 1 << 10
    MAX_LEN = 1 << 16  # some 6 ms of launches in one lump
    SMOOTHING = 0.1  # weight of the newest lump in the per-element cost

    def __init__(self, per_kernel_us: float):
        if per_kernel_us < 0:
            raise ValueError(f"launch cost must not be negative, got {per_kernel_us}")
        self.per_kernel_s = per_kernel_us * 1e-6
        self._buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fixed_s = 0.0  # a
        self._per_elem_s = 0.0  # b
        self.asked_s = 0.0
        self.spent_s = 0.0

    def spend(self, kernels: int) -> None:
        if self.per_kernel_s <= 0 or kernels <= 0:
            return
        if self._buffers is None:
            self._calibrate()
        start = time.thread_time()  # the sizing and the slicing count as the lump's
        want = kernels * self.per_kernel_s
        n = min(self.MAX_LEN, max(0, round((want - self._fixed_s) / self._per_elem_s)))
        self._lump(n)
        took = time.thread_time() - start
        if n:
            seen = max(took - self._fixed_s, 0.0) / n
            self._per_elem_s += self.SMOOTHING * (max(seen, 1e-12) - self._per_elem_s)
        self.spent_s += took
        self.asked_s += want

    def landed(self) -> float | None:
        """The lumps' CPU time over what was asked (None before any)."""
        return self.spent_s / self.asked_s if self.asked_s else None

    def _calibrate(self) -> None:
        gen = torch.Generator().manual_seed(0)
        # NOTE: normal tensors even when first asked inside a forward's inference mode: an
        # inference tensor could not be written by a lump spent outside it (the head's).
        with torch.inference_mode(False):
            x = torch.rand(self.MAX_LEN, generator=gen) + 1.5  # zeta(x, q) converges for x > 1
            q = torch.rand(self.MAX_LEN, generator=gen) + 1
            self._buffers = (x, q, torch.empty_like(x))
        zero = self._median_s(0)
        full = self._median_s(self.CALIBRATION_LEN)
        self._fixed_s = zero
        self._per_elem_s = max(full - zero, 1e-9) / self.CALIBRATION_LEN

    def _lump(self, n: int) -> None:
        x, q, out = self._buffers
        torch.special.zeta(x[:n], q[:n], out=out[:n])

    def _median_s(self, n: int) -> float:
        took = []
        for _ in range(self.CALIBRATION_RUNS):
            start = time.thread_time()
            self._lump(n)
            took.append(time.thread_time() - start)
        return statistics.median(took)


class EmulatedDevice:
    """Charges each forward's roofline time on a device clock. At `tp_size` > 1 the clock
    is one GPU of a tensor-parallel group: its shard's roofline plus the collectives.

    `launch_us`: each kernel's launch costs the host that much (`LaunchCost`), charged per
    layer for the roofline's kernels of that layer and for the head's. `issue`: "model"
    runs every layer of the host stand-in; "free" only its embedding and head (the logits
    stay a function of the last token), and the layers' device time is charged at once."""

    def __init__(
        self,
        shape: ModelShape,
        gpu: str,
        tp_size: int = 1,
        launch_us: float = 0.0,
        issue: str = "model",
    ):
        shape.shard(tp_size)  # raises unless the shape splits over the group
        if issue not in ("model", "free"):
            raise ValueError(f"issue must be 'model' or 'free', got {issue!r}")
        self.shape = shape
        self.gpu = GPUS[gpu]
        self.tp_size = tp_size
        self.clock = DeviceClock()
        self.launch = LaunchCost(launch_us)
        self.issue = issue
        self._last = (0, 0, 0.0, 0.0)
        self._forwards = 0

    @classmethod
    def of(cls, emulate_model: str, gpu: str, tp_size: int = 1) -> EmulatedDevice:
        return cls(resolve_shape(emulate_model), gpu, tp_size)

    def forward(
        self,
        model: CausalLM,
        fb: ForwardBatch,
        kv: KVCache,
        on_layer: Callable[[int], None] | None = None,
    ):
        """Issue the forward and charge its time; `on_layer(i)` runs right after layer i's
        time is charged, so an event recorded there on the stream (EmulatedStream) fires
        when the clock passes that layer's end."""
        extend = list(fb.extend_lens_cpu)
        prefix = list(fb.prefix_lens_cpu)
        config = model.config
        n = len(model.layers)
        kinds = [(self._window(config, i), self.shape.is_sparse(i)) for i in range(n)]
        costs = {kind: self._layer_parts(extend, prefix, *kind) for kind in set(kinds)}
        layers = [costs[kind] for kind in kinds]
        head, gather = head_parts_s(self.shape, self.gpu, len(extend), self.tp_size)
        head_s = head + gather
        first: list[float] = []

        def charge(i: int) -> None:
            self.launch.spend(self.shape.kernels_in_layer(i))
            layer_s = sum(layers[i])
            end = self.clock.issue(layer_s)
            if not first:
                first.append(end - layer_s)
            if on_layer is not None:
                on_layer(i)

        if self.issue == "free":
            logits = _head_only(model, shrink(fb))
            for i in range(n):
                charge(i)
        else:
            model.rotary.reserve(fb.max_seq_len)  # the kept tokens keep their positions
            logits = model(shrink(fb), kv, charge)
        self.launch.spend(KERNELS_PER_HEAD)
        self._forwards += 1
        if self._forwards & (self._forwards - 1) == 0 and self.launch.landed() is not None:
            logger.info(
                "launch cost after %d forwards: %.2f us a kernel asked, %.2f us spent",
                self._forwards,
                self.launch.per_kernel_s * 1e6,
                self.launch.per_kernel_s * 1e6 * self.launch.landed(),
            )
        end = self.clock.issue(head_s)
        start = first[0] if first else end - head_s
        busy = sum(c + a for c, a in layers) + head_s
        collective = sum(a for _, a in layers) + gather
        self._last = (int(start * 1e9), int(end * 1e9), busy, collective)
        return logits

    def _window(self, config: ModelConfig, layer: int) -> int | None:
        """The layer's sliding window (None: full attention): the host model's where it has
        sliding layers (the base config's pattern), else the emulated shape's."""
        if config.has_sliding_layers:
            return config.sliding_window if config.is_sliding(layer) else None
        return self.shape.sliding_window if self.shape.is_sliding(layer) else None

    def _layer_parts(
        self, extend: list[int], prefix: list[int], window: int | None, sparse: bool
    ) -> tuple[float, float]:
        """One layer's (compute, all-reduce) seconds: windowed where `window` is set, the
        experts where the emulated model's layer is sparse."""
        tp = self.tp_size
        return layer_parts_s(self.shape, self.gpu, extend, prefix, tp, window, sparse)

    def last_forward(self) -> tuple[int, int, float, float]:
        """The last forward on the device: its start and end (clock_ns), its busy seconds
        (less than end - start where the host issued layers slower than they ran) and the
        part of them in collectives (0 at `tp_size` 1)."""
        return self._last


@torch.inference_mode()
def _head_only(model: CausalLM, fb: ForwardBatch) -> torch.Tensor:
    """Logits of the stand-in's embedding, final norm and head at each kept token (one a
    request: `shrink`'s), skipping its layers."""
    return model.output(model.norm(model.tok_embeddings(fb.input_ids))).float()


class EmulatedHostLink:
    """The emulated GPU's host link, for the host KV tier's copies: each copy of n slots
    of a pool with L layers lasts the roofline's time to move the real model's K and V of
    n tokens in L layers over PCIe (`roofline.host_copy_time_s`). PCIe is full duplex and
    a GPU's copy engines run beside its compute, so each direction has a clock of its
    own. `start` charges a copy to its direction's clock; the call it returns waits
    until the clock has run it."""

    def __init__(self, shape: ModelShape, gpu: str, tp_size: int = 1, make_clock=DeviceClock):
        shape.shard(tp_size)  # raises unless the shape splits over the group
        self.shape = shape
        self.gpu = GPUS[gpu]
        self.tp_size = tp_size
        self.clocks = {True: make_clock(), False: make_clock()}  # by to_device
        self._busy = threading.Lock()  # NOTE: the two copy lanes charge it concurrently
        self.busy_s = 0.0  # link seconds charged so far, both directions

    @classmethod
    def of(cls, emulate_model: str, gpu: str, tp_size: int = 1) -> EmulatedHostLink:
        return cls(resolve_shape(emulate_model), gpu, tp_size)

    def start(self, num_tokens: int, num_layers: int, to_device: bool) -> Callable[[], None]:
        took = host_copy_time_s(self.shape, self.gpu, num_tokens, num_layers, self.tp_size)
        with self._busy:
            self.busy_s += took
        clock = self.clocks[to_device]
        done_at = clock.issue(took)
        return lambda: clock.wait_until(done_at)


class EmulatedStream(HostStream):
    """The forward process's stream on the emulated accelerator: work is issued at once
    on the calling thread (the clock times it); an event recorded on the stream fires
    when the clock passes the work issued before it, on a thread of its own."""

    runs_elsewhere = True

    def __init__(self, clock: DeviceClock):
        self.clock = clock
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="emulated-device", daemon=True)
        self._thread.start()

    def record(self, event: GenEvent, gen: int) -> None:
        at = self.clock.busy_until
        with self._cv:
            if at <= time.monotonic() and not self._due:  # NOTE: never ahead of older records
                event.record(gen)
                return
            self._n += 1
            heapq.heappush(self._due, (at, self._n, lambda: event.record(gen)))
            self._cv.notify()

    def drain(self) -> None:
        self.clock.wait_until(self.clock.busy_until)
        with self._cv:
            while self._due:
                self._cv.wait(0.01)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._due:
                    self._cv.wait()
                at = self._due[0][0]
            self.clock.wait_until(at)
            with self._cv:
                _, _, fire = heapq.heappop(self._due)
                self._cv.notify_all()
            try:
                fire()
            except BaseException as e:  # raised on the issuing thread by check()
                self.error = e
                return

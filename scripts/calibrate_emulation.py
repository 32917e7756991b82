#!/usr/bin/env python3
"""Calibrate the emulated accelerator against a real GPU: the sensitivity map's grid on CUDA.

For each model shape (a preset of `--emulate-model`, built at its real dimensions in
bfloat16 with random weights) and each per-batch token budget, a batch as the bench's
workload makes them (hit rate 0.8: requests of ~205 new tokens after ~820 cached ones)
runs `--forwards` times after a warm-up. Per forward it reports:

- the device time (CUDA events around the forward) beside the roofline's prediction
  (`roofline.layer_parts_s` per layer plus `head_parts_s`) and their ratio;
- the host's issue time (the call's wall time, nothing read back) beside what the emulated
  device's stand-in issues for the same batch on this host, with and without each
  `--launch-us`.

`measured / predicted` is the emulation's calibration: the README quotes it once a GPU has
run this. Needs a CUDA build of torch; prints one table and writes `--json`.

    python scripts/calibrate_emulation.py --models Qwen2.5-0.5B,Llama-3.1-8B \
        --tokens 512,2048,8192,16384 --json calibration.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mpprefill.emulation.device import EmulatedDevice, host_config, host_model  # noqa: E402
from mpprefill.emulation.roofline import GPUS, head_parts_s, layer_parts_s  # noqa: E402
from mpprefill.emulation.shapes import ModelShape, resolve_shape  # noqa: E402
from mpprefill.memory.kv_cache import KVCache  # noqa: E402
from mpprefill.model import ForwardBatch, ModelConfig, build_model  # noqa: E402

NEW_PER_REQUEST = 205  # ~1,024-token prompts at hit rate 0.8
CACHED_PER_REQUEST = 820


def real_config(shape: ModelShape) -> ModelConfig:
    """A dense config at the shape's real dimensions (the MoE shapes are left out: the
    built-in model's experts are not the grouped kernels a serving stack runs)."""
    if shape.num_experts:
        raise ValueError(f"{shape.name}: calibrate dense shapes only")
    return dataclasses.replace(
        ModelConfig.tiny(),
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=32768,
        dtype="bfloat16",
    )


def make_batch(tokens: int, vocab: int) -> tuple[ForwardBatch, list[int], list[int]]:
    n = max(1, tokens // NEW_PER_REQUEST)
    extend = [NEW_PER_REQUEST] * n
    prefix = [CACHED_PER_REQUEST] * n
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1, vocab, (n, NEW_PER_REQUEST), generator=gen).tolist()
    per = NEW_PER_REQUEST + CACHED_PER_REQUEST
    slots = [list(range(i * per, (i + 1) * per)) for i in range(n)]
    return ForwardBatch.build(ids, prefix, slots), extend, prefix


def predicted_s(shape: ModelShape, gpu: str, extend: list[int], prefix: list[int]) -> float:
    spec = GPUS[gpu]
    layer = sum(layer_parts_s(shape, spec, extend, prefix))
    return shape.num_layers * layer + sum(head_parts_s(shape, spec, len(extend)))


def time_cuda(model, kv, fb: ForwardBatch, forwards: int) -> tuple[float, float]:
    """Median host issue seconds and device seconds of a forward."""
    model(fb, kv)  # warm-up
    torch.cuda.synchronize()
    hosts, devices = [], []
    for _ in range(forwards):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        model(fb, kv)
        end.record()
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        devices.append(start.elapsed_time(end) / 1e3)
    return statistics.median(hosts), statistics.median(devices)


def time_stand_in(name: str, tokens: int, launch_us: float, forwards: int) -> float:
    """Median host seconds of the emulated forward of the same batch shape (the stand-in's
    issue and the launch cost; the clock is not waited for)."""
    model = host_model(host_config(ModelConfig.tiny(), name), seed=0)
    fb, _, _ = make_batch(tokens, model.config.vocab_size)
    kv = KVCache.for_model(model.config, fb.out_cache_loc.numel() + sum(fb.prefix_lens_cpu))
    dev = EmulatedDevice(resolve_shape(name), "h200", launch_us=launch_us)
    took = []
    with torch.inference_mode():
        for _ in range(forwards + 1):
            t0 = time.perf_counter()
            dev.forward(model, fb, kv)
            took.append(time.perf_counter() - t0)
    return statistics.median(took[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="Qwen2.5-0.5B,Llama-3.1-8B")
    ap.add_argument("--tokens", default="512,2048,8192,16384")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="the roofline's GPU")
    ap.add_argument("--launch-us", default="2,10", help="stand-in launch costs to compare")
    ap.add_argument("--forwards", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("calibrate_emulation: no CUDA device", file=sys.stderr)
        return 2
    launches = [float(x) for x in args.launch_us.split(",") if x]
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; roofline of {args.gpu}")
    print(
        f"{'model':>14} {'tokens':>6} {'device ms':>9} {'predicted':>9} {'meas/pred':>9} "
        f"{'host ms':>8} " + " ".join(f"{f'stand-in+{x:g}us':>15}" for x in [0.0, *launches])
    )
    for name in args.models.split(","):
        shape = resolve_shape(name)
        cfg = real_config(shape)
        model = build_model(cfg, device="cuda")
        model.init_random_weights(seed=0)
        model.set_attention_backend("auto")
        for tokens in (int(t) for t in args.tokens.split(",")):
            fb, extend, prefix = make_batch(tokens, shape.vocab)
            slots = fb.out_cache_loc.numel() + sum(prefix) + 1
            kv = KVCache.for_model(cfg, slots, "cuda")
            with torch.inference_mode():
                host_s, device_s = time_cuda(model, kv, fb.to("cuda"), args.forwards)
            stand_in = {x: time_stand_in(name, tokens, x, args.forwards) for x in [0.0, *launches]}
            pred = predicted_s(shape, args.gpu, extend, prefix)
            rows.append(
                dict(
                    model=name,
                    tokens=sum(extend),
                    requests=len(extend),
                    device_s=device_s,
                    predicted_s=pred,
                    host_issue_s=host_s,
                    stand_in_issue_s={f"{x:g}": s for x, s in stand_in.items()},
                )
            )
            print(
                f"{name:>14} {sum(extend):6d} {device_s * 1e3:9.2f} {pred * 1e3:9.2f} "
                f"{device_s / pred:9.2f} {host_s * 1e3:8.2f} "
                + " ".join(f"{stand_in[x] * 1e3:15.2f}" for x in [0.0, *launches])
            )
            del kv
        del model
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

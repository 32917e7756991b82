#!/usr/bin/env python3
"""Where the emulated device's launch cost (`--emulate-launch-us`) lands.

Runs the emulated forward of a model's host stand-in in this process, interleaving launch
costs (0 and each asked one) round by round, and reports per asked cost:

- `wall`: the forward's median wall time with the cost minus without it, per kernel
  launched (the roofline's kernels: 10 a dense layer, 17 a sparse one, 3 for the head);
- `lump`: the lumps' own wall time over the asked time (each `spend` call timed);
- `cpu`: the lumps' own CPU time over the asked time (`LaunchCost.landed`);

`wall` exceeds `lump` by what the lumps cost the stand-in's own ops after them (their
caches), as a driver's work between a real forward's ops would.

run on an otherwise idle host (beside a busy Python thread every op of the stand-in, not
only the lumps, waits for the GIL, and the difference says nothing of the lumps).

    python scripts/bench_launch_cost.py --model Qwen2.5-0.5B --tokens 512 --costs 2,5,10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from calibrate_emulation import make_batch  # noqa: E402

from mpprefill.emulation.device import EmulatedDevice, host_config, host_model  # noqa: E402
from mpprefill.emulation.shapes import resolve_shape  # noqa: E402
from mpprefill.memory.kv_cache import KVCache  # noqa: E402
from mpprefill.model import ModelConfig  # noqa: E402


def _timed(spend, total: list[float]):
    """`spend`, adding each call's wall seconds to total[0]."""

    def timed(kernels: int) -> None:
        start = time.perf_counter()
        spend(kernels)
        total[0] += time.perf_counter() - start

    return timed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--tokens", type=int, default=512, help="new tokens in the batch")
    ap.add_argument("--costs", default="2,5,10", help="launch costs to ask, us per kernel")
    ap.add_argument("--forwards", type=int, default=20, help="forwards per cost per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    costs = [float(c) for c in args.costs.split(",")]
    shape = resolve_shape(args.model)
    model = host_model(host_config(ModelConfig.tiny(), args.model), seed=0)
    fb, _, _ = make_batch(args.tokens, model.config.vocab_size)
    kv = KVCache.for_model(model.config, fb.out_cache_loc.numel() + sum(fb.prefix_lens_cpu) + 64)
    kernels = shape.kernels_per_forward
    devices = {c: EmulatedDevice(shape, "h200", launch_us=c) for c in [0.0, *costs]}
    for dev in devices.values():  # warm-up: the lumps' calibration stays out of the timings
        dev.forward(model, fb, kv)
    lump_s = {c: [0.0] for c in costs}
    for cost in costs:
        launch = devices[cost].launch
        launch.asked_s = launch.spent_s = 0.0
        launch.spend = _timed(launch.spend, lump_s[cost])
    times: dict[float, list[float]] = {c: [] for c in devices}
    for _ in range(args.rounds):
        for cost, dev in devices.items():
            for _ in range(args.forwards):
                start = time.perf_counter()
                dev.forward(model, fb, kv)
                times[cost].append(time.perf_counter() - start)
    base = statistics.median(times[0.0])
    print(
        f"{args.model}, {fb.batch_size} requests, {fb.num_tokens} new tokens, {kernels} kernels "
        "a forward"
    )
    print(f"no launch cost: {base * 1e3:.2f} ms a forward (median)")
    print(
        f"{'asked us':>9} {'forward ms':>10} {'wall us/kernel':>14} {'wall/asked':>10} "
        f"{'lump/asked':>10} {'cpu/asked':>9}"
    )
    for cost in costs:
        med = statistics.median(times[cost])
        per_kernel = (med - base) / kernels * 1e6
        launch = devices[cost].launch
        landed = launch.landed()
        lump = lump_s[cost][0] / launch.asked_s
        print(
            f"{cost:9.1f} {med * 1e3:10.2f} {per_kernel:14.2f} {per_kernel / cost:10.2f} "
            f"{lump:10.2f} {landed:9.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

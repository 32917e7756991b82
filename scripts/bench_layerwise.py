#!/usr/bin/env python3
"""TTFT at the decode and uncached ITPS with and without layer-wise KV send, side by side.

On the emulated accelerator behind the emulated link (`--emulate-link-gbps`), through the
bench's own runs (fresh serve and decode per run, `mpprefill.bench.runner.run_mode`). Each
round runs every configuration once, interleaved, so drift on the machine hits them alike;
each figure is the median of the rounds.

TTFT points, per prompt length and link speed: one request at a time (max concurrency 1),
random prompts, no prefix hits:

    own     the fake backend: the prefill's own time, arrival to its first token
    whole   shm through the link, pages after the forward (as without the flag)
    layer   shm through the link, --disaggregation-layerwise-send

TTFT at the decode is the bench's `ttft_decode_p50_ms` (arrival at the prefill to the
decode's sending of the first token). The bound the layer-wise figure is held to is the
prefill's own time, plus one layer's KV for the prompt on the link, plus 2 ms.

Throughput point: `--itps-requests` prompts of `--itps-prompt-len` sent at once, whole and
layer, each run's uncached ITPS.

    python scripts/bench_layerwise.py --prompt-lens 4096,8192,16384 --repeats 5 \\
        --json layerwise.json --plot docs/layerwise_ttft.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import random_prompts
from mpprefill.config import ServerArgs
from mpprefill.emulation.setup import transfer_link_for

CONFIGS = ("own", "whole", "layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--emulate-model", default="Llama-3.1-8B")
    ap.add_argument("--emulate-gpu", default="h200")
    ap.add_argument("--link-gbps", default="100", help="comma-separated link speeds, Gb/s")
    ap.add_argument("--prompt-lens", default="4096,8192,16384", help="comma-separated")
    ap.add_argument("--ttft-requests", type=int, default=6, help="timed requests per TTFT run")
    ap.add_argument("--itps-requests", type=int, default=48)
    ap.add_argument("--itps-prompt-len", type=int, default=4096)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--mode", default="proc-ahead")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every run's figures and the medians here")
    ap.add_argument("--plot", help="TTFT at the decode against prompt length (PNG)")
    return ap.parse_args(argv)


def server(a: argparse.Namespace, config: str, gbps: float, max_len: int) -> ServerArgs:
    chunk = a.chunked_prefill_size
    return ServerArgs(
        device="emulated",
        emulate_model=a.emulate_model,
        emulate_gpu=a.emulate_gpu,
        disaggregation_transfer_backend="fake" if config == "own" else "shm",
        disaggregation_layerwise_send=config == "layer",
        emulate_link_gbps=None if config == "own" else gbps,
        chunked_prefill_size=chunk,
        max_prefill_tokens=max(chunk, 4096),
        max_total_tokens=max(131072, 4 * max_len),
        context_length=max(max_len, 8192),
        worker_threads=1,
    )


def one_run(a, config: str, gbps: float, work, max_len: int, concurrency: int | None) -> dict:
    args = server(a, config, gbps, max_len)
    cfg = BenchConfig(args, [a.mode], warmup_requests=2, max_concurrency=concurrency)
    run = run_mode(cfg, a.mode, work)
    if run["num_failed"] or not run["leaks"]["ok"]:
        raise SystemExit(f"{config} run failed: {run['num_failed']} failed, {run['leaks']}")
    return {
        "ttft_ms": run["ttft_ms"]["p50"],
        "ttft_decode_ms": run["ttft_decode_p50_ms"],
        "uncached_itps": run["uncached_itps"],
    }


def layer_wire_ms(a, gbps: float, prompt_len: int) -> float:
    """One layer's KV of a prompt on the link: its bytes at `gbps`, plus the latency."""
    args = server(a, "layer", gbps, prompt_len)
    link = transfer_link_for(args.link_config(), args.worker_device)
    return prompt_len * link.kv_bytes_per_token * 8 / (gbps * 1e9) * 1e3 + link.latency_us / 1e3


def run_rounds(a) -> dict:
    lens = [int(x) for x in a.prompt_lens.split(",")]
    speeds = [float(x) for x in a.link_gbps.split(",")]
    points = {(g, n): {c: [] for c in CONFIGS} for g in speeds for n in lens}
    itps = {c: [] for c in ("whole", "layer")}
    for r in range(a.repeats):
        for (gbps, n), figures in points.items():
            work = random_prompts(a.ttft_requests, n, seed=r)
            for c in CONFIGS:
                print(f"round {r + 1}/{a.repeats}: {n} tokens, {gbps} Gb/s, {c}", file=sys.stderr)
                figures[c].append(one_run(a, c, gbps, work, n, 1))
        work = random_prompts(a.itps_requests, a.itps_prompt_len, seed=100 + r)
        for c in itps:
            print(f"round {r + 1}/{a.repeats}: ITPS, {c}", file=sys.stderr)
            itps[c].append(one_run(a, c, speeds[0], work, a.itps_prompt_len, None))
    return summarize(a, points, itps)


def summarize(a, points: dict, itps: dict) -> dict:
    rows = []
    for (gbps, n), figures in points.items():
        own = statistics.median(f["ttft_ms"] for f in figures["own"])
        whole = statistics.median(f["ttft_decode_ms"] for f in figures["whole"])
        layer = statistics.median(f["ttft_decode_ms"] for f in figures["layer"])
        wire = layer_wire_ms(a, gbps, n)
        rows.append(
            {
                "prompt_len": n,
                "link_gbps": gbps,
                "own_ms": own,
                "whole_ms": whole,
                "layer_ms": layer,
                "speedup": whole / layer,
                "bound_ms": own + wire + 2.0,
                "layer_wire_ms": wire,
                "trials": figures,
            }
        )
    whole_itps = statistics.median(f["uncached_itps"] for f in itps["whole"])
    layer_itps = statistics.median(f["uncached_itps"] for f in itps["layer"])
    return {
        "emulate_model": a.emulate_model,
        "emulate_gpu": a.emulate_gpu,
        "mode": a.mode,
        "repeats": a.repeats,
        "ttft": rows,
        "itps": {
            "prompt_len": a.itps_prompt_len,
            "requests": a.itps_requests,
            "whole": whole_itps,
            "layer": layer_itps,
            "layer_over_whole": layer_itps / whole_itps,
            "trials": itps,
        },
    }


def report(s: dict) -> None:
    print(f"{s['emulate_model']} on the emulated {s['emulate_gpu']}, {s['mode']}, medians of")
    print(f"{s['repeats']}; TTFT at the decode (ms), one request at a time:")
    head = "prompt  Gb/s   own   whole   layer  whole/layer  bound  layer<=bound"
    print(head)
    for r in s["ttft"]:
        ok = "yes" if r["layer_ms"] <= r["bound_ms"] else "no"
        print(
            f"{r['prompt_len']:>6} {r['link_gbps']:>5.0f} {r['own_ms']:>6.1f} {r['whole_ms']:>7.1f}"
            f" {r['layer_ms']:>7.1f} {r['speedup']:>11.2f}x {r['bound_ms']:>6.1f}  {ok}"
        )
    i = s["itps"]
    print(
        f"uncached ITPS, {i['requests']} x {i['prompt_len']} tokens at once: whole"
        f" {i['whole']:.0f}, layer {i['layer']:.0f} ({i['layer_over_whole']:.3f}x)"
    )


def plot(s: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for gbps in sorted({r["link_gbps"] for r in s["ttft"]}):
        rows = [r for r in s["ttft"] if r["link_gbps"] == gbps]
        lens = [r["prompt_len"] for r in rows]
        ax.plot(lens, [r["whole_ms"] for r in rows], "o-", label=f"whole pages, {gbps:.0f} Gb/s")
        ax.plot(lens, [r["layer_ms"] for r in rows], "s-", label=f"layer-wise, {gbps:.0f} Gb/s")
    rows = [r for r in s["ttft"] if r["link_gbps"] == s["ttft"][0]["link_gbps"]]
    lens = [r["prompt_len"] for r in rows]
    ax.plot(lens, [r["own_ms"] for r in rows], "k--", label="the prefill's own time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT at the decode (ms, median)")
    ax.set_title(f"{s['emulate_model']}, emulated {s['emulate_gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    s = run_rounds(a)
    report(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    if a.plot:
        plot(s, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The whole bench: workload, one run per mode, the forward bound, the table and the JSON."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

from mpprefill.bench.regime import of_bound, plot_regime_map
from mpprefill.bench.replay import forward_bound, load_shapes
from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import Workload, solve_for_hit_rate
from mpprefill.config import FORWARD_MODES, ServerArgs
from mpprefill.flags import from_namespace

THREAD_MODES = ("thread", "thread-ahead")


def server_args(args: argparse.Namespace, **overrides) -> ServerArgs:
    """The serve flags of a bench/profile command line (the mode comes per run)."""
    overrides = {"forward_mode": None, "trace_dir": None, **overrides}
    return from_namespace(ServerArgs, args, **overrides)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in FORWARD_MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad}; choose from {FORWARD_MODES}")
    return modes


def make_workload(args: argparse.Namespace, page_size: int) -> Workload:
    return solve_for_hit_rate(
        args.hit_rate,
        args.num_requests,
        args.prompt_len,
        page_size,
        request_rate=args.request_rate,
        seed=args.seed,
    )


def run_bench(
    args: argparse.Namespace, server: ServerArgs | None = None, label: str = "default"
) -> dict:
    server = server or server_args(args)
    modes = parse_modes(args.modes)
    work = make_workload(args, server.page_size)
    cfg = BenchConfig(server, modes, trace_dir=args.trace_dir, verify=args.verify)
    bound_mode = args.bound_mode if args.bound_mode in modes else modes[-1]
    record = os.path.join(cfg.log_dir, "batches.json")
    print(
        f"[{label}] {len(work)} requests, {work.num_prompt_tokens} prompt tokens, hit rate "
        f"target {args.hit_rate:.2f} (workload's own {work.expected_hit_rate:.3f}); "
        f"logs in {cfg.log_dir}",
        file=sys.stderr,
    )
    repeats = max(1, args.repeats)
    fronts = ("zmq", "http") if args.front == "http" else ("zmq",)
    trials: dict[tuple[str, str], list[dict]] = {(m, f): [] for m in modes for f in fronts}
    bounds = []
    for _ in range(repeats):  # modes interleaved, so drift in the machine hits all alike
        for m in modes:
            for f in fronts:
                bound_run = m == bound_mode and f == "zmq"
                run = run_mode(cfg, m, work, record if bound_run else None, front=f)
                trials[m, f].append(run)
                if bound_run:
                    bounds.append(_bound(record, run, server))
    runs = [_median_run(trials[m, "zmq"]) for m in modes]
    bound = sorted(bounds, key=lambda b: b["itps"])[len(bounds) // 2]
    result = {
        "label": label,
        "config": _config(args, server, work, label),
        "forward_bound_itps": bound["itps"],
        "forward_bound": bound,
        "runs": runs,
    }
    if "http" in fronts:
        result["http_runs"] = [_median_run(trials[m, "http"]) for m in modes]
        result["front_cost"] = front_cost(runs, result["http_runs"])
    print(format_table(result))
    return result


def front_cost(zmq_runs: list[dict], http_runs: list[dict]) -> list[dict]:
    """Per mode, the median runs' uncached ITPS through the HTTP front against ZeroMQ."""
    return [
        {
            "mode": z["mode"],
            "zmq_itps": z["uncached_itps"],
            "http_itps": h["uncached_itps"],
            "http_over_zmq": h["uncached_itps"] / z["uncached_itps"],
            "ttft_p50_ms": {"zmq": z["ttft_ms"]["p50"], "http": h["ttft_ms"]["p50"]},
        }
        for z, h in zip(zmq_runs, http_runs)
    ]


def _gap(run: dict) -> str:
    """The median hand-off gap; "-" where no batch was ready before the forward ended."""
    return f"{run['handoff_gap_ms']:.2f}m" if run.get("handoff_batches") else "-"


def _median_run(trials: list[dict]) -> dict:
    """The run with the median uncached ITPS, plus every trial's figure."""
    ordered = sorted(trials, key=lambda r: r["uncached_itps"])
    run = dict(ordered[len(ordered) // 2])
    run["uncached_itps_trials"] = [r["uncached_itps"] for r in trials]
    run["trials"] = run["uncached_itps_trials"]  # the contract's name for them
    run["leaks"] = {**run["leaks"], "ok": all(r["leaks"]["ok"] for r in trials)}
    return run


def _bound(record: str, run: dict, server: ServerArgs) -> dict:
    shapes = load_shapes(record)[run["warmup_batches"] :]
    return {**forward_bound(shapes, server), "replayed_mode": run["mode"]}


def _config(args, server: ServerArgs, work: Workload, label: str) -> dict:
    return {
        "label": label,
        "server": dataclasses.asdict(server),
        "workload": work.to_dict() | {"target_hit_rate": args.hit_rate},
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "request_rate": args.request_rate,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
    }


def format_table(result: dict) -> str:
    runs, bound = result["runs"], result["forward_bound_itps"]
    threads = [r["uncached_itps"] for r in runs if r["mode"] in THREAD_MODES]
    best_thread = max(threads) if threads else None
    head = (
        f"{'mode':>12} {'uncached ITPS':>13} {'x thread':>8} {'x bound':>7} {'hit':>5} "
        f"{'TTFT p50/p99 ms':>16} {'batches':>7} {'t_sched':>8} {'t_issue':>8} "
        f"{'t_device':>8} {'dev busy':>8} {'gap':>7} {'leaks':>5}"
    )
    device = runs[0].get("device", "cpu") if runs else "cpu"
    lines = [f"device: {device}", head, "-" * len(head)]
    for r in runs:
        xt = f"{r['uncached_itps'] / best_thread:8.2f}" if best_thread else f"{'-':>8}"
        lines.append(
            f"{r['mode']:>12} {r['uncached_itps']:13,.0f} {xt} "
            f"{r['uncached_itps'] / bound:7.2f} {r['cache_hit_rate']:5.2f} "
            f"{r['ttft_ms']['p50']:7.0f}/{r['ttft_ms']['p99']:<8.0f} "
            f"{r['num_batches']:7d} {r['t_sched_ms']:7.2f}m {r['t_issue_ms']:7.2f}m "
            f"{r['t_device_ms']:7.2f}m {r['device_busy_frac']:8.2f} "
            f"{_gap(r):>7} {'ok' if r['leaks']['ok'] else 'LEAK':>5}"
        )
    lines.append(
        f"forward bound ({result['forward_bound']['replayed_mode']} batches replayed "
        f"back to back): {bound:,.0f} uncached tokens/s; times are ms per batch, gap is the "
        "median hand-off gap"
    )
    lines += _collective_lines(result)
    for c in result.get("front_cost", []):
        lines.append(
            f"HTTP front, {c['mode']}: {c['http_itps']:,.0f} uncached ITPS against "
            f"{c['zmq_itps']:,.0f} on ZeroMQ (x{c['http_over_zmq']:.3f}); TTFT p50 "
            f"{c['ttft_p50_ms']['http']:.0f} ms against {c['ttft_p50_ms']['zmq']:.0f} ms"
        )
    return "\n".join(lines)


def _collective_lines(result: dict) -> list[str]:
    """Per mode, the collectives' share of device time (emulated tensor parallel only)."""
    server = result["config"]["server"]
    if server["device"] != "emulated" or server["tp_size"] == 1:
        return []
    return [
        f"TP {server['tp_size']} collectives, {r['mode']}: {r['collective_share']:.1%} of device "
        f"time ({r['t_collective_ms']:.2f} of {r['t_device_ms']:.2f} ms per batch)"
        for r in result["runs"]
    ]


# ---- the t_sched / t_fwd sweep ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """A workload of the t_sched/t_fwd sweep: a model size and a batch shape."""

    model_dims: dict | None  # None: the built-in model
    chunk: int | None = None  # chunked prefill size; max prefill tokens is 4x
    prompt_len: int | None = None
    request_scale: int = 1  # smaller forwards need more requests for a run of some seconds


SWEEP_POINTS = {
    "default": SweepPoint(None),
    "small-model": SweepPoint(
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        256,
        512,
        4,
    ),
    "micro-model": SweepPoint(
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        64,
        256,
        8,
    ),
}


# The regime map on the emulated accelerator: model shapes x per-batch token budgets.
EMULATED_MODELS = ("Qwen2.5-0.5B", "Llama-3.1-8B")
EMULATED_CHUNKS = (512, 8192)
BIG_CHUNK_REQUEST_SCALE = 2  # an 8k-token budget takes ~40 requests a batch
# The cache must hold every group's shared prompt and the suffixes in flight, or the hit
# rate falls below the target at thousands of requests.
EMULATED_POOL_TOKENS = 1 << 19


def run_sweep(args: argparse.Namespace) -> dict:
    base = server_args(args)
    if base.device == "emulated":
        points = [
            _emulated_point(args, base, m, c) for m in EMULATED_MODELS for c in EMULATED_CHUNKS
        ]
    else:
        model_dir = tempfile.mkdtemp(prefix="mpp-sweep-models-")
        points = [
            (label, *_sweep_point(args, base, label, point, model_dir))
            for label, point in SWEEP_POINTS.items()
        ]
    results = [run_bench(ns, server, label=label) for label, ns, server in points]
    print(format_sweep(results))
    if args.heatmap and base.device == "emulated":
        plot_regime_map(results, args.heatmap)
        print(f"regime map: {args.heatmap}", file=sys.stderr)
    return {"points": results}


def _emulated_point(args, base: ServerArgs, model: str, chunk: int):
    ns = argparse.Namespace(**vars(args))
    if chunk >= 4096:
        ns.num_requests = args.num_requests * BIG_CHUNK_REQUEST_SCALE
    server = dataclasses.replace(
        base,
        emulate_model=model,
        chunked_prefill_size=chunk,
        max_prefill_tokens=chunk,
        max_total_tokens=max(base.max_total_tokens, EMULATED_POOL_TOKENS),
    )
    return f"{model}@{chunk}", ns, server


def _sweep_point(args, base: ServerArgs, label: str, point: SweepPoint, model_dir: str):
    from mpprefill.model import ModelConfig
    from mpprefill.model.export import save_random_model

    ns = argparse.Namespace(**vars(args))
    if point.model_dims is None:
        return ns, base
    path = save_random_model(
        dataclasses.replace(ModelConfig.tiny(), **point.model_dims),
        os.path.join(model_dir, label),
        seed=base.random_seed,
    )
    ns.prompt_len = point.prompt_len
    ns.num_requests = args.num_requests * point.request_scale
    server = dataclasses.replace(
        base, model_path=path, chunked_prefill_size=point.chunk, max_prefill_tokens=point.chunk * 4
    )
    return ns, server


def format_sweep(results: list[dict]) -> str:
    lines = [
        "",
        "per point and mode (ms per batch; busy: device busy fraction; gap: median hand-off gap;"
        " of bnd: proc-ahead's uncached ITPS over its bound, max(device, issue, t_sched) a batch):",
        f"{'point':>20} {'mode':>12} {'uncached ITPS':>13} {'t_issue':>8} {'t_device':>8} "
        f"{'t_sched':>8} {'busy':>5} {'gap':>6} {'of bnd':>6} {'pa/this':>7}",
    ]
    for res in results:
        by = {r["mode"]: r for r in res["runs"]}
        pa = by.get("proc-ahead")
        for r in res["runs"]:
            lines.append(
                f"{res['config']['label']:>20} {r['mode']:>12} {r['uncached_itps']:13,.0f} "
                f"{r['t_issue_ms']:8.2f} {r['t_device_ms']:8.2f} {r['t_sched_ms']:8.2f} "
                f"{r['device_busy_frac']:5.2f} {_gap(r):>6} {_of_bound(r):>6} {_rel(pa, r):>7}"
            )
    return "\n".join(lines)


def _of_bound(run: dict) -> str:
    if run["mode"] != "proc-ahead" or not run["num_batches"] or not run["uncached_tokens"]:
        return "-"
    return f"{of_bound(run):.2f}"


def _rel(run: dict | None, other: dict) -> str:
    if run is None:
        return "-"
    return f"{run['uncached_itps'] / other['uncached_itps']:.2f}"

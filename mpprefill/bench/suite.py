"""The whole bench: workload, one run per mode, the forward bound, the table and the JSON."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import tempfile

from mpprefill.bench.regime import of_bound, plot_sensitivity_maps, run_of
from mpprefill.bench.replay import forward_bound, load_shapes
from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.workload import Workload, solve_for_hit_rate
from mpprefill.config import ServerArgs
from mpprefill.flags import from_namespace
from mpprefill.modes import FORWARD_MODES, MODES


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


@dataclasses.dataclass
class _Point:
    """One workload of a bench or sweep: its runs so far, trial by trial."""

    label: str
    args: argparse.Namespace
    server: ServerArgs
    modes: list[str]
    work: Workload
    cfg: BenchConfig
    bound_mode: str
    fronts: tuple[str, ...]
    trials: dict[tuple[str, str], list[dict]]
    bounds: list[dict] = dataclasses.field(default_factory=list)
    host_op_us: list[float] = dataclasses.field(default_factory=list)  # a probe per round

    @property
    def record(self) -> str:
        return os.path.join(self.cfg.log_dir, "batches.json")


def _prepare(args: argparse.Namespace, server: ServerArgs, label: str) -> _Point:
    modes = parse_modes(args.modes)
    work = make_workload(args, server.page_size)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    cfg = BenchConfig(
        server,
        modes,
        trace_dir=args.trace_dir,
        verify=args.verify,
        max_concurrency=args.max_concurrency,
    )
    fronts = ("zmq", "http") if args.front == "http" else ("zmq",)
    print(
        f"[{label}] {len(work)} requests, {work.num_prompt_tokens} prompt tokens, hit rate "
        f"target {args.hit_rate:.2f} (workload's own {work.expected_hit_rate:.3f}); "
        f"logs in {cfg.log_dir}",
        file=sys.stderr,
    )
    return _Point(
        label,
        args,
        server,
        modes,
        work,
        cfg,
        args.bound_mode if args.bound_mode in modes else modes[-1],
        fronts,
        {(m, f): [] for m in modes for f in fronts},
    )


def _run_round(pt: _Point) -> None:
    """One trial of every mode (and front), in order, after a probe of the host's speed."""
    pt.host_op_us.append(host_op_us())
    for m in pt.modes:
        for f in pt.fronts:
            bound_run = m == pt.bound_mode and f == "zmq"
            run = run_mode(pt.cfg, m, pt.work, pt.record if bound_run else None, front=f)
            pt.trials[m, f].append(run)
            if bound_run:
                pt.bounds.append(_bound(pt.record, run, pt.server))


def _finish(pt: _Point) -> dict:
    runs = [_median_run(pt.trials[m, "zmq"]) for m in pt.modes]
    bound = sorted(pt.bounds, key=lambda b: b["itps"])[len(pt.bounds) // 2]
    result = {
        "label": pt.label,
        "config": _config(pt.args, pt.server, pt.work, pt.label)
        | {"host_op_us": _spread(pt.host_op_us)},
        "forward_bound_itps": bound["itps"],
        "forward_bound": bound,
        "runs": runs,
    }
    if "http" in pt.fronts:
        result["http_runs"] = [_median_run(pt.trials[m, "http"]) for m in pt.modes]
        result["front_cost"] = front_cost(runs, result["http_runs"])
    print(format_table(result))
    return result


def run_bench(
    args: argparse.Namespace, server: ServerArgs | None = None, label: str = "default"
) -> dict:
    """Every mode `--repeats` times, the modes interleaved so that drift in the machine
    hits all alike; each mode's median run."""
    pt = _prepare(args, server or server_args(args), label)
    for _ in range(max(1, args.repeats)):
        _run_round(pt)
    return _finish(pt)


def _run_points(points: list[_Point], repeats: int) -> list[dict]:
    """Trials interleaved across points as well as modes: round r runs every point's
    modes once, so the points' medians span the same stretch of the machine's time."""
    for r in range(repeats):
        for i, pt in enumerate(points):
            print(
                f"round {r + 1}/{repeats}, point {i + 1}/{len(points)}: {pt.label}", file=sys.stderr
            )
            _run_round(pt)
    return [_finish(pt) for pt in points]


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


def _decode_ttft(run: dict) -> str:
    """TTFT at the decode, p50/p99 ms; "-" where no decode server answered."""
    p50, p99 = run.get("ttft_decode_p50_ms"), run.get("ttft_decode_p99_ms")
    return "-" if p50 is None else f"{p50:.1f}/{p99:.1f}"


def _median_run(trials: list[dict]) -> dict:
    """The run with the median uncached ITPS, plus every trial's figure."""
    ordered = sorted(trials, key=lambda r: r["uncached_itps"])
    run = dict(ordered[len(ordered) // 2])
    run["uncached_itps_trials"] = [r["uncached_itps"] for r in trials]
    run["trials"] = run["uncached_itps_trials"]  # the contract's name for them
    run["ttft_decode_p50_ms_trials"] = [r.get("ttft_decode_p50_ms") for r in trials]
    run["leaks"] = {**run["leaks"], "ok": all(r["leaks"]["ok"] for r in trials)}
    return run


def _bound(record: str, run: dict, server: ServerArgs) -> dict:
    shapes = load_shapes(record)[run["warmup_batches"] :]
    return {**forward_bound(shapes, server), "replayed_mode": run["mode"]}


# The probe: tiny torch ops, timed as the emulated forward's host stand-in issues them.
PROBE_OPS = 2000
PROBE_REPEATS = 5


def host_op_us() -> float:
    """Microseconds one tiny torch op takes from Python on this machine now (the median of
    PROBE_REPEATS timings of PROBE_OPS adds of 32 floats): the unit of the emulated host
    issue, so that figures taken on different days can be put side by side."""
    import time

    import torch

    a, b, out = torch.ones(32), torch.ones(32), torch.empty(32)
    took = []
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        for _ in range(PROBE_OPS):
            torch.add(a, b, out=out)
        took.append((time.perf_counter() - start) / PROBE_OPS * 1e6)
    return sorted(took)[len(took) // 2]


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1]}


def _config(args, server: ServerArgs, work: Workload, label: str) -> dict:
    return {
        "label": label,
        "server": dataclasses.asdict(server),
        "emulated": server.worker_device.emulated,
        "workload": work.to_dict() | {"target_hit_rate": args.hit_rate},
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "request_rate": args.request_rate,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
    }


def format_table(result: dict) -> str:
    runs, bound = result["runs"], result["forward_bound_itps"]
    threads = [r["uncached_itps"] for r in runs if MODES[r["mode"]].on_thread]
    best_thread = max(threads) if threads else None
    head = (
        f"{'mode':>12} {'uncached ITPS':>13} {'x thread':>8} {'x bound':>7} {'hit':>5} "
        f"{'TTFT p50/p99 ms':>16} {'at decode p50/p99':>17} {'batches':>7} {'t_sched':>8} "
        f"{'t_issue':>8} {'t_device':>8} {'dev busy':>8} {'gap':>7} {'leaks':>5}"
    )
    device = runs[0].get("device", "cpu") if runs else "cpu"
    lines = [f"device: {device}", head, "-" * len(head)]
    for r in runs:
        xt = f"{r['uncached_itps'] / best_thread:8.2f}" if best_thread else f"{'-':>8}"
        lines.append(
            f"{r['mode']:>12} {r['uncached_itps']:13,.0f} {xt} "
            f"{r['uncached_itps'] / bound:7.2f} {r['cache_hit_rate']:5.2f} "
            f"{r['ttft_ms']['p50']:7.0f}/{r['ttft_ms']['p99']:<8.0f} {_decode_ttft(r):>17} "
            f"{r['num_batches']:7d} {r['t_sched_ms']:7.2f}m {r['t_issue_ms']:7.2f}m "
            f"{r['t_device_ms']:7.2f}m {r['device_busy_frac']:8.2f} "
            f"{_gap(r):>7} {'ok' if r['leaks']['ok'] else 'LEAK':>5}"
        )
    lines.append(
        f"forward bound ({result['forward_bound']['replayed_mode']} batches replayed "
        f"back to back): {bound:,.0f} uncached tokens/s; times are ms per batch, gap is the "
        "median hand-off gap"
    )
    probe = result["config"].get("host_op_us")
    if probe:
        lines.append(
            f"host speed: {probe['median']:.2f} us a tiny torch op from Python (probe before "
            f"each round: {probe['min']:.2f}-{probe['max']:.2f})"
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
    if not result["config"].get("emulated") or server["tp_size"] == 1:
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


# The sensitivity map on the emulated accelerator: model shapes x per-batch token budgets x
# host launch costs (x GIL switch intervals), by default.
EMULATED_MODELS = ("Qwen2.5-0.5B", "Llama-3.1-8B", "Qwen3-30B-A3B")
EMULATED_CHUNKS = (512, 4096, 16384)
# Requests of a point: --num-requests, times one per 2,048 tokens of the budget, so each
# point runs some tens of batches (~5 requests make 1,000 uncached tokens at hit rate 0.8).
REQUEST_SCALE_TOKENS = 2048
# The cache must hold every group's shared prompt and the suffixes in flight, or the hit
# rate falls below the target at thousands of requests.
EMULATED_POOL_TOKENS = 1 << 20


def run_sweep(args: argparse.Namespace) -> dict:
    base = server_args(args)
    if base.worker_device.emulated:
        points = [_prepare(ns, server, label) for label, ns, server in _emulated_points(args, base)]
        results = _run_points(points, max(1, args.repeats))
    else:
        model_dir = tempfile.mkdtemp(prefix="mpp-sweep-models-")
        points = [
            (label, *_sweep_point(args, base, label, point, model_dir))
            for label, point in SWEEP_POINTS.items()
        ]
        results = [run_bench(ns, server, label=label) for label, ns, server in points]
    print(format_sweep(results))
    if any(r.get("ttft_decode_p50_ms") is not None for res in results for r in res["runs"]):
        print(format_decode_ttft(results))
    if args.heatmap and base.worker_device.emulated:
        written = plot_sensitivity_maps(results, args.heatmap)
        print(f"sensitivity maps: {', '.join(written)}", file=sys.stderr)
    return {"points": results}


def _list(text: str | None, cast, default: tuple) -> list:
    if not text:
        return list(default)
    try:
        return [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"not a comma-separated list: {text!r} ({e})") from None


def _emulated_points(args, base: ServerArgs) -> list[tuple[str, argparse.Namespace, ServerArgs]]:
    models = _list(args.sweep_models, str, EMULATED_MODELS)
    chunks = _list(args.sweep_chunks, int, EMULATED_CHUNKS)
    launches = _list(args.sweep_launch_us, float, (base.emulate_launch_us,))
    switches = _list(args.sweep_switch_ms, float, (base.switch_interval_ms,))
    prompts = _list(args.sweep_prompt_lens, int, (args.prompt_len,))
    links = _list(args.sweep_link_gbps, _gbps, (base.emulate_link_gbps,))
    out = []
    grid = itertools.product(models, chunks, launches, switches, prompts, links)
    for model, chunk, launch, switch, prompt_len, gbps in grid:
        ns = argparse.Namespace(**vars(args))
        ns.num_requests = args.num_requests * max(1, chunk // REQUEST_SCALE_TOKENS)
        ns.prompt_len = prompt_len
        server = dataclasses.replace(
            base,
            emulate_model=model,
            chunked_prefill_size=chunk,
            max_prefill_tokens=chunk,
            max_total_tokens=max(base.max_total_tokens, EMULATED_POOL_TOKENS),
            emulate_launch_us=launch,
            switch_interval_ms=switch,
            emulate_link_gbps=gbps,
        )
        label = f"{model}@{chunk}, {launch:g} us/launch, switch {switch:g} ms"
        if args.sweep_prompt_lens:
            label += f", {prompt_len} tokens"
        if gbps is not None:
            label += f", link {gbps:g} Gb/s"
        out.append((label, ns, server))
    return out


def _gbps(text: str) -> float | None:
    """A link speed of --sweep-link-gbps; "none": no emulated link."""
    return None if text == "none" else float(text)


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
        f"{'point':>20} {'mode':>12} {'uncached ITPS':>13} {'trials min-max':>17} {'t_issue':>8} "
        f"{'t_device':>8} {'t_sched':>8} {'busy':>5} {'gap':>6} {'of bnd':>6} {'pa/this':>7}",
    ]
    for res in results:
        pa = run_of(res, "proc-ahead")
        for r in res["runs"]:
            lines.append(
                f"{res['config']['label']:>20} {r['mode']:>12} {r['uncached_itps']:13,.0f} "
                f"{min(r['trials']):8,.0f}-{max(r['trials']):<8,.0f} {r['t_issue_ms']:8.2f} "
                f"{r['t_device_ms']:8.2f} {r['t_sched_ms']:8.2f} "
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


def format_decode_ttft(results: list[dict]) -> str:
    """TTFT at the decode per point and mode: the median over the trials of each trial's
    p50, the median run's p99, and every trial's p50."""
    lines = [
        "",
        "TTFT at the decode (request sent to the prefill -> the decode sends the first token),"
        " ms; p50: median of the trials' p50s:",
        f"{'prompt':>7} {'link Gb/s':>9} {'mode':>12} {'p50':>9} {'p99':>9}  {'trials p50':<40}"
        "  point",
    ]
    for res in results:
        gbps = res["config"]["server"].get("emulate_link_gbps")
        for r in res["runs"]:
            p50s = [t for t in r.get("ttft_decode_p50_ms_trials", []) if t is not None]
            if not p50s:
                continue
            trials = " / ".join(f"{t:.1f}" for t in p50s)
            lines.append(
                f"{res['config']['prompt_len']:7d} {'-' if gbps is None else f'{gbps:g}':>9} "
                f"{r['mode']:>12} {statistics.median(p50s):9.1f} {r['ttft_decode_p99_ms']:9.1f}"
                f"  {trials:<40}  {res['config']['label']}"
            )
    return "\n".join(lines)

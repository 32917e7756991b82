"""`mpprefill bench` and `mpprefill profile`."""

from __future__ import annotations

import argparse
import json
import logging
import os

from mpprefill.cli import command
from mpprefill.config import FORWARD_MODES, ServerArgs
from mpprefill.flags import add_flags

logger = logging.getLogger(__name__)
_NOT_BENCH_FLAGS = (
    "host",
    "port",
    "zmq_port",
    "disable_http_front",
    "tokenizer_path",
    "skip_tokenizer_init",
    "served_model_name",
    "chat_template",
    "api_key",
    "zmq_host",
    "forward_mode",
    "decode_address",
    "trace_dir",
    "record_batches",
    "check_invariants",
    "disable_overlap_schedule",
)
BENCH_DEFAULTS = dict(
    disaggregation_transfer_backend="shm",
    max_total_tokens=65536,
    worker_threads=max(1, (os.cpu_count() or 2) - 1),
)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument(
        "--hit-rate",
        type=float,
        default=0.8,
        help="target fraction of prompt tokens served from the prefix cache",
    )
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (inf: all at once)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default=None, help="write Chrome traces per mode here")
    ap.add_argument(
        "--verify",
        action="store_true",
        help="the decode receiver recomputes and checks every request's KV",
    )
    add_flags(ap, ServerArgs, skip=_NOT_BENCH_FLAGS)
    ap.set_defaults(**BENCH_DEFAULTS)


def _bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--modes", default=",".join(FORWARD_MODES), help="comma-separated forward modes"
    )
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="run a grid of workloads: with --device emulated the regime map (model shapes x"
        " per-batch token budgets), else other model sizes and batch shapes on the CPU",
    )
    ap.add_argument(
        "--heatmap",
        default=None,
        help="with --sweep --device emulated: write the proc-ahead / thread-ahead sensitivity"
        " map (PNG) here, and proc-ahead / overlap beside it (_overlap before the suffix)",
    )
    for name, what in (
        ("models", "emulated models (presets or config.json paths)"),
        ("chunks", "per-batch token budgets (chunked prefill size = max prefill tokens)"),
        ("launch-us", "host launch costs, us per kernel (default: --emulate-launch-us)"),
        ("switch-ms", "GIL switch intervals, ms (default: --switch-interval-ms)"),
        ("prompt-lens", "prompt lengths in tokens (default: --prompt-len)"),
        ("link-gbps", "emulated link speeds, Gb/s, none: no link (default: --emulate-link-gbps)"),
    ):
        ap.add_argument(
            f"--sweep-{name}",
            default=None,
            help=f"with --sweep --device emulated: comma-separated {what}",
        )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per mode, interleaved across modes; the median run is reported",
    )
    ap.add_argument(
        "--front",
        choices=("zmq", "http"),
        default="zmq",
        help="http: run each mode through serve's HTTP front too, interleaved with its ZeroMQ"
        " run, and report the front's cost in uncached ITPS",
    )
    ap.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests unanswered at once; one that arrives over it waits"
        " for an answer (default: no limit; 1 times each request alone)",
    )
    ap.add_argument(
        "--bound-mode",
        default="proc-ahead",
        help="the mode whose batches are replayed for the forward bound",
    )
    add_workload_args(ap)


@command("bench", "uncached ITPS of the forward modes on one workload", _bench_args)
def bench(args: argparse.Namespace) -> int:
    from mpprefill.bench.suite import run_bench, run_sweep

    try:
        result = run_sweep(args) if args.sweep else run_bench(args)
    except ValueError as e:
        raise SystemExit(f"mpprefill bench: {e}") from None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        logger.info("wrote %s", args.json)
    bad = run_problems(result)
    for line in bad:
        logger.error("%s", line)
    return 1 if bad else 0


def run_problems(result: dict) -> list[str]:
    """Runs that failed requests, leaked, broke an invariant or sent KV the decode side
    could not verify: the numbers of such a run mean nothing."""
    runs = [r for res in result.get("points", [result]) for r in res["runs"]]
    out = []
    runs += [r for res in result.get("points", [result]) for r in res.get("http_runs", [])]
    for r in runs:
        what = [f"{r['num_failed']} failed requests"] if r["num_failed"] else []
        what += [f"{r['num_unverified']} replies failed --verify"] if r["num_unverified"] else []
        what += [f"leaks/invariants {r['leaks']}"] if not r["leaks"]["ok"] else []
        if what:
            out.append(f"{r['mode']}: " + "; ".join(what))
    return out


def _profile_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--forward-mode", default="proc-ahead", help="a mode, a comma-separated list, or 'all'"
    )
    ap.add_argument("--out-dir", default="profile", help="traces, summary and timeline PNG")
    ap.add_argument(
        "--iterations", type=int, default=4, help="steady-state iterations shown in the timeline"
    )
    add_workload_args(ap)
    ap.set_defaults(num_requests=96)


@command("profile", "trace one or more modes: overlap summary and a timeline PNG", _profile_args)
def profile(args: argparse.Namespace) -> int:
    from mpprefill.bench.profile import run_profile

    return run_profile(args)

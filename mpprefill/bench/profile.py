"""`mpprefill profile`: run modes with tracing, merge traces, summarise overlap, draw."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from mpprefill.bench.runner import BenchConfig, run_mode
from mpprefill.bench.suite import make_workload, parse_modes, server_args
from mpprefill.config import FORWARD_MODES
from mpprefill.trace import chrome, draw_timeline, summarize


def run_profile(args: argparse.Namespace) -> int:
    modes = list(FORWARD_MODES) if args.forward_mode == "all" else parse_modes(args.forward_mode)
    out_dir = os.path.abspath(args.out_dir)
    raw_dir = os.path.join(out_dir, "raw")
    server = server_args(args)
    work = make_workload(args, server.page_size)
    cfg = BenchConfig(server, modes, trace_dir=raw_dir, verify=args.verify)
    merged, report = {}, {}
    for mode in modes:
        run = run_mode(cfg, mode, work)
        dumps = sorted(glob.glob(os.path.join(raw_dir, mode, "*.trace.json")))
        if not dumps:
            raise SystemExit(f"mode {mode}: no trace dumps in {raw_dir}/{mode}")
        merged[mode] = str(chrome.merge(dumps, os.path.join(out_dir, f"{mode}.trace.json")))
        summary = summarize(merged[mode])
        report[mode] = {"summary": summary.to_dict(), "run": run}
        print(
            f"\n== {mode}: uncached ITPS {run['uncached_itps']:,.0f}, "
            f"trace {merged[mode]}\n{summary.format()}\n"
            f"per batch: hand-off gap {run['handoff_gap_ms']:.2f} ms (median), "
            f"t_sched {run['t_sched_ms']:.2f} ms, t_issue {run['t_issue_ms']:.2f} ms, "
            f"t_device {run['t_device_ms']:.2f} ms; device busy {run['device_busy_frac']:.2f}"
            f" ({run['device']})"
        )
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(report, f, indent=1)
    _draw(merged, os.path.join(out_dir, "timeline.png"), args.iterations)
    return 0


def _draw(merged: dict[str, str], png: str, iterations: int) -> None:
    try:
        draw_timeline(
            merged, png, window=iterations, title="scheduler and worker lanes, steady state"
        )
        print(f"\ntimeline: {png}")
    except ImportError as e:
        print(f"\nno timeline: {e}", file=sys.stderr)

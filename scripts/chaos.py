#!/usr/bin/env python3
"""Chaos run: `mpprefill serve` + `mpprefill decode` (shm) under load, with faults injected.

Two legs share the prefill. The ZeroMQ leg drives serve's socket and a decode receiver,
registering each room at the receiver and at serve's bootstrap endpoint
(--disaggregation-bootstrap-port), as a decode server does. The router leg sends a
fraction of the normal and burst load (--router-fraction) through SGLang's router in PD mode
(`python -m sglang_router.launch_router --pd-disaggregation`, retries and circuit breaker
off) in front of serve's HTTP front and a generating `mpprefill decode`, greedy, 1 to 8 new
tokens, half of them streamed; it is skipped, with the reason, where sglang_router is not
importable.

Faults, all seeded: aborts aimed at each stage (waiting, bootstrapping, mid-chunk,
transfer), malformed and hostile frames, the decode receiver SIGKILLed and restarted,
slow transfers (the decode's test delay, injected by tests/slow_decode.py: run this from
the repository root), a burst that overfills the small KV pool and the request queue, and
near the end a SIGKILL of the forward process (of one rank, chosen by the seed, with
--tp-size N); with --disaggregation-layerwise-send all of it while KV leaves layer by layer.

It then checks: every request got exactly one reply; every done reply's first token is the
offline normal-mode engine's, and each token of a router reply the engine's greedy token
after the prompt and the reply's tokens before it; every error is explained by a fault;
the bootstrap endpoint refused only rooms of failed requests; DESIGN.md's invariants hold
after the drain before the worker kill; no shared segment, no ipc:// socket file and no
HTTP front of the run is left. Exit status 0 only if every check passes.

`--restart-legs on` (after that run) or `only` (instead of it) adds the restart legs
(chaoslib/restarts.py): SGLang's router in PD mode with the README's recovery settings over
a prefill and two decodes, greedy requests flowing, a decode SIGKILLed and restarted on its
ports, then the prefill; every reply checked against the offline engine, the time to
recovery reported, and nothing left held by any server after the drain.

    python scripts/chaos.py --duration 60 --num-requests 1000 --seed 1
    python scripts/chaos.py --restart-legs only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from chaoslib import gateway, restarts
from chaoslib.run import ChaosRun

from mpprefill.bench.procs import RUNTIME_ENV
from mpprefill.config import FORWARD_MODES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (planned)")
    ap.add_argument("--num-requests", type=int, default=1000, help="generate requests sent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forward-mode", default="proc-ahead", choices=FORWARD_MODES)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=2048, help="prefill KV pool")
    ap.add_argument("--max-queued-requests", type=int, default=128)
    ap.add_argument("--window", type=int, default=48, help="outstanding requests outside bursts")
    ap.add_argument("--abort-p", type=float, default=0.08, help="requests that get an abort")
    ap.add_argument("--slow-p", type=float, default=0.05, help="requests with a slow transfer")
    ap.add_argument("--slow-ms", type=float, default=1500.0, help="how slow a slow transfer is")
    ap.add_argument(
        "--router-fraction",
        type=float,
        default=0.1,
        help="share of the normal and burst load sent through SGLang's router (0: no router leg)",
    )
    ap.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="forward processes of serve's tensor-parallel group; the kill near the end hits"
        " one rank, chosen by the seed",
    )
    ap.add_argument(
        "--host-store-size", type=int, default=0, help="serve's host KV tier in tokens (0: off)"
    )
    ap.add_argument(
        "--disaggregation-layerwise-send",
        action="store_true",
        help="serve sends each layer's KV as its forward writes it (the decode kill, slow"
        " transfers and aborts then land while layers are on their way)",
    )
    ap.add_argument("--sliding-window", type=int, help="make the model's layers slide")
    ap.add_argument("--swa-layers", help="which layers slide (as `mpprefill serve`)")
    ap.add_argument(
        "--restart-legs",
        default="off",
        choices=("off", "on", "only"),
        help="after the run (on) or instead of it (only): SIGKILL and restart a decode, then"
        " the prefill, behind SGLang's router in PD mode while requests flow",
    )
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--log-dir", help="server and decode logs (default: a temp dir)")
    return ap.parse_args(argv)


def report(s: dict) -> None:
    if "mode" in s:
        report_run(s)
    if "restart_legs" in s:
        report_legs(s["restart_legs"])
    for name, ok in s["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    for line in s["problems"][:20]:
        print(f"  problem: {line}")
    print("chaos: " + ("PASS" if s["ok"] else "FAIL"))


def report_run(s: dict) -> None:
    print(
        f"chaos: mode={s['mode']} seed={s['seed']} total={s['wall_s']:.1f}s "
        f"requests={s['requests']} hostile={s['hostile']['sent']}"
        f" layerwise_send={s['layerwise_send']}"
    )
    print("phases (s): " + _fmt(s["phases_s"]))
    print("faults injected: " + _fmt(s["faults"]))
    print("hostile frames by kind: " + _fmt(s["hostile"]["sent_by_kind"]))
    print("replies: " + _fmt(s["replies"]["counts"]))
    print("errors explained by: " + _fmt(s["replies"]["explained"]))
    print(
        f"tokens: {s['tokens']['checked']} done replies checked against "
        f"{s['tokens']['sequences']} offline sequences ({s['tokens']['prompts']} prompts), "
        f"near ties {s['tokens']['near_ties']}"
    )
    router = s["router"]
    if "skipped" in router:
        print(f"router leg: skipped ({router['skipped']})")
    else:
        print("router leg: " + _fmt({k: v for k, v in router.items() if k != "problems"}))
    print("bootstrap registrations: " + _fmt(s["registrations"]))
    print(f"invariants after drain: {s['invariants']}")
    print(f"server counters at the drain: {s['server_counters']}")
    print(f"exits: {s['exits']}")
    print(f"leaks: {s['leaks']}")


def report_legs(r: dict) -> None:
    if "skipped" in r:
        print(f"restart legs: skipped ({r['skipped']})")
        return
    print("restart legs, router flags: " + " ".join(r["router_flags"]))
    for name, leg in r["legs"].items():
        figures = {
            k: leg[k] for k in ("requests", "ok", "errors", "wrong", "timed_out", "recovery_s")
        }
        print(f"  {name} killed: " + _fmt(figures))
        print(f"    timeline (s from the kill): {_fmt(leg['timeline_s'])}")
        print(f"    error kinds: {leg['error_kinds'] or '-'}")
        print(f"    slowest reply sent after the kill: {leg['slowest_after_kill_s']} s")
        print(f"    held after the drain: {leg['held_after_drain']}")
        print(f"    survivors' segments {leg['segments_survivors']}, fds {leg['fds_survivors']}")


def _fmt(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(d.items())) or "-"


def with_restart_legs(summary: dict, args: argparse.Namespace, log_dir: str) -> dict:
    """`summary` with the restart legs' figures and checks (skipped without the router)."""
    why = gateway.unavailable()
    if why is not None:
        return {**summary, "restart_legs": {"skipped": why}}
    legs = restarts.run_legs(os.path.join(log_dir, "restarts"), args.seed)
    checks = {**summary["checks"], **legs["checks"]}
    problems = summary["problems"] + [
        f"{name} leg: {u}" for name, leg in legs["legs"].items() for u in leg["unexplained"]
    ]
    return {
        **summary,
        "restart_legs": legs,
        "checks": checks,
        "problems": problems,
        "ok": summary["ok"] and legs["ok"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: an ipc:// directory inherited from whoever started us would be shared with the
    # server, and swept by our clean-up: the server must make its own.
    os.environ.pop(RUNTIME_ENV, None)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mpp-chaos-")
    os.makedirs(log_dir, exist_ok=True)
    summary = {"checks": {}, "problems": [], "ok": True}
    if args.restart_legs != "only":
        run = ChaosRun(args, log_dir)
        try:
            summary = run.run()
        finally:
            run.cleanup()
    if args.restart_legs != "off":
        summary = with_restart_legs(summary, args, log_dir)
    report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    print(f"logs: {log_dir}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

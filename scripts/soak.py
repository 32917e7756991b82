#!/usr/bin/env python3
"""Soak: a mixed load through SGLang's router over a prefill and two decodes for --minutes,
every process's RSS and open file descriptors read from /proc every --interval seconds.

The load (seeded, --clients threads at once): greedy generates, streamed generates, aborts
(a stream whose rid is aborted at the servers' /abort_request after its first event),
clients that drop the connection mid-stream, and /flush_cache at the prefill (refused while
requests are live, as in SGLang). Every token a reply carries is checked against the
offline engine (the greedy token after the prompt and the reply's tokens before it).

It passes when no reply is wrong or unanswered, every process's RSS and descriptor count
at the end (the mean of three readings) is within --max-growth (5%) of its value at the end
of the warm-up (--warmup-minutes; a run with fewer than six readings after it is not judged
on growth; a descriptor count may also be up to --clients more, the connections in flight),
and after the drain the servers hold no request, KV token, room or extra shared segment.

    nice -n 19 python scripts/soak.py --minutes 20 --json soak.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter

from chaoslib import deploy
from chaoslib.check import check_tokens
from chaoslib.gateway import to_reply
from chaoslib.workload import ChaosWorkload, Record

from mpprefill.bench.procs import RUNTIME_ENV

ACTIONS = {"generate": 40, "stream": 30, "abort": 12, "disconnect": 12, "flush_cache": 6}
LONG_NEW_TOKENS = 48  # aborted and dropped streams ask for this many
SMOOTH = 3  # samples averaged at each end of the growth window


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="minutes of load")
    ap.add_argument("--warmup-minutes", type=float, default=2.0, help="growth counts from here")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between readings")
    ap.add_argument("--max-growth", type=float, default=0.05, help="allowed growth (0.05: 5%%)")
    ap.add_argument("--clients", type=int, default=3, help="requests in flight at once")
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the readings and the verdict here")
    ap.add_argument("--log-dir", help="server and router logs (default: a temp dir)")
    return ap.parse_args(argv)


class Load:
    """Client threads sending the mixed load; every generation is filed as a Record."""

    def __init__(self, dep: deploy.Deployment, seed: int, num_prompts: int):
        self.dep = dep
        work = ChaosWorkload(seed, 2048)
        self.prompts = [work.request(router_p=1.0).prompt for _ in range(num_prompts)]
        self.seed = seed
        self.records: list[Record] = []
        self.counts: Counter = Counter()
        self.stop = threading.Event()
        self._n = 0
        self._lock = threading.Lock()

    def run(self, clients: int) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._client, args=(k,), daemon=True, name=f"soak-{k}")
            for k in range(clients)
        ]
        for t in threads:
            t.start()
        return threads

    def _client(self, k: int) -> None:
        rng = random.Random(self.seed * 1000 + k)
        names = list(ACTIONS)
        weights = list(ACTIONS.values())
        while not self.stop.is_set():
            action = rng.choices(names, weights)[0]
            try:
                getattr(self, "_" + action)(rng)
            except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
                self.counts[f"{action}:exception"] += 1
                self.counts[f"exception:{type(e).__name__}"] += 1

    def _record(self, rng: random.Random, new_tokens: int, stream: bool) -> Record:
        with self._lock:
            self._n += 1
            n = self._n
        rec = Record(f"soak-{self.seed}-{n}", rng.choice(self.prompts), -1, "soak", via="router")
        rec.max_new_tokens = new_tokens
        rec.stream = stream
        return rec

    def _body(self, rec: Record) -> dict:
        return {
            "rid": rec.rid,
            "input_ids": rec.prompt,
            "sampling_params": {"max_new_tokens": rec.max_new_tokens, "temperature": 0.0},
            "stream": rec.stream,
        }

    def _generate(self, rng: random.Random, stream: bool = False) -> None:
        rec = self._record(rng, rng.randint(1, 16), stream)
        status, data = deploy.post(self.dep.router_port, "/generate", self._body(rec), 120)
        self._file(rec, to_reply(status, data, stream), "stream" if stream else "generate")

    def _stream(self, rng: random.Random) -> None:
        self._generate(rng, stream=True)

    def _abort(self, rng: random.Random) -> None:
        """A long stream, aborted by rid at every server after its first event."""
        rec = self._record(rng, LONG_NEW_TOKENS, True)
        conn, resp = self._open_stream(rec)
        try:
            lines = [resp.readline()]
            for d in self.dep.decodes + [self.dep.prefill]:
                deploy.post(d.http_port, "/abort_request", {"rid": rec.rid}, 10)
            lines += resp.readlines()
        finally:
            conn.close()
        events = _events(b"".join(lines))
        ended = (events[-1]["meta_info"].get("finish_reason") or {}) if events else {}
        kind = ended.get("type", "none")
        self.counts[f"abort:{kind}"] += 1
        ids = [e["output_ids"] for e in events if e.get("output_ids")]
        ok = resp.status == 200 and kind in ("abort", "length") and _extend(ids)
        reply = {"status": "done", "output_ids": ids[-1] if ids else []}
        if not ok:
            reply = {"status": "error", "error": f"abort ended {ended}", "http": resp.status}
        self.records.append(_filed(rec, reply))

    def _disconnect(self, rng: random.Random) -> None:
        """A long stream whose client goes away after two events."""
        rec = self._record(rng, LONG_NEW_TOKENS, True)
        conn, resp = self._open_stream(rec)
        try:
            got = [resp.readline() for _ in range(4)]  # two events and their blank lines
        finally:
            conn.close()
        self.counts["disconnect"] += 1
        ids = [e["output_ids"] for e in _events(b"".join(got)) if e.get("output_ids")]
        reply = {"status": "done", "output_ids": ids[-1] if ids else []}
        if not _extend(ids):
            reply = {"status": "error", "error": f"events do not extend each other: {ids}"}
        self.records.append(_filed(rec, reply))

    def _flush_cache(self, rng: random.Random) -> None:
        status, _ = deploy.post(self.dep.prefill.http_port, "/flush_cache", {}, 30)
        self.counts[f"flush_cache:{status}"] += 1
        time.sleep(rng.uniform(0.0, 0.5))

    def _open_stream(self, rec: Record):
        conn = http.client.HTTPConnection(deploy.HOST, self.dep.router_port, timeout=120)
        headers = {"Content-Type": "application/json"}
        conn.request(
            "POST", "/generate", body=json.dumps(self._body(rec)).encode(), headers=headers
        )
        return conn, conn.getresponse()

    def _file(self, rec: Record, reply: dict, action: str) -> None:
        self.counts[f"{action}:{reply['status']}"] += 1
        self.records.append(_filed(rec, reply))


def _events(data: bytes) -> list[dict]:
    """The JSON events of a server-sent-events body (not the final [DONE])."""
    lines = data.decode(errors="replace").splitlines()
    return [json.loads(x[5:]) for x in lines if x.startswith("data:") and x[5:].strip() != "[DONE]"]


def _extend(ids: list[list[int]]) -> bool:
    """Each event's output_ids extend the one before."""
    return all(b[: len(a)] == a and len(b) >= len(a) for a, b in zip(ids, ids[1:]))


def _filed(rec: Record, reply: dict) -> Record:
    rec.replies.append(reply)
    return rec


# ---- readings ------------------------------------------------------------------------------


def sample(dep: deploy.Deployment, t: float) -> dict:
    """{t, procs: {name: [rss KiB, fds]}} now."""
    procs = {}
    for name, pid in dep.pids().items():
        usage = deploy.proc_usage(pid)
        if usage is not None:
            procs[name] = list(usage)
    return {"t": round(t, 1), "procs": procs}


def growth(samples: list[dict], warmup_s: float, limit: float, fd_slack: int = 0) -> dict:
    """Per process: RSS and fds at the end of the warm-up and at the end (each the mean of
    SMOOTH readings), their growth, and whether both are under `limit` (descriptors may
    also be up to `fd_slack` more: the connections a client has open come and go)."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 2 * SMOOTH:
        return {}
    first = after[:SMOOTH]
    last = after[-SMOOTH:]
    out = {}
    for name in after[0]["procs"]:
        row = {}
        for i, what in enumerate(("rss_kib", "fds")):
            a = _mean(first, name, i)
            b = _mean(last, name, i)
            row[what] = [round(a), round(b), round((b - a) / a, 4) if a else None]
        rss_ok = row["rss_kib"][2] is not None and row["rss_kib"][2] < limit
        fd_g = row["fds"][2]
        fd_ok = fd_g is not None and (fd_g < limit or row["fds"][1] - row["fds"][0] <= fd_slack)
        row["ok"] = rss_ok and fd_ok
        out[name] = row
    return out


def _mean(samples: list[dict], name: str, i: int) -> float:
    vals = [s["procs"][name][i] for s in samples if name in s["procs"]]
    return statistics.fmean(vals) if vals else 0.0


# ---- report --------------------------------------------------------------------------------


def print_table(samples: list[dict], every_s: float = 60.0) -> None:
    names = list(samples[0]["procs"]) if samples else []
    print("t (s)  " + "  ".join(f"{n:>20}" for n in names) + "   (RSS MiB / fds)")
    next_t = 0.0
    for s in samples:
        if s["t"] + 1e-6 < next_t and s is not samples[-1]:
            continue
        next_t = s["t"] + every_s
        cells = []
        for n in names:
            rss, fds = s["procs"].get(n, (0, 0))
            cells.append(f"{rss / 1024:>13.1f} / {fds:>4}")
        print(f"{s['t']:>6.0f} " + "  ".join(cells))


def print_growth(g: dict, limit: float) -> None:
    if not g:
        print("growth: not judged (the run is too short for its warm-up)")
        return
    print(f"growth from the end of the warm-up to the end (limit {limit:.0%}):")
    print(f"  {'process':<18} {'RSS MiB':>16} {'growth':>8} {'fds':>10} {'growth':>8}")
    for name, row in g.items():
        r = row["rss_kib"]
        f = row["fds"]
        print(
            f"  {name:<18} {r[0] / 1024:>7.1f} > {r[1] / 1024:>6.1f} {_pct(r[2]):>8} "
            f"{f[0]:>4} > {f[1]:>3} {_pct(f[2]):>8}  {'ok' if row['ok'] else 'FAIL'}"
        )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def run(args: argparse.Namespace, log_dir: str) -> dict:
    dep = deploy.Deployment(log_dir, num_decodes=2)
    try:
        dep.start()
        segments = {s.role: len(s.segments()) for s in dep.servers}
        load = Load(dep, args.seed, args.prompts)
        t0 = time.monotonic()
        threads = load.run(args.clients)
        samples = [sample(dep, 0.0)]
        end = t0 + args.minutes * 60
        while time.monotonic() < end:
            time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
            samples.append(sample(dep, time.monotonic() - t0))
            print(f"[soak {samples[-1]['t']:7.1f}s] {dict(load.counts)}", file=sys.stderr)
        load.stop.set()
        for t in threads:
            t.join(150)
        held = deploy.drain(dep.servers)
        segments_end = {s.role: len(s.segments()) for s in dep.servers}
        exits = dep.stop()
    finally:
        dep.cleanup()
    return verdict(args, load, samples, held, segments, segments_end, exits)


def verdict(args, load: Load, samples, held, segments, segments_end, exits) -> dict:
    tokens = check_tokens(load.records, 16, 512)
    answered = [r for r in load.records if r.replies]
    errors = [r.replies[0] for r in answered if r.replies[0]["status"] != "done"]
    malformed = [r.replies[0] for r in answered if "malformed" in r.replies[0]]
    g = growth(samples, args.warmup_minutes * 60, args.max_growth, fd_slack=args.clients)
    checks = {
        "no wrong token": not tokens["wrong"],
        "no malformed or failed reply": not malformed and not errors,
        "no request thread failed": not any(k.startswith("exception") for k in load.counts),
        "nothing held after the drain": not any(held.values()),
        "no extra shared segment": segments == segments_end,
        "clean exits": all(v == 0 for v in exits.values()),
        f"growth under {args.max_growth:.0%} (when judged)": all(r["ok"] for r in g.values()),
    }
    return {
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "requests": dict(load.counts),
        "tokens": {k: v for k, v in tokens.items() if k != "wrong"}
        | {"wrong": tokens["wrong"][:20]},
        "errors": errors[:20] + malformed[:20],
        "held_after_drain": held,
        "segments": {"start": segments, "end": segments_end},
        "exits": exits,
        "growth": g,
        "judged": bool(g),
        "checks": checks,
        "ok": all(checks.values()),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.pop(RUNTIME_ENV, None)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mpp-soak-")
    os.makedirs(log_dir, exist_ok=True)
    s = run(args, log_dir)
    print_table(s["samples"])
    print_growth(s["growth"], args.max_growth)
    print(f"requests: {' '.join(f'{k}={v}' for k, v in sorted(s['requests'].items()))}")
    t = s["tokens"]
    wrong = len(t["wrong"])
    print(f"tokens: {t['checked']} replies checked, {wrong} wrong, near ties {t['near_ties']}")
    print(f"held after the drain: {s['held_after_drain']}; segments {s['segments']}")
    for name, ok in s["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print("soak: " + ("PASS" if s["ok"] else "FAIL"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1, default=str)
    print(f"logs: {log_dir}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

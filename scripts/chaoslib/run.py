"""The chaos run's phases: start, load with faults, drain and check, worker kill, stop."""

from __future__ import annotations

import heapq
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque

from chaoslib import gateway, procs
from chaoslib.check import Faults, summarize
from chaoslib.hostile import foreign_abort, hostile_frames
from chaoslib.hostile_decode import HostileDecode
from chaoslib.router import ChaosRouter
from chaoslib.workload import SLOW_EVERY, ChaosWorkload, Record
from mpprefill.bench.procs import (
    Child,
    forward_pids,
    free_port,
    runtime_dir_of,
    start_decode,
    start_server,
    worker_pid,
)

FINAL_REQUESTS = 24
HOSTILE_DECODE_S = 3.0  # a hostile peer holds the decode port this long during the restart


class Events:
    """A heap of (time, action) run in time order."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, fn, args = heapq.heappop(self._heap)
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)


class ChaosRun:
    def __init__(self, args, log_dir: str):
        self.args = args
        self.log_dir = log_dir
        self.rng = random.Random(args.seed)
        self.workload = ChaosWorkload(args.seed, args.max_total_tokens)
        self.faults = Faults(args.max_queued_requests)
        self.injected: Counter = Counter()
        self.events = Events()
        self.serve: Child | None = None
        self.decode: Child | None = None
        self.decodes: list[Child] = []  # every decode receiver started, the killed one too
        self.router: ChaosRouter | None = None
        self.bootstrap_port = free_port()
        self.router_skipped = gateway.unavailable() if args.router_fraction > 0 else "off"
        self.gateway: gateway.Gateway | None = None
        self.leg: gateway.RouterLeg | None = None
        self.router_decode: Child | None = None  # the generating decode behind the router
        self.fronts: list[int] = []  # pids of the HTTP fronts serve and that decode spawned
        self.routed = 0  # requests sent through the router leg
        self.runtime_dir: str | None = None
        self._restart: threading.Thread | None = None
        self.hostile_decode: HostileDecode | None = None
        self._last_progress = 0.0
        self.problems: list[str] = []
        self.drain_stats: dict = {}
        self.t0 = time.monotonic()
        self._t_mark = self.t0
        self.phases: dict[str, float] = {}

    # ---- processes -------------------------------------------------------------------------

    def serve_flags(self) -> list[str]:
        a = self.args
        return [
            *("--forward-mode", a.forward_mode, "--page-size", str(a.page_size)),
            *("--chunked-prefill-size", str(a.chunked_prefill_size)),
            *("--max-total-tokens", str(a.max_total_tokens), "--max-running-requests", "16"),
            *("--max-prefill-tokens", "512", "--max-queued-requests", str(a.max_queued_requests)),
            *("--disaggregation-transfer-backend", "shm", "--bootstrap-timeout", "8"),
            *("--disaggregation-bootstrap-port", str(self.bootstrap_port)),
            *("--worker-threads", "1", "--tp-size", str(a.tp_size)),
            *("--host-store-size", str(a.host_store_size)),
            *("--check-invariants", "--log-level", "warning"),
            *swa_flags(a),
            *(["--disaggregation-layerwise-send"] if a.disaggregation_layerwise_send else []),
        ]

    def decode_flags(self) -> list[str]:
        a = self.args
        return [
            *("--page-size", str(a.page_size), "--max-total-tokens", "32768"),
            *("--disaggregation-transfer-backend", "shm", "--log-level", "warning"),
        ]

    def slow_decode(self) -> list[str]:
        """The decode server with its test delay injected (tests/slow_decode.py, run from
        the repository root): rooms that are multiples of SLOW_EVERY answer late."""
        delay = ("--delay-ms", str(self.args.slow_ms), "--delay-every", str(SLOW_EVERY))
        return [sys.executable, "-m", "tests.slow_decode", *delay]

    def router_decode_flags(self) -> list[str]:
        """The generating decode server behind SGLang's router (no test delay)."""
        a = self.args
        return [
            *("--page-size", str(a.page_size), "--max-total-tokens", "32768"),
            *("--disaggregation-transfer-backend", "shm", "--log-level", "warning"),
            *("--waiting-timeout", "60"),
            *swa_flags(a),
        ]

    def start(self) -> None:
        leg = self.router_skipped is None
        self.decode = start_decode(self.decode_flags(), self.log_dir, launcher=self.slow_decode())
        self.decodes.append(self.decode)
        if leg:
            self.router_decode = procs.start_generating_decode(
                self.router_decode_flags(), self.log_dir
            )
            self.decodes.append(self.router_decode)
        self.serve = start_server(self.serve_flags(), self.log_dir, http=leg)
        worker = worker_pid(self.serve.proc.pid)
        self.runtime_dir = runtime_dir_of(worker) if worker else None
        self.router = ChaosRouter(self.serve.port, self.decode.port, self.bootstrap_port)
        if leg:
            self.fronts = procs.http_fronts(self.serve, self.router_decode)
            self.gateway = gateway.Gateway(
                self.serve.http_port,
                self.bootstrap_port,
                self.router_decode.http_port,
                self.log_dir,
            )
            self.gateway.wait_ready()
            self.leg = gateway.RouterLeg(self.gateway.port)

    def restart_decode(self) -> None:
        worker = worker_pid(self.serve.proc.pid)
        hostile = self.hostile_decode = HostileDecode(self.decode.port, self.args.seed, worker)

        def work():
            hostile.learn()
            self.faults.decode_kill = time.monotonic()
            procs.kill(self.decode)
            hostile.serve(HOSTILE_DECODE_S)
            launcher = self.slow_decode()
            flags = self.decode_flags()
            new = procs.restart_decode(self.decode.port, flags, self.log_dir, launcher=launcher)
            self.decodes.append(new)
            self.decode = new
            self.faults.decode_ready = time.monotonic()

        self.injected["decode-kill-restart"] += 1
        self._restart = threading.Thread(target=work, name="decode-restart", daemon=True)
        self._restart.start()

    # ---- load ----------------------------------------------------------------------------

    def plan(self) -> tuple[list[tuple[float, Record]], list[Record]]:
        """Requests, faults and their times, all from the seed; (timed normal load, final)."""
        a = self.args
        w = self.workload
        n_burst = min(a.max_queued_requests + 64, max(1, a.num_requests // 3))
        n_normal = max(0, a.num_requests - n_burst - 3 - FINAL_REQUESTS)
        router_p = a.router_fraction if self.leg is not None else 0.0
        normal = [w.request("normal", a.abort_p, a.slow_p, router_p) for _ in range(n_normal)]
        burst = [w.request("burst", a.abort_p, router_p=router_p) for _ in range(n_burst)]
        start = time.monotonic()
        d = a.duration
        self.events.at(start + 0.25 * d, self.send_burst, burst)
        self.events.at(start + 0.5 * d, self.restart_decode)
        for _ in range(3):
            self.events.at(start + self.rng.uniform(0, d), self.send, w.request("toolong"))
        n_bad = max(30, a.num_requests // 25)
        for h in hostile_frames(self.rng, n_bad):
            self.events.at(start + self.rng.uniform(0, d), self.send_hostile, h)
        for _ in range(max(5, n_bad // 4)):
            self.events.at(start + self.rng.uniform(0, d), self.send_foreign_abort)
        final = [w.request("final") for _ in range(FINAL_REQUESTS + 1)]
        times = sorted(self.rng.uniform(0, 0.95 * d) for _ in normal)
        return list(zip([start + t for t in times], normal)), final

    def send(self, rec: Record) -> None:
        if rec.via == "router":
            self.router.track(rec)
            self.leg.send(rec)
            self.routed += 1
            return
        self.router.send(rec)
        now = time.monotonic()
        if rec.register_after > 0:
            self.injected["late-register"] += 1
            self.events.at(now + rec.register_after, self.router.register, rec)
        if rec.abort_stage is not None:
            self.events.at(now + rec.abort_after, self.abort, rec)
        if rec.kind == "slow":
            self.injected["slow-transfer"] += 1
        if rec.kind == "toolong":
            self.injected["too-long-prompt"] += 1

    def abort(self, rec: Record) -> None:
        sent = self.router.abort(rec)
        self.injected[f"abort/{rec.abort_stage}" if sent else "abort/too-late"] += 1

    def send_burst(self, recs: list[Record]) -> None:
        self.injected["burst"] += 1
        self.injected["burst-requests"] += len(recs)
        for rec in recs:
            self.send(rec)

    def send_hostile(self, h) -> None:
        self.injected["bad-frame"] += 1
        self.router.send_hostile(h)

    def send_foreign_abort(self) -> None:
        h = foreign_abort(self.rng, self.router.records.values(), self.router.hostiles)
        self.injected["foreign-abort" if h is not None else "foreign-abort/no-victim"] += 1
        if h is not None:
            self.router.send_hostile(h)

    def load(self, planned: list[tuple[float, Record]]) -> None:
        queue = deque(planned)
        hard_end = time.monotonic() + 3 * self.args.duration + 60
        while (queue or len(self.events)) and time.monotonic() < hard_end:
            now = time.monotonic()
            self.events.run_due(now)
            while queue and queue[0][0] <= now and self.router.outstanding < self.args.window:
                self.send(queue.popleft()[1])
            self.poll(5)
            self.progress()
        self.injected["not-sent"] += len(queue)

    def pump(self, seconds: float, until=lambda: False) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.events.run_due(time.monotonic())
            self.poll(10)
            self.progress()
            if until():
                return True
        return until()

    def poll(self, timeout_ms: int) -> None:
        """Replies from the sockets, then the router leg's answers."""
        self.router.poll(timeout_ms)
        if self.leg is not None:
            for rec, reply in self.leg.finished():
                self.router.answer(rec, reply)

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        tty = sys.stderr.isatty()
        if not force and now - self._last_progress < (1.0 if tty else 5.0):
            return
        self._last_progress = now
        r = self.router
        c = r.counts
        line = (
            f"[chaos {now - self.t0:6.1f}s] sent={c['sent']} done={c['done']} "
            f"error={c['error']} outstanding={r.outstanding} bad={self.injected['bad-frame']} "
            f"aborts={sum(v for k, v in self.injected.items() if k.startswith('abort/'))}"
            f" via-router={self.routed}"
        )
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    # ---- drain, worker kill, stop ---------------------------------------------------------

    def drained(self) -> bool:
        r = self.router
        hostile_done = all(h.replies or h.rid is None for h in r.hostile_sent)
        return r.outstanding == 0 and hostile_done and not len(self.events)

    def describe_stuck(self) -> str:
        stuck = [r for r in self.router.records.values() if not r.replies]
        info = [
            f"{r.rid}/{r.kind}/abort={r.abort_stage}/sent@{r.t_send - self.t0:.1f}s"
            f"/registered={r.registered}/decode={r.decode_replies}"
            for r in stuck[:5]
        ]
        stats = procs.stats(self.serve.port) or {}
        return f"not drained: {len(stuck)} unanswered {info}; server queues {stats.get('queues')}"

    def check_invariants(self) -> dict:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = procs.stats(self.serve.port)
            if stats is not None and stats["invariants"].get("checked"):
                self.drain_stats = stats
                return stats["invariants"]
            self.pump(0.2)
        return {"checked": False, "error": "never drained"}

    def final_phase(self, final: list[Record]) -> None:
        """A last load; with a forward process, it is SIGKILLed while that load runs."""
        for rec in final[:-1]:
            self.send(rec)
        answered = lambda: all(r.replies for r in final[:-1])  # noqa: E731
        ranks = forward_pids(self.serve.proc.pid)
        if not ranks:  # the forward runs in the scheduler process: nothing to kill
            self.pump(60.0, answered)
            return
        self.pump(0.3)
        os.kill(self.rng.choice(sorted(ranks)), signal.SIGKILL)
        self.faults.worker_kill = time.monotonic()
        self.injected["worker-sigkill"] += 1
        if not self.pump(5.0, answered) and procs.alive(self.serve):
            self.send(final[-1])  # the worker died while idle: a request makes it notice
        self.pump(30.0, lambda: answered() and not procs.alive(self.serve))

    def stop(self) -> dict:
        exits = {}
        if self.faults.worker_kill is None:
            exits["serve_sigterm"] = self.serve.stop()
        else:
            try:
                exits["serve_after_worker_kill"] = self.serve.proc.wait(10)
            except subprocess.TimeoutExpired:
                exits["serve_after_worker_kill"] = f"still running: {self.serve.stop()}"
        if self._restart is not None:
            self._restart.join(120)
        self.pump(0.5)  # late decode replies
        exits["decode_sigterm"] = self.decode.stop()
        if self.gateway is not None:
            exits["router_sigterm"] = self.gateway.stop()
            self.leg.close()
            exits["router_decode_sigterm"] = self.router_decode.stop()
        return exits

    def cleanup(self) -> None:
        for child in (self.serve, self.decode, self.router_decode):
            if child is not None and procs.alive(child):
                procs.kill(child)
        if self.gateway is not None and self.gateway.proc.poll() is None:
            self.gateway.proc.kill()
            self.gateway.proc.wait(10)
        if self.leg is not None:
            self.leg.close()
        if self.router is not None:
            self.router.close()
        procs.sweep(self.serve, self.decodes)
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)

    # ---- the whole run -------------------------------------------------------------------

    def run(self) -> dict:
        self.start()
        self.mark("start")
        planned, final = self.plan()
        self.load(planned)
        self.mark("load")
        if self._restart is not None:
            self._restart.join(120)
        if not self.pump(90.0, self.drained):
            self.problems.append(self.describe_stuck())
        if self.hostile_decode is not None:
            self.injected.update(self.hostile_decode.counts)
            self.problems += self.hostile_decode.problems(self.router.records.values())
        invariants = self.check_invariants()
        self.mark("drain")
        self.final_phase(final)
        exits = self.stop()
        self.mark("worker-kill+stop")
        self.progress(force=True)
        print(file=sys.stderr)
        leaks = procs.leftovers(self.serve, self.decodes, self.runtime_dir, self.fronts)
        return summarize(self, invariants, exits, leaks)

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = round(now - self._t_mark, 1)
        self._t_mark = now


def swa_flags(args) -> list[str]:
    """The sliding-window flags of a chaos run, for serve and the offline reference."""
    flags = []
    if args.sliding_window is not None:
        flags += ["--sliding-window", str(args.sliding_window)]
    if args.swa_layers is not None:
        flags += ["--swa-layers", args.swa_layers]
    return flags

"""The chaos run's restart legs: SGLang's router in PD mode (the recovery settings of
`deploy.ROUTER_FLAGS`) over a prefill and two decodes, greedy requests flowing through it,
while one server is SIGKILLed and restarted on its ports: a decode in one leg, the prefill
in the next, on the same deployment.

Each leg: load for LEAD_S, SIGKILL, DOWN_S down, restart, load until the restarted server
has answered requests again (or BACK_TIMEOUT_S) plus TAIL_S, then the drain. It reports
when the server died and came back, the time to recovery (from the kill to the send of the
first request after which every request succeeded), and what each server holds after the
drain. It passes when no token differs from the offline engine's, every error came to a
request in flight at the kill or sent while the killed server was down or not yet noticed
(GRACE_S after the kill for a decode, after the restart for the prefill), the restarted server
answered again, nothing is held after the drain (requests, KV tokens, rooms, pages) by any
server, and no server that stayed up has more shared segments than before.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

from chaoslib import deploy
from chaoslib.check import check_router, check_tokens
from chaoslib.gateway import to_reply
from chaoslib.workload import ChaosWorkload, Record

CLIENTS = 4
LEAD_S = 4.0
DOWN_S = 3.0
TAIL_S = 4.0
BACK_TIMEOUT_S = 90.0
GRACE_S = 4.0  # the router's health check (1 s, one failure) notices a dead worker in this
# a request whose prefill died after its decode registered the room is held by that decode
# until its client goes (or the decode's --waiting-timeout): the legs' clients wait this long
REQUEST_TIMEOUT_S = 30.0
BOOTSTRAP_TIMEOUT_S = 8  # serve's --bootstrap-timeout: how long a room waits for its decode


class Traffic:
    """CLIENTS threads posting greedy requests through the router, one at a time each."""

    def __init__(self, port: int, seed: int):
        self.port = port
        self.work = ChaosWorkload(seed, 2048)
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._client, daemon=True, name=f"restart-leg-{k}")
            for k in range(CLIENTS)
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 10)

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                rec = self.work.request(router_p=1.0)
            rec.t_send = time.monotonic()
            body = {
                "input_ids": rec.prompt,
                "sampling_params": {"max_new_tokens": rec.max_new_tokens, "temperature": 0.0},
                "stream": rec.stream,
            }
            try:
                status, data = deploy.post(self.port, "/generate", body, REQUEST_TIMEOUT_S)
                reply = to_reply(status, data, rec.stream)
            except Exception as e:  # noqa: BLE001 - a dropped connection is the request's answer
                reply = {"status": "error", "error": f"router request failed: {e!r}"}
            rec.t_reply = time.monotonic()
            rec.replies.append(reply)
            with self._lock:
                self.records.append(rec)
            if reply["status"] != "done":
                time.sleep(0.05)  # a refusal comes at once: do not spin on it


def run_legs(log_dir: str, seed: int, legs: tuple[str, ...] = ("decode", "prefill")) -> dict:
    """Both legs on one deployment; {"legs": {name: figures}, "checks", "ok"}."""
    serve_flags = ("--bootstrap-timeout", str(BOOTSTRAP_TIMEOUT_S))
    dep = deploy.Deployment(log_dir, num_decodes=2, serve_flags=serve_flags)
    out: dict = {"router_flags": list(deploy.ROUTER_FLAGS), "legs": {}}
    try:
        dep.start()
        for i, name in enumerate(legs):
            out["legs"][name] = Leg(dep, name, seed + i).run()
        out["exits"] = dep.stop()
    finally:
        dep.cleanup()
    checks = {}
    for name, leg in out["legs"].items():
        for check, ok in leg["checks"].items():
            checks[f"{name} leg: {check}"] = ok
    checks["restart legs: clean exits"] = all(v == 0 for v in out.get("exits", {1: 1}).values())
    out["checks"] = checks
    out["ok"] = all(checks.values())
    return out


class Leg:
    """One server of `dep` (`target`: decode | prefill) SIGKILLed and restarted under load."""

    def __init__(self, dep: deploy.Deployment, target: str, seed: int):
        self.dep = dep
        self.target = target
        self.victim = dep.decodes[0] if target == "decode" else dep.prefill
        self.survivors = [s for s in dep.servers if s is not self.victim]
        self.traffic = Traffic(dep.router_port, seed)
        self.t: dict[str, float] = {}

    def run(self) -> dict:
        segments = {s.role: len(s.segments()) for s in self.survivors}
        fds = _fds(self.survivors)
        self.traffic.start()
        time.sleep(LEAD_S)
        served_before = served(self.victim)
        self.t["kill"] = time.monotonic()
        self.victim.kill()
        time.sleep(DOWN_S)
        self.t["restart"] = time.monotonic()
        self.victim.start()
        self.victim.wait_healthy()
        self.t["healthy"] = time.monotonic()
        back = self._wait_back()
        time.sleep(TAIL_S)
        self.traffic.stop()
        self.t["load_end"] = time.monotonic()
        held = deploy.drain(self.dep.servers, BOOTSTRAP_TIMEOUT_S + 30)
        swept = self.victim.sweep()
        return self.figures(segments, fds, held, swept, back, served_before)

    def _wait_back(self) -> bool:
        """Until the restarted server has answered a request through the router."""
        deadline = time.monotonic() + BACK_TIMEOUT_S
        while time.monotonic() < deadline:
            if served(self.victim):
                self.t["back"] = time.monotonic()
                return True
            time.sleep(0.2)
        return False

    def figures(self, segments, fds, held, swept, back, served_before) -> dict:
        recs = self.traffic.records
        tokens = check_tokens(recs, 16, 512)
        router = check_router(recs, tokens)
        t = self.t
        errors = [r for r in recs if r.replies[0]["status"] != "done"]
        # a decode's death is noticed by the router's health check; the prefill is the only
        # one, so nothing succeeds until it is back
        window_end = t["kill"] + GRACE_S if self.target == "decode" else t["healthy"] + GRACE_S
        unexplained = [r for r in errors if not _in_window(r, t["kill"], window_end)]
        recovered = recovery(recs, t["kill"])
        segments_after = {s.role: len(s.segments()) for s in self.survivors}
        slow = [r for r in recs if r.t_reply >= t["kill"]]
        rel = lambda x: round(x - t["kill"], 2)
        checks = {
            "0 wrong tokens": not tokens["wrong"] and not router["wrong"],
            "every error sent while the server was down or not yet noticed": not unexplained,
            "the restarted server answered again": back,
            "nothing held after the drain": not any(held.values()),
            "no extra shared segment on a server that stayed up": segments == segments_after,
        }
        return {
            "requests": len(recs),
            "ok": router["ok"],
            "errors": len(errors),
            "wrong": len(tokens["wrong"]) + router["wrong"],
            "error_kinds": dict(Counter(_kind(r.replies[0]) for r in errors)),
            "unexplained": [
                (rel(r.t_send), r.replies[0].get("error", "")[:160]) for r in unexplained
            ][:10],
            "served_before_kill": served_before,
            "timeline_s": {k: rel(v) for k, v in t.items()},
            "recovery_s": None if recovered is None else rel(recovered),
            "slowest_after_kill_s": round(max((r.t_reply - r.t_send for r in slow), default=0), 1),
            "timed_out": sum("timed out" in r.replies[0].get("error", "") for r in errors),
            "held_after_drain": held,
            "segments_survivors": {"before": segments, "after": segments_after},
            "fds_survivors": {"before": fds, "after": _fds(self.survivors)},
            "segments_swept_of_killed": len(swept),
            "checks": checks,
        }


def recovery(recs: list[Record], t_kill: float) -> float | None:
    """The send time of the first request after which every request sent succeeded, or
    None if the load never got there."""
    after = sorted((r for r in recs if r.t_send >= t_kill), key=lambda r: r.t_send)
    good_from = None
    for r in after:
        if r.replies[0]["status"] != "done":
            good_from = None
        elif good_from is None:
            good_from = r.t_send
    return good_from


def _in_window(rec: Record, start: float, end: float) -> bool:
    """In flight at `start`, or sent between `start` and `end`."""
    return rec.t_send <= start <= rec.t_reply or start <= rec.t_send <= end


def served(server: deploy.Server) -> int:
    """Prompts the server's front answered in its current life (its /metrics)."""
    try:
        status, data = deploy.get(server.http_port, "/metrics", timeout=5.0)
    except OSError:
        return 0
    if status != 200:
        return 0
    m = re.search(rb"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", data, re.M)
    return int(float(m.group(1))) if m else 0


def _fds(servers: list[deploy.Server]) -> dict[str, int]:
    out = {}
    for s in servers:
        for name, pid in s.pids().items():
            usage = deploy.proc_usage(pid)
            if usage is not None:
                out[name] = usage[1]
    return out


def _kind(reply: dict) -> str:
    err = reply.get("error", "")
    return f"{reply.get('http_status', '-')}: {err[:60]}"

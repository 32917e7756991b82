from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time

import pytest

from mpprefill.trace import chrome, get_tracer, set_tracer, summarize
from mpprefill.trace.tracer import INSTANT, NULL_SPAN, Tracer, clock_ns


def _child(path: str) -> None:
    """Worker side of the two-process test: F spans on its main thread and a helper thread."""
    tracer = Tracer("worker", enabled=True)
    for seq in range(3):
        with tracer.span("forward", seq, tokens=16):
            time.sleep(0.001)

    def helper():
        with tracer.span("transfer-poll"):
            pass

    t = threading.Thread(target=helper, name="helper")
    t.start()
    t.join()
    tracer.dump(path)


def test_disabled_tracer_records_nothing():
    tracer = Tracer("sched", enabled=False)
    with tracer.span("build", 1, n=3) as s:
        assert s is NULL_SPAN
    assert tracer.span("process") is tracer.span("sample")
    tracer.instant("queue", waiting=3)
    assert tracer.records == [] and tracer.threads == {}


def test_enable_toggle_and_record_shape():
    tracer = Tracer("sched", enabled=False)
    tracer.enabled = True
    with tracer.span("build", 5, bs=2):
        pass
    tracer.instant("queue", waiting=4)
    (name, tid, start, dur, seq, args), inst = tracer.records
    assert (name, seq, args) == ("build", 5, {"bs": 2}) and dur >= 0 and start <= clock_ns()
    assert tid == threading.get_native_id() and tracer.threads[tid] == "MainThread"
    assert inst[0] == "queue" and inst[3] == INSTANT and inst[5] == {"waiting": 4}
    tracer.enabled = False
    with tracer.span("build"):
        pass
    assert len(tracer.records) == 2


def test_span_records_even_when_body_raises():
    tracer = Tracer("sched", enabled=True)
    with pytest.raises(RuntimeError), tracer.span("process"):
        raise RuntimeError("boom")
    assert [r[0] for r in tracer.records] == ["process"]


def test_get_set_tracer():
    mine = Tracer("scheduler", enabled=True)
    prev = set_tracer(mine)
    try:
        assert get_tracer() is mine
    finally:
        set_tracer(prev)
    assert get_tracer() is prev


def measure_overhead(n: int = 100_000) -> dict[str, float]:
    """ns per `with tracer.span(...)` disabled and enabled, minus an empty loop."""

    def run(tracer: Tracer | None) -> float:
        t0 = time.perf_counter_ns()
        if tracer is None:
            for _ in range(n):
                pass
        else:
            for i in range(n):
                with tracer.span("forward", i):
                    pass
        return (time.perf_counter_ns() - t0) / n

    base = min(run(None) for _ in range(3))
    off = min(run(Tracer("overhead", enabled=False)) for _ in range(3))
    on = min(run(Tracer("overhead", enabled=True)) for _ in range(3))
    return {"disabled_ns": max(off - base, 0.0), "enabled_ns": max(on - base, 0.0)}


def test_overhead_disabled_is_small():
    cost = measure_overhead(20_000)
    assert cost["disabled_ns"] < cost["enabled_ns"]
    assert cost["disabled_ns"] < 2_000  # generous: shared CI machines


def test_two_processes_merge_into_one_chrome_trace(tmp_path):
    sched = Tracer("scheduler", enabled=True)
    before = clock_ns()
    with sched.span("build", 0):
        child_dump = tmp_path / "worker.json"
        proc = mp.get_context("spawn").Process(target=_child, args=(str(child_dump),))
        proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("child tracer process hung")
    assert proc.exitcode == 0
    with sched.span("process", 0):
        pass
    after = clock_ns()
    sched_dump = sched.dump(tmp_path / "raw")  # a directory: default name inside
    assert sched_dump == tmp_path / "raw" / f"scheduler.{os.getpid()}.trace.json"

    out = chrome.merge([sched_dump, child_dump], tmp_path / "merged.json")
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    pids = {e["pid"] for e in spans}
    assert pids == {os.getpid(), proc.pid}
    assert min(e["ts"] for e in spans) == 0.0

    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {os.getpid(): "scheduler", proc.pid: "worker"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(proc.pid, "MainThread"), (proc.pid, "helper"), (os.getpid(), "MainThread")} <= threads

    fwd = [e for e in spans if e["name"] == "forward"]
    assert [e["args"]["seq"] for e in fwd] == [0, 1, 2] and fwd[0]["args"]["tokens"] == 16
    assert all(e["pid"] == proc.pid and e["dur"] >= 1000 for e in fwd)  # slept 1 ms each

    s = summarize(out)
    assert s.num_batches == 3 and s.forward_s >= 0.003 and 0 < s.worker_busy_frac < 1

    # One clock: the child's spans fall inside the parent's window, in the parent's order.
    t0 = data["otherData"]["t0_ns"]
    a, p = (next(e for e in spans if e["name"] == n) for n in ("build", "process"))
    for e in fwd:
        assert before <= t0 + e["ts"] * 1000 <= after
        assert a["ts"] <= e["ts"] <= p["ts"]

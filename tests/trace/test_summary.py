from __future__ import annotations

import json

import pytest

from mpprefill.trace import summarize
from mpprefill.trace.summary import gaps, intersect, union, waiting_intervals
from mpprefill.trace.tracer import INSTANT, Tracer

SCHED, WORKER = (1, 10), (2, 20)


def x(name, lane, start_us, end_us, **args):
    pid, tid = lane
    dur = end_us - start_us
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_us,
        "dur": dur,
        "args": args,
    }


def queue(t_us, waiting):
    args = {"waiting": waiting}
    return {"name": "queue", "ph": "i", "s": "t", "pid": 1, "tid": 10, "ts": t_us, "args": args}


def pipeline():
    """Hand-made run, times in us:

    scheduler  A[0,10]            P[30,40]  S[45,50] snapshot[50,55] submit[55,58] cw[60,70]
    worker         F[5,35]                       F[52,80]                  F[90,100]
    waiting > 0 on [0,40) and [85,95)
    """
    return [
        x("build", SCHED, 0, 10), x("process", SCHED, 30, 40), x("sample", SCHED, 45, 50),
        x("snapshot", SCHED, 50, 55), x("submit", SCHED, 55, 58), x("collect-wait", SCHED, 60, 70),
        x("forward", WORKER, 5, 35), x("forward", WORKER, 52, 80), x("forward", WORKER, 90, 100),
        queue(0, 2), queue(40, 0), queue(85, 3), queue(95, 0),
    ]  # fmt: skip


def test_interval_helpers():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (4, 4)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6), (7, 9)]) == [(2, 3), (5, 6), (7, 8)]
    assert gaps([(0, 3), (5, 8), (8, 9), (12, 13)]) == [(3, 5), (9, 12)]
    assert waiting_intervals([(10, 0), (0, 1), (20, 2), (30, 5)], 40) == [(0, 10), (20, 40)]


def test_exact_overlap_and_bubbles():
    s = summarize(pipeline())
    # F = 30 + 28 + 10 = 68 us; scheduler work = A, P, S+snapshot = [0,10] [30,40] [45,55]
    # F ∩ work = [5,10] + [30,35] + [52,55] = 13 us
    assert s.num_batches == 3
    assert s.wall_s == pytest.approx(100e-6)
    assert s.forward_s == pytest.approx(68e-6)
    assert s.overlap_frac == pytest.approx(13 / 68)
    assert s.worker_busy_frac == pytest.approx(0.68)
    # gaps [35,52] and [80,90]; waiting on [0,40) and [85,95): 5 + 5 us
    assert s.bubbles_s == pytest.approx(10e-6)
    assert s.collect_wait_s == pytest.approx(10e-6)
    assert s.phase_s == pytest.approx(
        {
            "build": 10e-6,
            "process": 10e-6,
            "sample": 5e-6,
            "snapshot": 5e-6,
            "submit": 3e-6,
            "collect-wait": 10e-6,
        }  # fmt: skip
    )
    assert s.phase_per_batch_ms["build"] == pytest.approx(10e-3 / 3)
    assert json.loads(json.dumps(s.to_dict()))["overlap_frac"] == pytest.approx(13 / 68)
    text = s.format()
    assert "overlap" in text and "bubbles" in text and "snapshot" in text


def test_queue_samples_argument_overrides_instants():
    # waiting the whole time: every gap between forwards is a bubble (17 + 10 us)
    s = summarize(pipeline(), queue_samples=[(0, 1)])
    assert s.bubbles_s == pytest.approx(27e-6)
    assert summarize(pipeline(), queue_samples=[]).bubbles_s == 0.0


def test_no_overlap_when_scheduler_works_between_forwards():
    events = [
        x("build", SCHED, 0, 10), x("forward", WORKER, 10, 30), x("process", SCHED, 30, 35),
        x("sample", SCHED, 35, 40), x("forward", WORKER, 40, 60), x("inflight", SCHED, 60, 62),
    ]  # fmt: skip
    s = summarize(events)
    assert s.overlap_frac == 0.0
    assert s.worker_busy_frac == pytest.approx(40 / 62)
    assert s.bubbles_s == 0.0  # no queue samples: nothing was waiting


def test_window_clips_spans():
    s = summarize(pipeline(), window_ns=(20_000, 60_000))
    # F in window: [20,35] + [52,60] = 23 us; work: [30,40] [45,55] -> ∩ = [30,35] + [52,55]
    assert s.forward_s == pytest.approx(23e-6)
    assert s.overlap_frac == pytest.approx(8 / 23)
    assert s.wall_s == pytest.approx(40e-6)


def test_thread_mode_from_raw_records():
    """One process, scheduler main thread and forward thread, records in clock ns."""
    tracer = Tracer("scheduler", enabled=True)
    tracer.threads.update({1: "MainThread", 2: "forward"})
    tracer.records += [
        ("build", 1, 1_000, 400, 0, None),
        ("forward", 2, 1_400, 1_000, 0, None),
        ("build", 1, 1_500, 300, 1, None),  # admits N+1 while F(N) runs
        ("collect-wait", 1, 1_800, 600, 0, None),
        ("forward", 2, 2_500, 500, 1, None),
        ("process", 1, 2_500, 200, 0, None),
        ("queue", 1, 2_400, INSTANT, -1, {"waiting": 1}),
    ]
    s = summarize(tracer)
    assert s.overlap_frac == pytest.approx((300 + 200) / 1_500)
    assert s.bubbles_s == pytest.approx(100e-9)  # gap [2400, 2500] while 1 waits
    assert s.collect_wait_s == pytest.approx(600e-9)
    assert s.worker_busy_frac == pytest.approx(1_500 / 2_000)
    # explicit samples are on the tracer clock
    assert summarize(tracer, queue_samples=[(2_450, 2)]).bubbles_s == pytest.approx(50e-9)


def test_merged_file_and_dump_paths(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": pipeline(), "otherData": {"t0_ns": 5_000}}))
    s = summarize(str(path))
    assert s.overlap_frac == pytest.approx(13 / 68)
    # samples given on the clock: shifted by the trace's origin
    assert summarize(path, queue_samples=[(5_000, 1)]).bubbles_s == pytest.approx(27e-6)

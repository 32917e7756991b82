from __future__ import annotations

import sys

import pytest

from mpprefill.trace import chrome
from mpprefill.trace.timeline import pick_window, split_lanes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _meta(kind, pid, tid, name):
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _x(name, pid, tid, start, dur):
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start, "dur": dur, "args": {}}


def ahead_run(worker_pid: int, iters: int = 12) -> list[dict]:
    """A(N+1) and P(N-1) on the scheduler while F(N) runs in the worker; 1 ms per iteration."""
    events = [_meta("process_name", 1, 0, "scheduler"), _meta("thread_name", 1, 1, "MainThread")]
    events += [_meta("process_name", worker_pid, 0, "worker")]
    for i in range(iters):
        t = i * 1000
        events += [
            _x("build", 1, 1, t, 200),
            _x("snapshot", 1, 1, t + 200, 30),
            _x("submit", 1, 1, t + 230, 20),
            _x("process", 1, 1, t + 250, 300),
            _x("collect-wait", 1, 1, t + 600, 350),
            _x("forward", worker_pid, 100 + worker_pid, t + 250, 700),
        ]
    return events


def normal_run(iters: int = 12) -> list[dict]:
    events = [_meta("process_name", 1, 0, "scheduler")]
    for i in range(iters):
        t = i * 1500
        events += [
            _x("build", 1, 1, t, 300),
            _x("forward", 1, 1, t + 300, 900),
            _x("process", 1, 1, t + 1200, 300),
        ]
    return events


def test_split_lanes_process_thread_and_inline():
    sched, worker, label = split_lanes(chrome.read(ahead_run(worker_pid=2)))
    assert label == "worker" and {s.name for s in worker} == {"forward"}
    assert "forward" not in {s.name for s in sched}
    _, _, label = split_lanes(chrome.read(ahead_run(worker_pid=1)))
    assert label == "forward thread"  # same pid, another tid
    sched, worker, label = split_lanes(chrome.read(normal_run()))
    assert (
        label.startswith("forward (sched")
        and len(worker) == 12
        and "forward" in {s.name for s in sched}
    )


def test_pick_window_middle_iterations_and_fractions():
    spans = chrome.read(ahead_run(worker_pid=2)).spans
    lo, hi = pick_window(spans, 3)
    # middle of 12 forwards: F[5..7] from 5250 to 7950 us, padded by 5 %
    assert lo == 5_250_000 - 135_000 and hi == 7_950_000 + 135_000
    assert pick_window(spans, (0.25, 0.5)) == (0 + 2_987_500, 5_975_000)
    assert pick_window(spans, 100) == (0, 11_950_000)


def test_draw_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    from mpprefill.trace.timeline import draw_timeline

    traces = {"proc-ahead": ahead_run(2), "thread-ahead": ahead_run(1), "normal": normal_run()}
    out = draw_timeline(traces, tmp_path / "t" / "timeline.png", window=4, title="test")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000
    out2 = draw_timeline({"proc-ahead": ahead_run(2)}, tmp_path / "w.png", window=(0.4, 0.6))
    assert out2.read_bytes()[:8] == PNG_MAGIC


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    from mpprefill.trace.timeline import draw_timeline

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"mpprefill\[plot\]"):
        draw_timeline({"normal": normal_run()}, tmp_path / "x.png")

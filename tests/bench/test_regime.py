"""The regime map's bounds and classification, and its heat map from a sweep result."""

from __future__ import annotations

import pytest

from mpprefill.bench.regime import (
    bounds_ms,
    grid,
    is_launch_bound,
    of_bound,
    plot_regime_map,
    ratio,
)


def _run(mode: str, itps: float, device: float, issue: float, sched: float) -> dict:
    return {
        "mode": mode,
        "uncached_itps": itps,
        "t_device_ms": device,
        "t_issue_ms": issue,
        "t_sched_ms": sched,
    }


def _point(model: str, chunk: int, pa: float, ta: float) -> dict:
    server = {
        "emulate_model": model,
        "chunked_prefill_size": chunk,
        "emulate_gpu": "h200",
        "disaggregation_transfer_backend": "fake",
    }
    runs = [_run("proc-ahead", pa, 1.0, 10.0, 5.0), _run("thread-ahead", ta, 1.0, 10.0, 5.0)]
    return {"config": {"server": server}, "runs": runs}


def test_bounds_overlap_in_a_process_and_add_up_on_a_thread():
    run = _run("proc-ahead", 1.0, device=4.0, issue=10.0, sched=5.0)
    assert bounds_ms(run) == {"process": 10.0, "thread": 15.0}
    assert is_launch_bound(run)  # 15 >= 1.4 x 10
    assert not is_launch_bound(_run("proc-ahead", 1.0, device=12.0, issue=10.0, sched=5.0))
    assert not is_launch_bound(_run("proc-ahead", 1.0, device=1.0, issue=10.0, sched=3.0))


def test_proc_ahead_is_measured_against_its_bound():
    # 100 batches of 500 uncached tokens: at max(4, 10, 5) = 10 ms a batch, 50,000 tokens/s
    run = _run("proc-ahead", 45_000.0, device=4.0, issue=10.0, sched=5.0)
    run.update(uncached_tokens=50_000, num_batches=100)
    assert of_bound(run) == pytest.approx(0.9)
    assert of_bound({**run, "t_sched_ms": 20.0}) == pytest.approx(1.8)  # the scheduler bounds it


def test_grid_and_heat_map(tmp_path):
    points = [_point(m, c, 2.0, 1.0) for m in ("a", "b") for c in (8192, 512)]
    models, chunks, cells = grid(points)
    assert models == ["a", "b"] and chunks == [512, 8192]
    assert ratio(cells[("b", 512)], "proc-ahead", "thread-ahead") == 2.0
    assert ratio(cells[("b", 512)], "proc-ahead", "overlap") is None
    pytest.importorskip("matplotlib")
    out = tmp_path / "map.png"
    plot_regime_map(points, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

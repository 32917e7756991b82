"""The regime map's bounds and classification, and its heat map from a sweep result."""

from __future__ import annotations

import pytest

from mpprefill.bench.regime import (
    binding_term,
    bounds_ms,
    grid,
    is_launch_bound,
    launch_ratio,
    of_bound,
    plot_sensitivity_maps,
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


def _point(model: str, chunk: int, pa: float, ta: float, launch: float = 0.0) -> dict:
    server = {
        "emulate_model": model,
        "chunked_prefill_size": chunk,
        "emulate_gpu": "h200",
        "emulate_launch_us": launch,
        "switch_interval_ms": 5.0,
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


def test_the_binding_term_is_the_largest_of_the_process_bound():
    assert binding_term(_run("proc-ahead", 1.0, device=4.0, issue=10.0, sched=5.0)) == "issue"
    assert binding_term(_run("proc-ahead", 1.0, device=12.0, issue=10.0, sched=5.0)) == "device"
    assert binding_term(_run("proc-ahead", 1.0, device=1.0, issue=2.0, sched=3.0)) == "scheduler"
    assert launch_ratio(_run("proc-ahead", 1.0, device=4.0, issue=10.0, sched=5.0)) == 1.5


def test_grid_keys_cells_by_panel_launch_cost_and_budget():
    points = [
        _point(m, c, 2.0, 1.0, launch=x) for m in ("a", "b") for c in (8192, 512) for x in (5, 2)
    ]
    panels, launches, chunks, cells = grid(points)
    assert panels == ["a, switch 5 ms", "b, switch 5 ms"]
    assert launches == [2, 5] and chunks == [512, 8192]
    cell = cells[("b, switch 5 ms", 5, 512)]
    assert cell["config"]["server"]["emulate_model"] == "b"
    assert ratio(cell, "proc-ahead", "thread-ahead") == 2.0
    assert ratio(cell, "proc-ahead", "overlap") is None


def test_sensitivity_maps_are_written_for_the_modes_the_sweep_ran(tmp_path):
    pytest.importorskip("matplotlib")
    points = [_point(m, c, 2.0, 1.0, launch=x) for m in ("a",) for c in (512, 8192) for x in (2, 5)]
    out = tmp_path / "map.png"
    assert plot_sensitivity_maps(points, str(out)) == [str(out)]  # no overlap runs: one map
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for p in points:
        p["runs"].append(_run("overlap", 1.5, 1.0, 10.0, 5.0))
    written = plot_sensitivity_maps(points, str(out))
    assert written == [str(out), str(tmp_path / "map_overlap.png")]
    assert (tmp_path / "map_overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_emulated_sweep_crosses_its_four_dimensions():
    import argparse

    from mpprefill.bench.suite import _emulated_points
    from mpprefill.config import ServerArgs

    args = argparse.Namespace(
        num_requests=64,
        sweep_models="Qwen2.5-0.5B,Llama-3.1-8B",
        sweep_chunks="512,8192",
        sweep_launch_us="2,10",
        sweep_switch_ms=None,
        sweep_prompt_lens=None,
        sweep_link_gbps=None,
        prompt_len=1024,
    )
    base = ServerArgs(device="emulated", switch_interval_ms=0.5)
    points = _emulated_points(args, base)
    assert len(points) == 8
    label, ns, server = points[-1]
    assert label == "Llama-3.1-8B@8192, 10 us/launch, switch 0.5 ms"
    assert ns.num_requests == 64 * 4  # one more request share per 2,048 tokens
    assert (server.emulate_model, server.chunked_prefill_size, server.max_prefill_tokens) == (
        "Llama-3.1-8B",
        8192,
        8192,
    )
    assert server.emulate_launch_us == 10.0 and server.switch_interval_ms == 0.5
    assert args.num_requests == 64  # the command line's namespace is not changed
    assert ns.prompt_len == 1024 and server.emulate_link_gbps is None
    with pytest.raises(ValueError, match="comma-separated"):
        _emulated_points(argparse.Namespace(**{**vars(args), "sweep_chunks": "512,x"}), base)


def test_the_emulated_sweep_crosses_prompt_lengths_and_link_speeds():
    import argparse

    from mpprefill.bench.suite import _emulated_points
    from mpprefill.config import ServerArgs

    args = argparse.Namespace(
        num_requests=2,
        sweep_models="Llama-3.1-8B",
        sweep_chunks="8192",
        sweep_launch_us=None,
        sweep_switch_ms=None,
        sweep_prompt_lens="1024,16384",
        sweep_link_gbps="none,25,400",
        prompt_len=512,
    )
    base = ServerArgs(device="emulated")
    points = _emulated_points(args, base)
    assert len(points) == 6
    grid = [(ns.prompt_len, server.emulate_link_gbps) for _, ns, server in points]
    assert grid == [(p, g) for p in (1024, 16384) for g in (None, 25.0, 400.0)]
    assert points[0][0] == "Llama-3.1-8B@8192, 0 us/launch, switch 5 ms, 1024 tokens"
    assert points[-1][0].endswith(", 16384 tokens, link 400 Gb/s")
    assert args.prompt_len == 512
    with pytest.raises(ValueError, match="comma-separated"):
        _emulated_points(argparse.Namespace(**{**vars(args), "sweep_link_gbps": "25,fast"}), base)

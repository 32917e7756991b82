"""The collectives' share of device time in a bench run record and its table, from the
counters of short emulated runs at TP 1 and TP 2."""

from __future__ import annotations

import dataclasses

import pytest

from mpprefill.bench.router import ReqResult
from mpprefill.bench.runner import summarize_run
from mpprefill.bench.suite import format_table
from mpprefill.config import ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.scheduling.metrics import SchedulerMetrics

pytestmark = pytest.mark.timeout(120)

EMULATED = dict(
    device="emulated", emulate_model="Llama-3.1-8B", chunked_prefill_size=256, worker_threads=1
)


def _run(mode: str, tp: int) -> dict:
    prompts = [[(i * 7 + j) % 4000 + 1 for j in range(200 + 50 * i)] for i in range(4)]
    with PrefillEngine(forward_mode=mode, tp_size=tp, **EMULATED) as eng:
        outs = eng.prefill(prompts, timeout=60)
        after = {"counters": eng.scheduler.metrics.to_dict()}
    results = [
        ReqResult(f"r{i}", len(p), 0.0, "done", o.cached_tokens, o.first_token, t_prefill=1.0)
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]
    before = {"counters": SchedulerMetrics().to_dict()}
    return {**summarize_run(mode, results, before, after), "leaks": {"ok": True}}


def _table(runs: list[dict], tp: int) -> str:
    args = ServerArgs(tp_size=tp, **EMULATED)
    server = dataclasses.asdict(args)
    result = {
        "config": {"server": server, "emulated": args.worker_device.emulated},
        "forward_bound_itps": 1.0,
        "forward_bound": {"replayed_mode": runs[0]["mode"]},
        "runs": runs,
    }
    return format_table(result)


def test_collective_share_of_an_emulated_tp_run():
    """TP 2 in a forward process (its share crosses the Done message), TP 1 in process."""
    one = _run("normal", 1)
    two = _run("proc-ahead", 2)
    assert one["collective_share"] == 0 and one["t_collective_ms"] == 0
    assert 0 < two["collective_share"] < 1
    assert 0 < two["t_collective_ms"] < two["t_device_ms"]
    assert two["collective_share"] == pytest.approx(two["t_collective_ms"] / two["t_device_ms"])
    assert "collectives" not in _table([one], 1)
    share = f"{two['collective_share']:.1%}"
    assert f"TP 2 collectives, proc-ahead: {share} of device time" in _table([two], 2)

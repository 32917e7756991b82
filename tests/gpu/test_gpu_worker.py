"""The forward modes on a GPU: agreement, the WAR barrier under a slow device-side read of
the staging slot, the forward-done fence for KV reads, and a CUDA-free scheduler with
pinned staging."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mpprefill.config import FORWARD_MODES, ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.worker.api import WorkerDied
from mpprefill.worker.events import SchedulerOrder
from mpprefill.worker.process import ProcessWorker
from tests.scheduling.test_engine import shared_prefix_prompts
from tests.worker.helpers import RecordingTransfer, forward_input

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]
ENGINE_KW = dict(
    page_size=16,
    chunked_prefill_size=48,
    max_prefill_tokens=96,
    max_running_requests=4,
    check_invariants=True,
)
RUNS = [(m, "pinned") for m in FORWARD_MODES] + [("proc", "cuda-ipc"), ("proc-ahead", "cuda-ipc")]


@pytest.fixture(scope="module")
def reference():
    prompts = shared_prefix_prompts(11, n=16)
    with PrefillEngine(forward_mode="normal", device="cuda", **ENGINE_KW) as eng:
        outs = eng.prefill(prompts, return_logits=True)
    return prompts, outs


@pytest.mark.parametrize("mode, staging", RUNS)
def test_modes_agree_on_gpu(mode, staging, reference):
    prompts, ref = reference
    with PrefillEngine(forward_mode=mode, device="cuda", staging=staging, **ENGINE_KW) as eng:
        outs = eng.prefill(prompts, return_logits=True)
        eng.check_invariants(flush=True)
    assert [o.first_token for o in outs] == [o.first_token for o in ref]
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o.logits.cpu(), r.logits.cpu(), atol=1e-3, rtol=1e-3)


def test_gpu_matches_cpu(reference):
    prompts, ref = reference
    with PrefillEngine(forward_mode="normal", device="cpu", **ENGINE_KW) as eng:
        cpu = eng.prefill(prompts, return_logits=True)
    agree = sum(a.first_token == b.first_token for a, b in zip(cpu, ref))
    assert agree >= len(ref) - 1  # a near-tie may flip one argmax
    for o, r in zip(cpu, ref):
        torch.testing.assert_close(o.logits, r.logits.cpu(), atol=2e-2, rtol=2e-2)


SLOW_READS = [[i + 1] * (20 + i) for i in range(8)]


def test_war_barrier_holds_against_slow_device_reads(monkeypatch):
    """The worker's reads of each slot trail the forward on a side stream; the scheduler's
    copy stream waits for them on the device before rewriting the slot."""
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_READS", "0.2")
    kw = dict(max_running_requests=1, check_invariants=True, device="cuda", staging="cuda-ipc")
    with PrefillEngine(forward_mode="proc-ahead", **kw) as eng:
        outs = eng.prefill(SLOW_READS)
    assert len(outs) == 8 and eng.scheduler.metrics.num_batches == 8


def test_war_violation_is_caught_on_gpu_without_the_barrier(monkeypatch):
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_READS", "0.3")
    monkeypatch.setattr(SchedulerOrder, "before_write", lambda self, slot: None)
    kw = dict(max_running_requests=1, device="cuda", staging="cuda-ipc")
    eng = PrefillEngine(forward_mode="proc-ahead", **kw)
    with eng, pytest.raises(WorkerDied, match="rewritten"):
        eng.prefill(SLOW_READS)


@pytest.mark.parametrize("staging", ["cuda-ipc", "pinned"])
@pytest.mark.parametrize("fenced", [True, False])
def test_kv_reads_wait_for_the_forward_on_gpu(monkeypatch, staging, fenced):
    """The device sleeps before each forward; a send of that forward's pages issued right
    after submit reads the computed KV only through the fence."""
    monkeypatch.setenv("MPPREFILL_TEST_SLOW_DEVICE", "0.4")
    args = ServerArgs(
        device="cuda",
        staging=staging,
        page_size=16,
        max_total_tokens=512,
        max_running_requests=2,
        chunked_prefill_size=64,
        max_prefill_tokens=64,
        context_length=256,
    )
    worker = ProcessWorker(args.worker_config())
    backend = None
    try:
        assert worker.kv_cache.device.type == "cuda"
        backend = RecordingTransfer(worker.kv_cache, 16, fence=worker.kv_fence if fenced else None)
        vocab = worker.model_config.vocab_size
        worker.submit(forward_input(1, list(range(1, 33)), list(range(32, 64)), vocab))
        backend.ready_sender(3, 2).send(torch.tensor([2, 3]), last=True, first_token=0)
        (read,) = backend.wait_reads()
        worker.collect(timeout=60)
        final = worker.kv_cache.buffer[:, :, 32:64]
        assert float(final.abs().sum()) > 0
        assert torch.equal(read, final) is fenced
    finally:
        if backend is not None:
            backend.close()
        worker.close()


def test_scheduler_never_touches_cuda_with_pinned_staging():
    code = (
        "import torch\n"
        "from mpprefill.engine import PrefillEngine\n"
        "with PrefillEngine(forward_mode='proc-ahead', device='cuda', staging='pinned') as e:\n"
        "    e.prefill([[1, 2, 3] * 20, [5] * 70])\n"
        "print('cuda initialised:', torch.cuda.is_initialized())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True
    )
    assert "cuda initialised: False" in out.stdout, out.stderr[-2000:]

"""A worker that hangs, a sample of the wrong forward, a start that fails, and staging slots
sized for every batch that admission lets through."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest
import torch

import ipc
from mpprefill.bench.procs import children
from mpprefill.config import ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.model import ForwardBatch, ModelConfig
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.api import ForwardInput, Worker, WorkerDied
from mpprefill.worker.local import InlineWorker, ThreadWorker
from mpprefill.worker.messages import Sample
from mpprefill.worker.process import ProcessWorker, _specs
from mpprefill.worker.staging import check_capacity
from tests.worker.helpers import forward_input

pytestmark = pytest.mark.timeout(120)
VOCAB = ModelConfig.tiny().vocab_size


def _deferred(seq: int, ids: list[int], slots: list[int]) -> ForwardInput:
    inp = forward_input(seq, ids, slots, VOCAB)
    inp.delay_sample = True
    return inp


@pytest.fixture
def process_worker():
    worker = ProcessWorker(ServerArgs(forward_mode="proc").worker_config())
    yield worker
    worker.kill_now()


def test_a_hung_forward_process_fails_collect_by_the_deadline(process_worker):
    w = process_worker
    os.kill(w.pid, signal.SIGSTOP)  # alive, but it will never answer
    try:
        w.submit(forward_input(1, [5, 6, 7], [0, 1, 2], VOCAB))
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match="stalled"):
            w.collect(timeout=1.0)
        assert time.monotonic() - t0 < 10
        assert w.death() is None  # hung, not dead: the caller treats it as dead
    finally:
        os.kill(w.pid, signal.SIGCONT)


def test_scheduler_collect_honours_forward_timeout():
    with PrefillEngine(forward_mode="proc", forward_timeout=1.0) as eng:
        eng.prefill([[1, 2, 3]])  # started and warm
        pid = eng.worker.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(WorkerDied, match="stalled"):
                eng.prefill([[4, 5, 6]], timeout=60)
            assert not ipc.pid_alive(pid)  # treated as dead: killed, not waited for
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("kind", ["inline", "thread", "proc"])
def test_sampling_anything_but_the_last_collected_deferred_forward_is_refused(kind, request):
    if kind == "proc":
        w = request.getfixturevalue("process_worker")
    else:
        eng = PrefillEngine(forward_mode="normal")
        request.addfinalizer(eng.close)
        runner = eng.worker.runner
        w = InlineWorker(runner) if kind == "inline" else ThreadWorker(runner)
        request.addfinalizer(w.close)
    first, second = _deferred(1, [5, 6, 7], [0, 1, 2]), _deferred(2, [8, 9], [3, 4])
    w.submit(first)
    with pytest.raises(RuntimeError, match="in flight"):
        w.sample(first)  # not collected yet
    w.collect(timeout=30)
    with pytest.raises(RuntimeError, match="deferred forward due is 1"):
        w.sample(second)  # never submitted
    assert len(w.sample(first).tokens) == 1
    with pytest.raises(RuntimeError, match="due is None"):
        w.sample(first)  # once only
    w.submit(second)
    w.collect(timeout=30)
    assert len(w.sample(second).tokens) == 1


def test_the_forward_process_refuses_a_sample_of_another_forward(process_worker):
    """Its own check, apart from the scheduler side's: a Sample must name the deferred
    forward just before it."""
    w = process_worker
    w.submit(_deferred(1, [5, 6, 7], [0, 1, 2]))
    w.collect(timeout=30)
    w._put(w.ranks[0], Sample(7))
    with pytest.raises(WorkerDied, match="Sample 7, but the deferred forward before it is 1"):
        w._get(w.ranks[0], 30)


def test_a_failed_start_leaves_no_process_segment_or_socket(tmp_path):
    """config.json without weights: the scheduler side reads the config, the forward process
    fails to load the model."""
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    mine = f"mpp_{os.getpid()}_"
    before = set(ipc.list_segments(mine))
    before_children = set(children(os.getpid()))
    with pytest.raises(WorkerDied):
        ProcessWorker(ServerArgs(forward_mode="proc", model_path=str(tmp_path)).worker_config())
    assert set(ipc.list_segments(mine)) == before
    deadline = time.monotonic() + 5
    while set(children(os.getpid())) - before_children and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(children(os.getpid())) - before_children == set()


def test_staging_holds_the_longest_prompt_admission_takes():
    """A model of 131,072 positions without chunking: a 100,000-token prompt passes
    validation, so one batch of it must fit the staging slots; one past the context
    length is refused at admission."""
    config = ModelConfig(max_position_embeddings=131072)
    args = ServerArgs(
        chunked_prefill_size=-1,
        max_total_tokens=140000,
        max_prefill_tokens=8192,
        max_running_requests=4,
    )
    sched = Scheduler(args, config, Worker(), transfer=None)
    sched.validate(Req("long", [1] * 100_000))
    with pytest.raises(ValueError, match="context length 131072"):
        sched.validate(Req("too-long", [1] * 131_073))
    specs = _specs(args.worker_config(), config)
    fb = ForwardBatch.build([[1] * 100_000], [0], [list(range(100_000))])
    check_capacity(fb, specs)
    # Four requests at the context length, all but their last page cached.
    full = ForwardBatch.build([[1] * 16] * 4, [131_056] * 4, [list(range(131_072))] * 4)
    check_capacity(full, specs)


def test_kv_indices_capacity_is_what_one_batch_can_name():
    args = ServerArgs(max_running_requests=3, max_total_tokens=4096)
    specs = _specs(args.worker_config(), ModelConfig(max_position_embeddings=8192))
    assert specs["kv_indices"][0] == (3 * 4096,)  # each request at most the pool long
    assert specs["input_ids"][0] == (max(args.max_prefill_tokens, args.chunked_prefill_size),)
    assert torch.int64 == specs["kv_indices"][1]

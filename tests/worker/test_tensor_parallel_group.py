"""A tensor-parallel group of forward processes (2 CPU ranks over gloo) behind one
scheduler: the same first tokens and logits as one rank, and a dead rank fails the group."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

import pytest
import torch

import ipc
from mpprefill.config import ServerArgs
from mpprefill.engine import PrefillEngine
from mpprefill.model import ModelConfig
from mpprefill.model.export import save_random_model
from mpprefill.worker.api import WorkerDied
from tests.worker.helpers import rank_pids

pytestmark = pytest.mark.timeout(240)

# GQA with one KV head per rank, an MLP and a vocabulary that split in two.
SMALL = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    attention_bias=True,
    architecture="Qwen2ForCausalLM",
)
SYSTEM = [(7 * i) % 500 + 1 for i in range(80)]
# A shared system prompt (prefix hits in the second call), and a prompt longer than a chunk.
PROMPTS = [SYSTEM + [3, 4, 5], SYSTEM + [9] * 20, [(i * 13) % 511 for i in range(150)]]
ENGINE = dict(page_size=16, chunked_prefill_size=64, max_prefill_tokens=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(SMALL, str(tmp_path_factory.mktemp("small")), seed=3)


def run(model_dir: str, mode: str, tp_size: int, **extra):
    with PrefillEngine(
        model_dir, forward_mode=mode, tp_size=tp_size, check_invariants=True, **ENGINE, **extra
    ) as eng:
        first = eng.prefill(PROMPTS[:1], return_logits=True)
        rest = eng.prefill(PROMPTS, return_logits=True)
        assert len(eng.worker.ranks) == tp_size
        prefix = eng.worker.prefix
    assert ipc.list_segments(prefix) == []
    return first + rest


def rel_err(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def tp1(model_dir):
    return run(model_dir, "proc-ahead", 1)


@pytest.mark.parametrize(
    "mode, extra", [("proc", {}), ("proc-ahead", {}), ("proc-ahead", {"delay_sampling": True})]
)
def test_tp2_engine_matches_tp1(model_dir, tp1, mode, extra):
    tp2 = run(model_dir, mode, 2, **extra)
    assert [o.cached_tokens for o in tp1] == [0, 80, 80, 0]
    assert [o.cached_tokens for o in tp2] == [o.cached_tokens for o in tp1]
    assert [o.first_token for o in tp2] == [o.first_token for o in tp1]
    for a, b in zip(tp1, tp2, strict=True):
        assert rel_err(b.logits, a.logits) < 1e-4


def test_tp2_sliding_window_engine_matches_tp1():
    """The built-in model with sliding-window layers in their own (sharded) pool."""
    swa = dict(sliding_window=24, swa_layers="fs", swa_full_tokens_ratio=0.5, **ENGINE)
    outs = {}
    for tp in (1, 2):
        with PrefillEngine(
            forward_mode="proc-ahead", tp_size=tp, check_invariants=True, **swa
        ) as eng:
            outs[tp] = eng.prefill(PROMPTS[:1], return_logits=True)
            outs[tp] += eng.prefill(PROMPTS, return_logits=True)
    assert [o.cached_tokens for o in outs[2]] == [o.cached_tokens for o in outs[1]]
    assert sum(o.cached_tokens for o in outs[2]) > 0
    assert [o.first_token for o in outs[2]] == [o.first_token for o in outs[1]]
    for a, b in zip(outs[1], outs[2], strict=True):
        assert rel_err(b.logits, a.logits) < 1e-4


def test_a_hung_rank_fails_the_group_within_the_forward_timeout(model_dir):
    prompts = [[(i % 50) + 1] * 300 for i in range(40)]
    with PrefillEngine(
        model_dir,
        forward_mode="proc-ahead",
        tp_size=2,
        max_running_requests=2,
        forward_timeout=3.0,
        **ENGINE,
    ) as eng:
        hung = eng.worker.ranks[1].proc.pid
        stopped_at: list[float] = []

        def stop():
            time.sleep(1.0)
            stopped_at.append(time.monotonic())
            os.kill(hung, signal.SIGSTOP)

        threading.Thread(target=stop, daemon=True).start()
        try:
            with pytest.raises(WorkerDied):
                eng.prefill(prompts)
            # the 3 s collective timeout, then the failed group is killed (no graceful wait)
            assert stopped_at and time.monotonic() - stopped_at[0] < 3.0 + 10.0  # loaded CI slack
        finally:
            with contextlib.suppress(ProcessLookupError):  # gone once the group was stopped
                os.kill(hung, signal.SIGCONT)
        eng.close()
        assert not any(rank.proc.is_alive() for rank in eng.worker.ranks)
        assert ipc.list_segments(eng.worker.prefix) == []


def test_each_rank_holds_its_kv_heads_at_the_same_slots(model_dir):
    """Rank r's pool holds KV head r (of 2) at the slots where one rank holds all heads."""
    pools = {}
    for tp in (1, 2):
        with PrefillEngine(model_dir, forward_mode="proc", tp_size=tp, **ENGINE) as eng:
            eng.prefill(PROMPTS)
            pools[tp] = [(kv.buffer.clone(), heads) for kv, heads in eng.worker.kv_shards()]
    ((whole, all_heads),) = pools[1]
    assert all_heads == range(2) and whole.abs().sum() > 0
    assert [heads for _, heads in pools[2]] == [range(0, 1), range(1, 2)]
    for shard, heads in pools[2]:
        assert shard.shape[3] == 1
        want = whole[:, :, :, heads.start : heads.stop]
        assert torch.allclose(shard, want, atol=1e-5, rtol=1e-4)


def test_a_rank_dying_during_start_fails_the_start_at_once():
    """Rank 0 waits for rank 1 at the rendezvous; the start must not wait that long."""
    killed: list[int] = []

    def kill_the_last_rank():
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            pids = rank_pids(os.getpid())
            if len(pids) == 2:
                killed.append(max(pids))  # the later spawn: rank 1
                os.kill(killed[0], signal.SIGKILL)
            time.sleep(0.01)

    threading.Thread(target=kill_the_last_rank, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="tp rank 1"):
        PrefillEngine(forward_mode="proc", tp_size=2, **ENGINE)
    assert killed and time.monotonic() - t0 < 60
    assert rank_pids(os.getpid()) == []
    assert ipc.list_segments(f"mpp_{os.getpid()}_") == []


def _kill_soon(pid: int, after_s: float, killed_at: list[float]) -> None:
    def kill():
        time.sleep(after_s)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


def test_sigkill_of_one_rank_fails_the_group(model_dir):
    prompts = [[(i % 50) + 1] * 300 for i in range(40)]
    with PrefillEngine(
        model_dir, forward_mode="proc-ahead", tp_size=2, max_running_requests=2, **ENGINE
    ) as eng:
        finished = []
        eng.scheduler.reqs.on_finish = finished.append
        killed_at: list[float] = []
        _kill_soon(eng.worker.ranks[1].proc.pid, 1.0, killed_at)
        with pytest.raises(WorkerDied):
            eng.prefill(prompts)
        noticed = time.monotonic()
        assert killed_at and noticed - killed_at[0] < 5.0
        assert len(finished) == len(prompts)  # every request answered, done or failed
        failed = [r for r in finished if r.error]
        assert failed and all("forward process" in r.error for r in failed)
        procs = [rank.proc for rank in eng.worker.ranks]
        assert not any(p.is_alive() for p in procs)  # the surviving rank was stopped too
        assert ipc.list_segments(eng.worker.prefix) == []


def test_idle_group_reports_a_dead_rank_on_its_sentinel(model_dir):
    with PrefillEngine(model_dir, forward_mode="proc", tp_size=2, **ENGINE) as eng:
        assert eng.worker.death() is None
        fd = eng.worker.sentinel
        assert select.select([fd], [], [], 0)[0] == []
        os.kill(eng.worker.ranks[1].proc.pid, signal.SIGKILL)
        assert select.select([fd], [], [], 10)[0] == [fd]
        assert "tp rank 1" in eng.worker.death()
        with pytest.raises(WorkerDied):
            eng.prefill([[1, 2, 3]])
        prefix = eng.worker.prefix
    assert ipc.list_segments(prefix) == []


@pytest.mark.parametrize("mode", ["normal", "overlap", "thread", "thread-ahead"])
def test_in_process_modes_refuse_tp(mode):
    with pytest.raises(ValueError, match="proc or proc-ahead"):
        PrefillEngine(forward_mode=mode, tp_size=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp_size=0), "--tp-size must be >= 1"),
        (dict(tp_size=2, staging="cuda-ipc"), "--staging pinned"),
        (dict(tp_size=2, host_store_size=64), "host-store-size"),
    ],
)
def test_unsupported_tp_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_unshardable_model_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="--tp-size 3"):
        PrefillEngine(forward_mode="proc", tp_size=3)

"""All six forward modes: same tokens, loop order as DESIGN.md, snapshots, early send."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from mpprefill.config import FORWARD_MODES
from mpprefill.engine import PrefillEngine
from mpprefill.sampling.info import PACKED_FIELDS
from mpprefill.scheduling import batch as batch_mod
from mpprefill.scheduling.invariants import InvariantError
from mpprefill.trace.tracer import INSTANT, Tracer, set_tracer
from tests.scheduling.test_engine import shared_prefix_prompts

pytestmark = pytest.mark.timeout(300)
ENGINE_KW = dict(
    page_size=16,
    chunked_prefill_size=48,
    max_prefill_tokens=96,
    max_running_requests=4,
    check_invariants=True,
    # NOTE: one torch thread: two test workers share the cores, and a forward whose
    # threads wait for a busy core runs many times slower
    worker_threads=1,
)


@pytest.fixture(scope="module")
def reference():
    prompts = shared_prefix_prompts(11, n=16)
    with PrefillEngine(forward_mode="normal", **ENGINE_KW) as eng:
        outs = eng.prefill(prompts, return_logits=True)
    return prompts, outs


@pytest.fixture(scope="module")
def engines():
    """`engines(mode)`: the module's one engine with ENGINE_KW in that mode, started when
    first asked for (a forward process costs seconds to start), its cache empty each time.
    The tests that share it put back what they replace on it (monkeypatch)."""
    started: dict[str, PrefillEngine] = {}

    def get(mode: str) -> PrefillEngine:
        if mode not in started:
            started[mode] = PrefillEngine(forward_mode=mode, **ENGINE_KW)
        eng = started[mode]
        eng.flush_cache()
        eng.check_invariants()
        return eng

    yield get
    for eng in started.values():
        eng.close()


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_every_mode_gives_the_same_tokens_and_logits(mode, reference, engines):
    prompts, ref = reference
    eng = engines(mode)
    outs = eng.prefill(prompts, return_logits=True)
    eng.check_invariants(flush=True)
    assert [o.first_token for o in outs] == [o.first_token for o in ref]
    assert [o.cached_tokens for o in outs] == [o.cached_tokens for o in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(o.logits, r.logits, atol=1e-4, rtol=1e-4)


STEP_NAMES = {
    "build": "build",
    "submit": "submit",
    "collect-wait": "collect",
    "sample": "sample",
    "process": "process",
    "early-send": "early_send",
}


@contextlib.contextmanager
def traced_steps():
    """The scheduler thread's steps, (name, seq) in the order they ended, from the tracer."""
    tracer = Tracer("test", enabled=True)
    prev = set_tracer(tracer)
    steps: list[tuple[str, int]] = []
    try:
        yield steps
    finally:
        set_tracer(prev)
        main = threading.get_native_id()
        recs = [r for r in tracer.records if r[1] == main and r[0] in STEP_NAMES]
        recs = [r for r in recs if r[3] != INSTANT and not (r[0] == "build" and r[4] < 0)]
        recs.sort(key=lambda r: r[2] + r[3])
        steps.extend((STEP_NAMES[r[0]], r[4]) for r in recs)


def expected_steps(mode: str, n: int, deferred: bool = True) -> list[tuple[str, int]]:
    """DESIGN.md's order for batches 1..n, one batch per iteration, then the drain."""
    out: list[tuple[str, int]] = []
    if mode in ("thread-ahead", "proc-ahead") and not deferred:
        out += [("build", 1), ("submit", 1)]
        for k in range(2, n + 1):
            out += [("build", k), ("submit", k), ("collect", k - 1), ("process", k - 1)]
        out += [("collect", n), ("process", n)]
    elif mode == "normal":
        for k in range(1, n + 1):
            out += [("build", k), ("submit", k), ("collect", k), ("sample", k), ("process", k)]
    elif mode in ("overlap", "thread", "proc"):
        for k in range(1, n + 1):
            out += [("build", k), ("submit", k), ("collect", k)]
            out += [("process", k - 1)] if k > 1 else []
            out += [("sample", k)]
        out += [("process", n)]
    else:
        out += [("build", 1), ("submit", 1)]
        for k in range(2, n + 1):
            out += [
                ("build", k),
                ("collect", k - 1),
                ("sample", k - 1),
                ("submit", k),
                ("process", k - 1),
            ]
        out += [("collect", n), ("sample", n), ("process", n)]
    return out


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_loop_order_matches_design(mode):
    # One request per batch; none shares a page with another, so no early sends.
    prompts = [[100 + i] * (17 + 3 * i) for i in range(5)]
    with (
        PrefillEngine(
            forward_mode=mode,
            max_running_requests=1,
            delay_sampling=True,
            page_size=16,
            worker_threads=1,
        ) as eng,
        traced_steps() as steps,
    ):
        eng.prefill(prompts)
    assert [s for s in steps if s[0] != "early_send"] == expected_steps(mode, len(prompts))


@pytest.mark.parametrize("mode", ["thread-ahead", "proc-ahead"])
def test_ahead_loops_submit_the_next_batch_before_collecting(mode):
    """Without deferred sampling the worker is handed N + 1 while it runs N."""
    prompts = [[100 + i] * (17 + 3 * i) for i in range(5)]
    kw = dict(max_running_requests=1, page_size=16, worker_threads=1)
    with PrefillEngine(forward_mode=mode, **kw) as eng:
        with traced_steps() as steps:
            eng.prefill(prompts)
        eng.check_invariants(flush=True)
    got = [s for s in steps if s[0] != "early_send"]
    assert got == expected_steps(mode, len(prompts), deferred=False)


@pytest.mark.parametrize("mode", ["thread-ahead", "proc-ahead"])
def test_snapshot_isolated_from_live_batch(mode, reference, engines, monkeypatch):
    """In the ahead loops admission runs while the forward is unfinished: rebinding the
    live batch right after submit changes nothing the forward sees, and result
    processing still lands on the real requests."""
    prompts, ref = reference
    eng = engines(mode)
    s = eng.scheduler
    if mode == "thread-ahead":  # make the forward read late
        forward = eng.worker.runner.forward
        late = lambda *a: (time.sleep(0.01), forward(*a))[1]  # noqa: E731
        monkeypatch.setattr(eng.worker.runner, "forward", late)
    live = []
    take = batch_mod.ForwardSnapshot.take

    def spy(batch):
        live.append(batch)
        return take(batch)

    monkeypatch.setattr(batch_mod.ForwardSnapshot, "take", staticmethod(spy))
    submit = s.submit

    def submit_then_mutate(snap):
        submit(snap)
        batch = live[-1]
        info = batch.sampling_info  # rebound in place: the snapshot's copy keeps its rows
        for name in PACKED_FIELDS:
            setattr(info, name, getattr(info, name)[:0])
        batch.forward, batch.reqs, batch.fill_lens = None, [], []

    monkeypatch.setattr(s, "submit", submit_then_mutate)
    batches_before = s.metrics.num_batches  # the engine ran other tests' batches
    outs = eng.prefill(prompts, return_logits=True, timeout=120)
    eng.check_invariants(flush=True)
    assert len(live) == s.metrics.num_batches - batches_before
    assert [o.first_token for o in outs] == [o.first_token for o in ref]


def test_decrement_on_a_copy_would_leak_and_is_caught(monkeypatch):
    """If snapshots copied the Req objects, the chunk counter would be decremented on the
    copy and the request would never finish cleanly: the invariants must notice."""
    import copy

    take = batch_mod.ForwardSnapshot.take

    def take_with_copied_reqs(batch):
        snap = take(batch)
        snap.batch.reqs = [copy.copy(r) for r in batch.reqs]
        return snap

    monkeypatch.setattr(batch_mod.ForwardSnapshot, "take", staticmethod(take_with_copied_reqs))
    with PrefillEngine(forward_mode="thread-ahead", page_size=16, chunked_prefill_size=32) as eng:
        with pytest.raises(TimeoutError):  # its four chunks take milliseconds when it can finish
            eng.prefill([[3] * 100], timeout=2.0)
        (req,) = eng.scheduler.reqs.live.values()
        assert req.inflight_middle_chunks > 0  # the real counter never came down
        with pytest.raises(InvariantError, match="live"):
            eng.check_invariants()
        assert eng.scheduler.req_pool.available_size() < eng.scheduler.req_pool.size


@pytest.mark.parametrize("mode", FORWARD_MODES)
def test_early_send_on_scheduler_thread_once_per_page(mode, engines, monkeypatch):
    prompts = shared_prefix_prompts(3, n=10)
    eng = engines(mode)
    s = eng.scheduler
    threads, sends = set(), []
    send_kv_chunk = s.send_kv_chunk

    def spy(req, last, end_idx=None):
        threads.add(threading.get_ident())
        sends.append((req.rid, req.start_send_idx))
        send_kv_chunk(req, last, end_idx)

    monkeypatch.setattr(s, "send_kv_chunk", spy)
    finished = []
    monkeypatch.setattr(s.reqs, "on_finish", finished.append)
    with traced_steps() as steps:
        eng.prefill(prompts)
    assert threads == {threading.get_ident()}
    early = [i for i, st in enumerate(steps) if st[0] == "early_send"]
    assert early, "the workload has cache hits, so some prefix must go out early"
    for i in early:  # each early send precedes the submit of its batch
        after = [st[0] for st in steps[i + 1 :] if st[0] != "early_send"]
        assert after[0] == "submit"
    for req in finished:
        pages = req.sender.sent_pages
        assert len(pages) == len(set(pages)) == -(-req.prompt_len // 16)


@pytest.mark.parametrize(
    "env,flags,expected",
    [
        ({}, {}, "proc-ahead"),
        ({"SGLANG_ENABLE_PREFILL_FWD_THREAD": "1"}, {}, "thread"),
        (
            {"SGLANG_ENABLE_PREFILL_FWD_THREAD": "1", "SGLANG_PREFILL_FWD_THREAD_AHEAD": "1"},
            {},
            "thread-ahead",
        ),
        ({"MPPREFILL_FORWARD_MODE": "proc"}, {}, "proc"),
        ({"MPPREFILL_FORWARD_MODE": "proc"}, {"disable_overlap": True}, "normal"),
        ({"SGLANG_ENABLE_PREFILL_FWD_THREAD": "1"}, {"mode": "overlap"}, "overlap"),
    ],
)
def test_mode_dispatch_and_env_aliases(env, flags, expected):
    from mpprefill.modes import resolve_forward_mode

    got = resolve_forward_mode(flags.get("mode"), flags.get("disable_overlap", False), env)
    assert got == expected


@pytest.mark.parametrize(
    "kw,why",
    [
        (dict(forward_mode="proc-ahead", disable_overlap_schedule=True), "disable-overlap"),
        (dict(forward_mode="thread", disaggregation_mode="null"), "disaggregation-mode prefill"),
        (dict(forward_mode="normal", pp_size=2), "pipeline"),
    ],
)
def test_mode_outside_its_conditions_is_a_startup_error(kw, why):
    from mpprefill.config import ServerArgs

    with pytest.raises(ValueError, match=why):
        ServerArgs(**kw)
    with pytest.raises(ValueError, match=why):
        PrefillEngine(**kw)


def test_the_mode_table_says_where_each_forward_runs():
    from mpprefill.modes import MODES

    got = {n: (m.worker, m.overlap, m.ahead) for n, m in MODES.items()}
    assert got == {
        "normal": ("inline", False, False),
        "overlap": ("inline", True, False),
        "thread": ("thread", True, False),
        "thread-ahead": ("thread", True, True),
        "proc": ("process", True, False),
        "proc-ahead": ("process", True, True),
    }
    assert [n for n, m in MODES.items() if m.in_process] == ["proc", "proc-ahead"]


def test_the_environment_is_read_once_when_the_args_are_made(monkeypatch):
    from mpprefill.config import ServerArgs

    monkeypatch.setenv("MPPREFILL_FORWARD_MODE", "thread")
    args = ServerArgs()
    monkeypatch.setenv("MPPREFILL_FORWARD_MODE", "proc")
    assert args.forward_mode == "thread" and args.mode.on_thread
    assert args.replace(page_size=32).mode.name == "thread"  # copies keep the name

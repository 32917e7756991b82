"""The prefill's first token under a repetition penalty over its prompt, and its logprob,
through the scheduler and every kind of worker (inline, thread, forward process; sampled
with the forward or deferred): equal to transformers, and handed to the KV send."""

from __future__ import annotations

import functools
import random
import time

import pytest
import torch

from mpprefill.config import ServerArgs
from mpprefill.disagg.sender import FakeTransfer
from mpprefill.sampling.params import SamplingParams
from mpprefill.scheduling.loops import LOOPS
from mpprefill.scheduling.req import Req
from mpprefill.scheduling.scheduler import Scheduler
from mpprefill.worker.factory import make_worker
from tests.e2e.checkpoint import VOCAB, save_checkpoint

pytestmark = pytest.mark.timeout(180)
PENALTY = 1.3
ASKING = dict(repetition_penalty=PENALTY, return_logprob=True)
PARAMS = [
    SamplingParams(**ASKING, top_logprobs_num=5),
    SamplingParams(repetition_penalty=PENALTY),
    SamplingParams(**ASKING, temperature=0.8, seed=1, top_logprobs_num=2),
    SamplingParams(return_logprob=True, top_logprobs_num=3),  # no penalty
    SamplingParams(),
]
TEMPERATURES = [1.0, 1.0, 0.8, 1.0, 1.0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = save_checkpoint(tmp_path_factory.mktemp("qwen2"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval().float()
    return path, hf


def hf_first(hf, ids: list[int], penalty: float) -> tuple[int, torch.Tensor]:
    """transformers' greedy first token under `penalty`, and its penalised last logits (the
    logits as they are for penalty 1). The model, the prompt and the penalty fix them, so
    each is computed once a test process (every mode checks the same prompts)."""
    return _hf_first(hf, tuple(ids), penalty)


@functools.cache
def _hf_first(hf, ids: tuple[int, ...], penalty: float) -> tuple[int, torch.Tensor]:
    import transformers

    x = torch.tensor([ids])
    with torch.no_grad():
        logits = hf(x).logits[0, -1].float()
        out = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=1,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=0,
            eos_token_id=None,
        )
    penalised = transformers.RepetitionPenaltyLogitsProcessor(penalty)(x, logits[None])[0]
    return int(out[0, -1]), penalised


@pytest.fixture(scope="module")
def cases(checkpoint):
    """Prompts (some long enough to be chunked) whose greedy first token the penalty
    changes, and one it does not: the reference first tokens and penalised logits."""
    _, hf = checkpoint
    rng = random.Random(0)
    changed, kept = [], []
    while len(changed) < 4 or not kept:
        n = rng.choice((7, 23, 41))
        ids = [rng.randrange(3, VOCAB) for _ in range(n)]
        ids += ids[: n // 2]  # repeats, as a small random model likes them
        token, penalised = hf_first(hf, ids, PENALTY)
        plain, _ = hf_first(hf, ids, 1.0)
        (changed if token != plain else kept).append((ids, token, penalised))
    return [*changed[:3], kept[0], changed[3]]


def run_prefill(path, mode: str, delay: bool, reqs: list[Req], timeout: float = 120.0):
    args = ServerArgs(
        model_path=str(path),
        forward_mode=mode,
        page_size=4,
        chunked_prefill_size=16,
        delay_sampling=delay,
        check_invariants=True,
        worker_threads=1,  # NOTE: two test workers share the cores; see test_engine
    )
    worker, config = make_worker(args, args.mode)
    done: list[Req] = []
    s = Scheduler(args, config, worker, FakeTransfer(), on_finish=done.append)
    deadline = time.monotonic() + timeout

    def until() -> bool:
        assert time.monotonic() < deadline, f"{len(s.reqs.live)} requests left"
        return not s.reqs.live and s.forwards_in_flight == 0

    try:
        for rounds in (reqs[: len(reqs) // 2], reqs[len(reqs) // 2 :]):  # the second: cached
            for r in rounds:
                s.add_request(r)
            LOOPS[args.mode.name](s, until)
    finally:
        worker.close()
    assert all(r.error is None for r in done), [r.error for r in done]
    return done


@pytest.mark.parametrize(
    "mode, delay",
    [("normal", False), ("thread-ahead", True), ("proc-ahead", False), ("proc", True)],
)
def test_first_token_and_logprob_equal_transformers(checkpoint, cases, mode, delay):
    path, _ = checkpoint
    reqs = []
    for round_ in range(2):
        for i, (ids, _, _) in enumerate(cases):
            reqs.append(Req(f"r{round_}-{i}", ids, PARAMS[i]))
    run_prefill(path, mode, delay, reqs)
    for r in reqs:
        i = int(r.rid.split("-")[1])
        ids, _, _ = cases[i]
        p = r.sampling_params
        token, logits = hf_first(checkpoint[1], ids, p.repetition_penalty)
        if p.is_greedy:
            assert r.first_token == token, r.rid
        assert r.sender.first_token == r.first_token
        if not p.return_logprob:
            assert r.output_logprobs == [] and r.sender.first_logprob is None
            continue
        ref = torch.log_softmax(logits / TEMPERATURES[i], dim=-1)
        [lp] = r.output_logprobs
        assert r.sender.first_logprob == lp  # it goes out with the KV
        assert lp.logprob == pytest.approx(float(ref[r.first_token]), abs=1e-4), r.rid
        top_v, top_i = torch.topk(ref, p.top_logprobs_num)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    assert any(r.cached_tokens for r in reqs)  # the second round's prompts were cached

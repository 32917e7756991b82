"""Penalties and logprobs in the sampler, against loops by hand and transformers' own
repetition-penalty processor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpprefill.sampling import sampler
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import to_host
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.penalty import TokenHistory, apply_penalties, prompt_mask
from mpprefill.sampling.sampler import sample_with_logprobs
from mpprefill.sampling.token_logprob import TokenLogprob

VOCAB = 12


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3


def _by_hand(logits: list[float], counts: list[int], prompt: set[int], p: SamplingParams):
    out = []
    for t, x in enumerate(logits):
        x -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
        if t in prompt or counts[t] > 0:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out.append(x)
    return out


def test_penalties_match_a_loop_by_hand() -> None:
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=-1.2, presence_penalty=2.0, repetition_penalty=0.6),
        SamplingParams(),
    ]
    prompts = [[0, 1], [2, 3, 3, 11], [5, 0], [4]]
    logits = _logits(len(params))
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 3, (len(params), VOCAB), generator=g)
    info = SamplingBatchInfo.from_params(params, VOCAB, prompts)
    mask = prompt_mask(info, VOCAB)
    out = apply_penalties(logits, info, TokenHistory(counts, mask))
    for i, p in enumerate(params):
        prompt = set(prompts[i]) if p.repetition_penalty != 1.0 else set()
        ref = _by_hand(logits[i].tolist(), counts[i].tolist(), prompt, p)
        assert out[i].tolist() == pytest.approx(ref, rel=1e-6, abs=1e-6), i
    assert torch.equal(out[3], logits[3])  # neutral values leave a row exactly as it was


def test_prompt_mask_marks_only_the_rows_with_a_repetition_penalty() -> None:
    params = [SamplingParams(repetition_penalty=1.1), SamplingParams(), SamplingParams()]
    params[2] = SamplingParams(repetition_penalty=1.9)
    prompts = [[3, 3, 9], [1, 2], [0, 11, 4]]
    mask = prompt_mask(SamplingBatchInfo.from_params(params, VOCAB, prompts), VOCAB)
    expected = torch.zeros(3, VOCAB, dtype=torch.bool)
    expected[0, [3, 9]] = True
    expected[2, [0, 11, 4]] = True
    assert torch.equal(mask, expected)
    assert prompt_mask(SamplingBatchInfo.from_params(params, VOCAB), VOCAB) is None


def _hf_repetition(logits: torch.Tensor, prompt: list[int], penalty: float) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    proc = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    return proc(torch.tensor([prompt]), logits[None].clone())[0]


def test_first_token_greedy_equals_transformers_repetition_penalty() -> None:
    """The prefill's path: no history given, the prompts come in `info.penalty_ids`."""
    logits = _logits(6, seed=3)
    prompts = [[int(row.argmax()), 1, 2] for row in logits]  # the best token is repeated
    penalties = [1.3, 2.0, 0.5, 1.0, 1.7, 1.05]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    info = SamplingBatchInfo.from_params(params, VOCAB, prompts)
    got = sample_with_logprobs(logits, info).tokens.tolist()
    ref = [int(_hf_repetition(logits[i], prompts[i], p).argmax()) for i, p in enumerate(penalties)]
    assert got == ref
    assert got != logits.argmax(-1).tolist()  # some row changed its choice


def test_logprobs_equal_log_softmax_of_the_penalised_logits() -> None:
    params = [
        SamplingParams(return_logprob=True, top_logprobs_num=3),  # greedy: T = 1
        SamplingParams(temperature=0.7, seed=5, return_logprob=True, top_logprobs_num=5),
        SamplingParams(temperature=1.3, seed=6),  # does not ask
        SamplingParams(temperature=2.0, top_k=1, return_logprob=True),  # greedy: T = 1
        SamplingParams(
            temperature=0.9, seed=7, repetition_penalty=1.4, return_logprob=True, top_logprobs_num=2
        ),
    ]
    temperatures = [1.0, 0.7, None, 1.0, 0.9]
    prompts = [[0], [1], [2], [3], [4, 5, 6, 7]]
    logits = _logits(len(params), seed=4)
    info = SamplingBatchInfo.from_params(params, VOCAB, prompts)
    out = sample_with_logprobs(logits, info, step=2)
    rows = to_host(out.logprobs, params)
    assert rows[2] is None and math.isnan(out.logprobs.token[2])
    for i, p in enumerate(params):
        if not p.return_logprob:
            continue
        penalised = _hf_repetition(logits[i], prompts[i], p.repetition_penalty)
        ref = torch.log_softmax(penalised / temperatures[i], dim=-1)
        token = int(out.tokens[i])
        assert rows[i].logprob == pytest.approx(float(ref[token]), abs=1e-5)
        top_v, top_i = torch.topk(ref, p.top_logprobs_num)
        assert [t for t, _ in rows[i].top] == top_i.tolist()
        assert [v for _, v in rows[i].top] == pytest.approx(top_v.tolist(), abs=1e-5)
    assert rows[3].top == [] and isinstance(rows[3], TokenLogprob)
    assert out.tokens[0] == logits[0].argmax() and out.tokens[3] == logits[3].argmax()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(fn) -> list[str]:
    with _CountOps() as counter:
        fn()
    return counter.ops


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_batch_that_asks_nothing_costs_nothing_extra(temperature: float) -> None:
    """Penalties and logprobs add no tensor operation to a batch where no row uses them,
    whatever prompts it was given."""
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    logits = _logits(4, seed=8)
    info = SamplingBatchInfo.from_params(params, VOCAB, [[1, 2]] * 4)
    plain = _ops(lambda: sampler._draw(logits, info, 0, None))
    assert _ops(lambda: sample_with_logprobs(logits, info)) == plain
    asking = [SamplingParams(temperature=temperature, seed=1, return_logprob=True)] * 4
    info = SamplingBatchInfo.from_params(asking, VOCAB)
    assert len(_ops(lambda: sample_with_logprobs(logits, info))) > len(plain)

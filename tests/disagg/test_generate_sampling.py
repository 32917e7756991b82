"""The decode generator's penalties and logprobs: greedy equal to transformers'
`generate(repetition_penalty=...)` and to a by-hand loop of OpenAI's frequency and presence
penalties over transformers' logits; logprobs equal to log_softmax of those logits."""

from __future__ import annotations

import pytest
import torch

from mpprefill.decode.generate import Generator
from mpprefill.memory.allocator import cdiv
from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import to_host
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.sampler import sample_with_logprobs
from mpprefill.sampling.token_logprob import UNKNOWN, TokenLogprob
from tests.disagg.test_generate import PAGE, _hf_model, _loaded, dense_pool, prompts

LENS = (5, 16, 23)
N = 10  # new tokens per sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """transformers' Llama and ours, loaded from its checkpoint."""
    hf = _hf_model("LlamaForCausalLM", False)
    return hf, _loaded(hf, tmp_path_factory.mktemp("llama"))


def prefill(model, kv, allocator, ids: list[int], params: SamplingParams):
    """The prompt into fresh pages; the first token drawn as the prefill draws it (step 0,
    the repetition penalty over the prompt): (pages, token, its TokenLogprob or None)."""
    pages = allocator.alloc_pages(cdiv(len(ids), PAGE)).flip(0)
    slots = allocator.slots_of(pages)[: len(ids)].tolist()
    logits = model(ForwardBatch.build([ids], [0], [slots]), kv)
    info = SamplingBatchInfo.from_params([params], logits.shape[-1], [ids])
    out = sample_with_logprobs(logits, info, 0)
    return pages, int(out.tokens[0]), to_host(out.logprobs, [params])[0]


def generate(ours, cases: list[tuple[list[int], SamplingParams]]):
    """All cases in one batch: per case (tokens, logprobs: one TokenLogprob per token, or
    None where it did not ask)."""
    kv, allocator = dense_pool(ours, 64)
    free_before = allocator.num_free_pages
    gen = Generator(ours, kv, allocator, max_running=len(cases))
    tokens: dict = {}
    logprobs: dict = {}
    for key, (ids, params) in enumerate(cases):
        pages, first, lp = prefill(ours, kv, allocator, ids, params)
        assert gen.add(key, ids, pages, first, params, lp) is None
        tokens[key] = [first]
        logprobs[key] = None if lp is None else [lp]
    while gen.num_running:
        for out in gen.step():
            tokens[out.key] += out.new_tokens
            assert (out.logprobs is None) == (logprobs[out.key] is None)
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_tokens)
                logprobs[out.key] += out.logprobs
    assert allocator.num_free_pages == free_before
    return [(tokens[k], logprobs[k]) for k in range(len(cases))]


def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0, -1].float()


def hf_repetition_greedy(hf, ids: list[int], penalty: float, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            repetition_penalty=penalty,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def openai_penalised(logits: torch.Tensor, output: list[int], p: SamplingParams) -> torch.Tensor:
    """By hand: logit[t] -= frequency * count(t) + presence * (count(t) > 0), output only."""
    out = logits.clone()
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def by_hand_greedy(hf, ids: list[int], p: SamplingParams, n: int) -> list[int]:
    output: list[int] = []
    for _ in range(n):
        output.append(int(openai_penalised(hf_logits(hf, ids + output), output, p).argmax()))
    return output


def test_repetition_penalty_greedy_equals_transformers(models):
    hf, ours = models
    vocab = ours.config.vocab_size
    cases = [
        (ids, SamplingParams(max_new_tokens=N, repetition_penalty=pen))
        for ids, pen in zip(prompts(vocab, LENS, seed=3), (1.3, 1.3, 1.8), strict=True)
    ]
    cases.append((prompts(vocab, (9,), seed=4)[0], SamplingParams(max_new_tokens=N)))
    got = generate(ours, cases)
    changed = 0
    for (ids, p), (tokens, logprobs) in zip(cases, got, strict=True):
        assert logprobs is None
        assert tokens == hf_repetition_greedy(hf, ids, p.repetition_penalty, N), len(ids)
        changed += tokens != hf_repetition_greedy(hf, ids, 1.0, N)
    assert changed >= 2  # the penalty changed what greedy picks


def test_frequency_and_presence_penalties_equal_a_loop_by_hand(models):
    hf, ours = models
    vocab = ours.config.vocab_size
    settings = [
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(frequency_penalty=0.6, presence_penalty=-0.5),
        dict(frequency_penalty=-2.0),  # a negative one rewards repeats
    ]
    cases = [
        (ids, SamplingParams(max_new_tokens=N, **kw))
        for ids, kw in zip(prompts(vocab, (5, 16, 23, 8), seed=6), settings, strict=True)
    ]
    got = generate(ours, cases)
    changed = 0
    for (ids, p), (tokens, _) in zip(cases, got, strict=True):
        assert tokens == by_hand_greedy(hf, ids, p, N), p
        changed += tokens != by_hand_greedy(hf, ids, SamplingParams(), N)
    assert changed >= 2


def test_logprobs_equal_log_softmax_of_transformers_logits(models):
    """Greedy and sampled rows, with and without penalties, and a row that does not ask;
    each token's logprob is of the penalised logits over its temperature."""
    hf, ours = models
    vocab = ours.config.vocab_size
    asking = dict(max_new_tokens=N, return_logprob=True)
    params = [
        SamplingParams(**asking, top_logprobs_num=5),
        SamplingParams(**asking, temperature=0.8, seed=3, top_logprobs_num=3),
        SamplingParams(**asking, temperature=1.2, seed=4, frequency_penalty=0.5),
        SamplingParams(**asking, repetition_penalty=1.3, top_logprobs_num=20),
        SamplingParams(max_new_tokens=N, temperature=0.9, seed=5),
    ]
    temperatures = [1.0, 0.8, 1.2, 1.0, None]
    ids_list = prompts(vocab, (5, 16, 23, 11, 7), seed=8)
    got = generate(ours, list(zip(ids_list, params, strict=True)))
    transformers = pytest.importorskip("transformers")
    for ids, p, temp, (tokens, logprobs) in zip(ids_list, params, temperatures, got):
        if not p.return_logprob:
            assert logprobs is None
            continue
        assert len(logprobs) == len(tokens) == N
        rep = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        for k, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            seq = ids + tokens[:k]
            ref = openai_penalised(hf_logits(hf, seq), tokens[:k], p)
            ref = rep(torch.tensor([seq]), ref[None])[0] if p.repetition_penalty != 1 else ref
            ref = torch.log_softmax(ref / temp, dim=-1)
            assert lp.logprob == pytest.approx(float(ref[token]), abs=1e-4), (p, k)
            top_v, top_i = torch.topk(ref, p.top_logprobs_num)
            assert [t for t, _ in lp.top] == top_i.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def test_the_first_tokens_logprob_is_the_prefills(models):
    """add() hands the prefill's TokenLogprob back as the first token's; one that asks
    without it (a prefill that sent none) reports it unknown."""
    _, ours = models
    kv, allocator = dense_pool(ours, 16)
    gen = Generator(ours, kv, allocator)
    ids = prompts(ours.config.vocab_size, (6,), seed=9)[0]
    params = SamplingParams(max_new_tokens=1, return_logprob=True, top_logprobs_num=1)
    pages, first, lp = prefill(ours, kv, allocator, ids, params)
    out = gen.add("a", ids, pages, first, params, lp)
    assert out.new_tokens == [first] and out.logprobs == [lp]
    assert isinstance(lp, TokenLogprob) and lp.top[0][0] == first  # greedy: the best one
    pages, first, _ = prefill(ours, kv, allocator, ids, params)
    assert gen.add("b", ids, pages, first, params).logprobs == [UNKNOWN]
    plain = SamplingParams(max_new_tokens=1)
    pages, first, _ = prefill(ours, kv, allocator, ids, plain)
    assert gen.add("c", ids, pages, first, plain).logprobs is None

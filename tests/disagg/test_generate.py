"""The decode side's generator: continuous batching over a pool that holds the prompts' KV,
token for token equal to transformers' greedy generate; stop rules, pages, seeded sampling."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mpprefill.decode.generate import Generator, Output
from mpprefill.disagg.plane_map import window_first_page
from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.memory.swa_allocator import SwaPagedAllocator
from mpprefill.model import ForwardBatch, LlamaForCausalLM, ModelConfig, load_model
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.sampler import sample

PAGE = 4
LENS = (1, 5, 16, 17, 40)  # 16: the first decode token opens a new page
MAX_NEW = (16, 1, 7, 16, 11)
GREEDY_MAX = 16


def _transformers():
    return pytest.importorskip(
        "transformers", reason="the greedy oracle needs transformers (pip install transformers)"
    )


def small_model(seed: int = 0) -> LlamaForCausalLM:
    config = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    model.init_random_weights(seed, std=0.1)
    return model


def dense_pool(model, num_pages: int) -> tuple[KVCache, PagedTokenAllocator]:
    """The decode receiver's layout: one dense pool, every layer, one plain allocator."""
    layers, heads, dim = KVCache.model_dims(model.config)
    kv = KVCache(layers, num_pages * PAGE, heads, dim, model.config.torch_dtype)
    return kv, PagedTokenAllocator(num_pages, PAGE)


def prompts(vocab: int, lens=LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def prefill(model, kv, allocator, ids: list[int], params: SamplingParams | None = None):
    """Run the prompt through the model into fresh pages (scattered, not in id order) the
    way a prefill does; (pages, first token sampled at step 0)."""
    pages = allocator.alloc_pages(cdiv(len(ids), PAGE)).flip(0)
    slots = allocator.slots_of(pages)[: len(ids)].tolist()
    fb = ForwardBatch.build([ids], [0], [slots])
    if allocator.has_swa_pool:
        fb.swa_out_cache_loc = allocator.swa_slots(fb.out_cache_loc)
        fb.swa_kv_indices = allocator.swa_slots(fb.kv_indices, missing=-1)
    logits = model(fb, kv)
    info = SamplingBatchInfo.from_params([params or SamplingParams()], logits.shape[-1])
    return pages, int(sample(logits, info, 0)[0])


def run(gen: Generator, arrivals: dict[int, list[tuple]]) -> dict:
    """Add each step's arrivals (key, ids, pages, first, params), step until all are done;
    key -> (completion, finish_reason). Checks the Output stream's invariants on the way."""
    done: dict = {}
    tokens: dict = {}
    step = 0
    while step <= max(arrivals, default=0) or gen.num_running or gen.num_waiting:
        for key, ids, pages, first, params in arrivals.get(step, []):
            tokens[key] = [first]
            out = gen.add(key, ids, pages, first, params)
            if out is not None:
                assert out.finished and out.new_tokens == [first] and out.key == key
                done[key] = (tokens[key], out.finish_reason)
        for out in gen.step():
            assert isinstance(out, Output) and out.key not in done
            tokens[out.key] += out.new_tokens
            assert out.finished == (out.finish_reason is not None)
            if out.finished:
                done[out.key] = (tokens[out.key], out.finish_reason)
        step += 1
    assert set(done) == set(tokens)
    return done


# ---- greedy == transformers -------------------------------------------------------------


def _hf_model(arch: str, tie: bool, **extra):
    transformers = _transformers()
    pytest.importorskip("safetensors", reason="checkpoints are read with safetensors")
    from tests.model.test_hf_oracle import DIMS

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**DIMS, **extra}, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape))
    model.generation_config.eos_token_id = None  # compare whole runs; stops are tested below
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _loaded(hf, tmp_path):
    from tests.model.test_hf_oracle import save

    return load_model(save(hf, tmp_path))


def _check_greedy(hf, ours, kv, allocator, ids_list) -> None:
    free_before = allocator.num_free_pages
    gen = Generator(ours, kv, allocator, eos_token_ids=(), max_running=3)
    arrivals: dict[int, list[tuple]] = {}
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        pages, first = prefill(ours, kv, allocator, ids)
        params = SamplingParams(max_new_tokens=n)
        arrivals.setdefault((0, 0, 2, 3, 3)[r], []).append((r, ids, pages, first, params))
    done = run(gen, arrivals)
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        completion, reason = done[r]
        assert completion == hf_greedy(hf, ids, GREEDY_MAX)[:n], f"prompt of {len(ids)}"
        assert reason == {"type": "length", "length": n}
    assert allocator.num_free_pages == free_before
    allocator.check()


@pytest.mark.parametrize(
    "arch, tie", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)], ids=["llama", "qwen2"]
)
def test_greedy_matches_transformers(tmp_path, arch, tie):
    hf = _hf_model(arch, tie)
    ours = _loaded(hf, tmp_path)
    assert ours.config.num_key_value_heads < ours.config.num_attention_heads  # GQA
    assert ours.config.tie_word_embeddings == tie
    kv, allocator = dense_pool(ours, 64)
    allocator.alloc_pages(3)  # page ids != prompt order
    _check_greedy(hf, ours, kv, allocator, prompts(ours.config.vocab_size))


def _qwen2_swa(window: int):
    return _hf_model(
        "Qwen2ForCausalLM",
        False,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=1,
    )


def test_sliding_window_greedy_on_the_last_window_only(tmp_path):
    """The decode receiver's dense pool holds SWA layers' KV for the prompt's last window
    only: everything before it is NaN here, and generation still equals transformers'."""
    window = 9
    hf = _qwen2_swa(window)
    ours = _loaded(hf, tmp_path)
    swa = list(KVCache.swa_layers_of(ours.config))
    assert swa == [1, 2]
    kv, allocator = dense_pool(ours, 64)
    ids_list = prompts(ours.config.vocab_size, seed=1)
    free_before = allocator.num_free_pages
    gen = Generator(ours, kv, allocator)
    arrivals = []
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        pages, first = prefill(ours, kv, allocator, ids)
        unsent = window_first_page(len(ids), window, PAGE) * PAGE
        slots = allocator.slots_of(pages)[:unsent]
        for layer in swa:
            kv.k(layer)[slots] = float("nan")
            kv.v(layer)[slots] = float("nan")
        arrivals.append((r, ids, pages, first, SamplingParams(max_new_tokens=n)))
    assert any(len(ids) > window + PAGE for ids in ids_list)
    done = run(gen, {0: arrivals})
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        assert done[r][0] == hf_greedy(hf, ids, GREEDY_MAX)[:n], f"prompt of {len(ids)}"
    assert allocator.num_free_pages == free_before


def test_sliding_window_greedy_on_an_swa_pool(tmp_path):
    """The prefill's layout (SWA pool and SwaPagedAllocator): out-of-window SWA pages freed
    before generating are never needed."""
    window = 9
    hf = _qwen2_swa(window)
    ours = _loaded(hf, tmp_path)
    kv = KVCache.for_model(ours.config, 64 * PAGE, num_swa_slots=40 * PAGE)
    allocator = SwaPagedAllocator(64, PAGE, 40)
    padding = allocator.swa.alloc_pages(2)  # SWA page ids != full page ids
    ids_list = prompts(ours.config.vocab_size, seed=2)
    free_before = allocator.num_free_pages, allocator.num_free_swa_pages
    gen = Generator(ours, kv, allocator)
    arrivals = []
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        pages, first = prefill(ours, kv, allocator, ids)
        first_kept = window_first_page(len(ids), window, PAGE)
        freed = allocator.free_swa(pages[:first_kept] * PAGE)
        assert freed == first_kept * PAGE
        arrivals.append((r, ids, pages, first, SamplingParams(max_new_tokens=n)))
    done = run(gen, {0: arrivals})
    for r, (ids, n) in enumerate(zip(ids_list, MAX_NEW, strict=True)):
        assert done[r][0] == hf_greedy(hf, ids, GREEDY_MAX)[:n], f"prompt of {len(ids)}"
    assert (allocator.num_free_pages, allocator.num_free_swa_pages) == free_before
    allocator.swa.free(allocator.swa.slots_of(padding))
    allocator.check()


# ---- stop rules -------------------------------------------------------------------------


def _one(model, n_pages: int = 32, ids=None, eos=(), **params):
    """Generate one sequence alone: (completion, finish_reason, allocator, free before)."""
    kv, allocator = dense_pool(model, n_pages)
    free_before = allocator.num_free_pages
    ids = ids or prompts(model.config.vocab_size, (11,))[0]
    sampling = SamplingParams(**params)
    pages, first = prefill(model, kv, allocator, ids, sampling)
    gen = Generator(model, kv, allocator, eos_token_ids=eos)
    done = run(gen, {0: [("r", ids, pages, first, sampling)]})
    assert allocator.num_free_pages == free_before
    allocator.check()
    return done["r"]


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.fixture(scope="module")
def full_run(model):
    completion, reason = _one(model, max_new_tokens=12)
    assert reason == {"type": "length", "length": 12} and len(completion) == 12
    return completion


def _stop_at(full: list[int]) -> tuple[int, list[int]]:
    """A token of the run past its first, and the run up to its first occurrence."""
    token = full[5]
    cut = full.index(token) + 1
    return token, full[:cut]


def test_stop_token_ids_end_with_the_token(model, full_run):
    token, expected = _stop_at(full_run)
    completion, reason = _one(model, max_new_tokens=12, stop_token_ids=[token])
    assert completion == expected and completion[-1] == token
    assert reason == {"type": "stop", "matched": token}
    ignored, reason = _one(model, max_new_tokens=12, stop_token_ids=[token], ignore_eos=True)
    assert (ignored, reason) == (full_run[:12], {"type": "length", "length": 12})


def test_eos_stops_unless_ignore_eos(model, full_run):
    token, expected = _stop_at(full_run)
    completion, reason = _one(model, eos=(999, token), max_new_tokens=12)
    assert completion == expected
    assert reason == {"type": "stop", "matched": token}
    completion, reason = _one(model, eos=(token,), max_new_tokens=12, ignore_eos=True)
    assert completion == full_run
    assert reason == {"type": "length", "length": 12}


def test_length_is_checked_before_stop(model, full_run):
    """SGLang's order: the last allowed token ends on length even when it is a stop token."""
    n = full_run.index(full_run[5]) + 1
    completion, reason = _one(model, max_new_tokens=n, stop_token_ids=[full_run[n - 1]])
    assert completion == full_run[:n]
    assert reason == {"type": "length", "length": n}


def test_first_token_can_finish_at_once(model, full_run):
    """max_new_tokens == 1, or a first token that stops: add() answers, no forward runs."""
    kv, allocator = dense_pool(model, 16)
    ids = prompts(model.config.vocab_size, (11,))[0]
    gen = Generator(model, kv, allocator, eos_token_ids=[full_run[0]])
    free_before = allocator.num_free_pages
    cases = [
        (SamplingParams(max_new_tokens=1), {"type": "length", "length": 1}),
        (SamplingParams(max_new_tokens=5), {"type": "stop", "matched": full_run[0]}),
        (
            SamplingParams(max_new_tokens=5, stop_token_ids=[full_run[0]]),
            {"type": "stop", "matched": full_run[0]},
        ),
    ]
    for i, (params, reason) in enumerate(cases):
        pages, first = prefill(model, kv, allocator, ids)
        assert first == full_run[0]
        snapshot = kv.storage.clone()
        assert gen.add(i, ids, pages, first, params) == Output(i, [first], True, reason)
        assert gen.num_running == 0 and gen.step() == []
        assert torch.equal(kv.storage, snapshot)
        assert allocator.num_free_pages == free_before
    pages, first = prefill(model, kv, allocator, ids)
    ignored = SamplingParams(max_new_tokens=2, ignore_eos=True, stop_token_ids=[full_run[0]])
    assert gen.add("x", ids, pages, first, ignored) is None and gen.num_running == 1
    [out] = gen.step()
    assert out == Output("x", [full_run[1]], True, {"type": "length", "length": 2})


# ---- pages ------------------------------------------------------------------------------


def test_out_of_pages_aborts_and_frees(model):
    """Two prompts of whole pages, one spare page: the first takes it, the second aborts;
    the first runs until it needs another page, then aborts too."""
    kv, allocator = dense_pool(model, 5)
    ids_list = prompts(model.config.vocab_size, (8, 8))
    gen = Generator(model, kv, allocator)
    free_before = allocator.num_free_pages
    for r, ids in enumerate(ids_list):
        pages, first = prefill(model, kv, allocator, ids)
        assert gen.add(r, ids, pages, first, SamplingParams(max_new_tokens=50)) is None
    assert allocator.num_free_pages == 1
    first_step = {o.key: o for o in gen.step()}
    assert first_step[0].new_tokens and not first_step[0].finished
    assert first_step[1].new_tokens == [] and first_step[1].finished
    assert first_step[1].finish_reason["type"] == "abort"
    assert "out of KV pages" in first_step[1].finish_reason["message"]
    tokens = [first_step[0].new_tokens[0]]
    while gen.num_running:
        [out] = gen.step()
        tokens += out.new_tokens
    assert out.finish_reason["type"] == "abort" and out.new_tokens == []
    # it ends holding all 5 pages: one decode step (one token) per position 8..19
    assert len(tokens) == 5 * PAGE - 8
    assert allocator.num_free_pages == free_before
    allocator.check()


def test_abort_close_and_waiting_free_every_page(model):
    kv, allocator = dense_pool(model, 32)
    free_before = allocator.num_free_pages
    gen = Generator(model, kv, allocator, max_running=2)
    for r, ids in enumerate(prompts(model.config.vocab_size, (3, 4, 9, 6))):
        pages, first = prefill(model, kv, allocator, ids)
        assert gen.add(r, ids, pages, first, SamplingParams(max_new_tokens=30)) is None
    assert (gen.num_running, gen.num_waiting) == (2, 2)
    assert {o.key for o in gen.step()} == {0, 1}
    for _ in range(3):
        gen.step()  # sequence 0 crosses into a page the generator allocated
    assert gen.abort(0) and not gen.abort(0) and not gen.abort("nobody")
    assert gen.abort(3)  # a waiting one
    assert {o.key for o in gen.step()} == {1, 2}  # 2 joined when 0 left
    assert gen.num_waiting == 0
    gen.close()
    assert gen.num_running == 0 and gen.step() == []
    assert allocator.num_free_pages == free_before
    allocator.check()


def test_bad_input_is_refused_and_takes_nothing(model):
    kv, allocator = dense_pool(model, 8)
    gen = Generator(model, kv, allocator)
    ids = prompts(model.config.vocab_size, (9,))[0]
    pages, first = prefill(model, kv, allocator, ids)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="need 3 pages"):
        gen.add("a", ids, pages[:2], first, params)
    with pytest.raises(ValueError, match="free page"):
        gen.add("a", ids, torch.tensor([7, 6, 5]), first, params)
    with pytest.raises(ValueError, match="empty"):
        gen.add("a", [], pages, first, params)
    with pytest.raises(ValueError, match="vocabulary"):
        gen.add("a", ids, pages, model.config.vocab_size, params)
    assert gen.add("a", ids, pages, first, params) is None
    more, _ = prefill(model, kv, allocator, ids[:2])
    with pytest.raises(ValueError, match="already generating"):
        gen.add("a", ids[:2], more, first, params)
    allocator.free(more * PAGE)
    gen.close()
    assert allocator.num_free_pages == allocator.num_pages
    with pytest.raises(ValueError, match="layers"):
        Generator(model, KVCache(3, 8 * PAGE, 2, 16), allocator)
    with pytest.raises(ValueError, match="slots"):
        Generator(model, kv, PagedTokenAllocator(9, PAGE))


# ---- sampling ---------------------------------------------------------------------------


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(model):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=80, seed=1234, max_new_tokens=14)
    ids = prompts(model.config.vocab_size, (13,), seed=5)[0]
    alone = _one(model, ids=ids, **dataclasses.asdict(seeded))

    kv, allocator = dense_pool(model, 64)
    free_before = allocator.num_free_pages
    gen = Generator(model, kv, allocator)
    others = [
        SamplingParams(temperature=0.7, seed=99, max_new_tokens=14),
        SamplingParams(temperature=1.3, min_p=0.05, max_new_tokens=20),  # unseeded
        SamplingParams(max_new_tokens=9),
    ]
    arrivals: dict[int, list[tuple]] = {}
    for r, (p, n) in enumerate(zip(others, (7, 21, 2), strict=True)):
        other_ids = prompts(model.config.vocab_size, (n,), seed=r)[0]
        pages, first = prefill(model, kv, allocator, other_ids, p)
        arrivals.setdefault(r, []).append((r, other_ids, pages, first, p))
    pages, first = prefill(model, kv, allocator, ids, seeded)
    arrivals.setdefault(2, []).append(("seeded", ids, pages, first, seeded))
    done = run(gen, arrivals)
    assert done["seeded"] == alone
    assert allocator.num_free_pages == free_before

    reseeded = dataclasses.asdict(seeded) | {"seed": 4321}
    assert _one(model, ids=ids, **reseeded)[0] != alone[0]  # the seed matters
    greedy = _one(model, ids=ids, max_new_tokens=14)[0]
    assert alone[0] != greedy  # it did sample

"""Continuous-batching generation over a paged KV pool that already holds each prompt's KV.

A sequence arrives with its prompt's KV in pages of the pool (received from a prefill) and
its first completion token (sampled by the prefill). Each `step()` runs one decode forward
for every running sequence: the input is its last token, whose KV that forward writes.

    position   0 ........ L-1 | L    L+1  ...        L: prompt length
    KV         received       | step 1 writes, step 2 writes, ...
    token      prompt         | t0   t1   ...        t0: first_token; step k samples t_k

Exact, not fast: one ragged batch of one new token per sequence through the same model and
sampler the prefill uses.

Sampling: token t_k of a sequence is drawn with the sampler's step k (the prefill draws t0
with step 0). A seeded sequence's token therefore depends only on its own logits, seed and
k, never on the rest of the batch; the logits of one row can still differ from a run alone
in the last float bits (the batch's matmuls), which only matters at a near tie. Unseeded
rows draw from torch's default generator, so they depend on what else is sampled.

Penalties (`sampling/penalty.py`): a sequence with one keeps its output's token counts
([V], the first token counted at add()) and, with a repetition penalty, its prompt's tokens
([V] bool), on the pool's device; a step stacks them into the batch's [B, V] and counts the
tokens it drew there. A batch where no sequence has a penalty builds none of it.
Logprobs: a step computes them for the sequences that ask (return_logprob) and hands them
over in each Output; the first token's are the prefill's, given to add().

A latent-attention model (DeepSeek-V3) generates from a latent pool, one row per token and
layer: a step is its one-token extend, which writes the input token's row and decompresses
every key's K and V from the rows, as a prefill chunk does.

Sliding-window layers read only keys inside their window (`model/attention.py`): the query at
position p >= L sees p - W < j <= p, inside what the prefill sends (its last window, from
`window_first_page`) and what the steps write. With a dense pool (the decode receiver's)
those layers use the same slots as the others; with an SWA pool (`KVCache` with a
`swa_buffer` and a `SwaPagedAllocator`) they use its translated slots.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

from mpprefill.memory.allocator import PagedTokenAllocator, cdiv
from mpprefill.memory.kv_cache import KVCache
from mpprefill.model import ForwardBatch
from mpprefill.sampling.info import SamplingBatchInfo
from mpprefill.sampling.logprobs import to_host
from mpprefill.sampling.params import SamplingParams
from mpprefill.sampling.penalty import TokenHistory
from mpprefill.sampling.sampler import sample_with_logprobs
from mpprefill.sampling.token_logprob import UNKNOWN, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Output:
    """What one sequence did in an add() or a step().

    A sequence's completion (SGLang's `output_ids`) is its first_token followed by the
    new_tokens of its step() Outputs; an Output from add() carries [first_token] itself.
    """

    key: Hashable
    new_tokens: list[int]
    finished: bool
    # SGLang's shape: {"type": "length", "length": n} | {"type": "stop", "matched": id} |
    # {"type": "abort", "message": "..."}; None while running.
    finish_reason: dict | None
    # One per new token where the sequence asked (return_logprob), else None.
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True, eq=False)
class _Seq:
    key: Hashable
    prompt_len: int
    pages: torch.Tensor  # int64 page ids in position order; the generator owns them
    output_ids: list[int]
    params: SamplingParams
    counts: torch.Tensor | None = None  # [V] int32 output token counts, with a penalty
    prompt_mask: torch.Tensor | None = None  # [V] bool prompt tokens, with a repetition one

    @property
    def input_position(self) -> int:
        """Position of the last token, the next forward's input (its KV is not in yet)."""
        return self.prompt_len + len(self.output_ids) - 1


class Generator:
    def __init__(
        self,
        model,
        kv: KVCache,
        allocator: PagedTokenAllocator,
        eos_token_ids: Iterable[int] = (),
        max_running: int = 64,
    ) -> None:
        """`model`: a CausalLM whose KV `kv` holds; `allocator` hands out its pages.
        At most `max_running` sequences run in a step; more wait in arrival order."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        _check_pool(model.config, kv, allocator)
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_running = max_running
        self._running: dict[Hashable, _Seq] = {}
        self._waiting: dict[Hashable, _Seq] = {}

    @property
    def num_running(self) -> int:
        """Sequences in the next step's batch (at most max_running)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences held beyond max_running; they join as running ones finish."""
        return len(self._waiting)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._running or key in self._waiting

    def add(
        self,
        key: Hashable,
        prompt_ids: list[int],
        pages: torch.Tensor,
        first_token: int,
        params: SamplingParams,
        first_logprob: TokenLogprob | None = None,
    ) -> Output | None:
        """Take over a sequence whose prompt KV (positions 0..len(prompt_ids)-1) is in
        `pages` (page ids of the allocator, in order). `first_token` is the prefill's token,
        the first of the completion, and `first_logprob` its logprob where the prefill sent
        one (a sequence that asks without it reports UNKNOWN for that token). Returns its
        finished Output when that token already ends it (no forward runs), else None: it
        joins the next step.

        From here on the generator owns the pages (and every page it allocates) and frees
        them all when the sequence finishes or is aborted. A ValueError (bad input) takes
        nothing over."""
        seq = self._new_seq(key, prompt_ids, pages, first_token, params)
        reason = self._finish_reason(seq)
        if reason is not None:
            self._free(seq)
            logprobs = [first_logprob or UNKNOWN] if params.return_logprob else None
            return Output(key, [first_token], True, reason, logprobs)
        queue = self._running if len(self._running) < self.max_running else self._waiting
        queue[key] = seq
        return None

    def step(self) -> list[Output]:
        """One decode forward for every running sequence (waiting ones join first, finished
        ones have left); one Output per sequence that produced a token or finished. A
        sequence with no free page for its next token finishes with an "abort" Output and
        no token."""
        self._admit()
        outputs = []
        batch = []
        for seq in list(self._running.values()):
            if self._reserve_slot(seq):
                batch.append(seq)
            else:
                outputs.append(self._out_of_pages(seq))
        if batch:
            outputs.extend(self._decode(batch))
        return outputs

    def abort(self, key: Hashable) -> bool:
        """Drop a sequence and free its pages; False if the key is unknown."""
        seq = self._running.pop(key, None) or self._waiting.pop(key, None)
        if seq is None:
            return False
        self._free(seq)
        return True

    def close(self) -> None:
        """Free the pages of every sequence still held."""
        for key in [*self._running, *self._waiting]:
            self.abort(key)

    # ---- one step ----------------------------------------------------------------------

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            key = next(iter(self._waiting))
            self._running[key] = self._waiting.pop(key)

    def _reserve_slot(self, seq: _Seq) -> bool:
        """Make sure the input token's position has a page; False when none is free."""
        if seq.input_position // self.page_size < len(seq.pages):
            return True
        page = self.allocator.alloc_pages(1)
        if page is None:
            return False
        seq.pages = torch.cat([seq.pages, page])
        return True

    def _decode(self, batch: list[_Seq]) -> list[Output]:
        fb = self._forward_batch(batch)
        logits = self.model(fb.to(self.kv.device), self.kv)
        params = [s.params for s in batch]
        info = SamplingBatchInfo.from_params(params, logits.shape[-1])
        steps = torch.tensor([len(s.output_ids) for s in batch], dtype=torch.int64)
        device = logits.device
        history = self._history(batch) if info.has_penalties else None
        sampled = sample_with_logprobs(logits, info.to(device), steps.to(device), None, history)
        if history is not None:
            self._count(batch, history.output_counts, sampled.tokens)
        tokens = sampled.tokens.tolist()
        logprobs = to_host(sampled.logprobs, params)
        return [self._advance(*out) for out in zip(batch, tokens, logprobs, strict=True)]

    def _history(self, batch: list[_Seq]) -> TokenHistory:
        """The batch's [B, V] output counts and, where a sequence has a repetition
        penalty, prompt masks (zero rows for sequences without)."""
        device = self.kv.device
        vocab = self.model.config.vocab_size
        counts = torch.zeros(len(batch), vocab, dtype=torch.int32, device=device)
        rows = [i for i, s in enumerate(batch) if s.counts is not None]
        if rows:
            counts[rows] = torch.stack([batch[i].counts for i in rows])
        rows = [i for i, s in enumerate(batch) if s.prompt_mask is not None]
        if not rows:
            return TokenHistory(counts, None)
        mask = torch.zeros(len(batch), vocab, dtype=torch.bool, device=device)
        mask[rows] = torch.stack([batch[i].prompt_mask for i in rows])
        return TokenHistory(counts, mask)

    @staticmethod
    def _count(batch: list[_Seq], counts: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each drawn token in its row; each sequence with counts keeps its row."""
        counts[torch.arange(len(batch), device=counts.device), tokens] += 1
        for seq, row in zip(batch, counts.unbind(0), strict=True):
            if seq.counts is not None:
                seq.counts = row

    def _forward_batch(self, batch: list[_Seq]) -> ForwardBatch:
        slots = [self.allocator.slots_of(s.pages)[: s.input_position + 1].tolist() for s in batch]
        fb = ForwardBatch.build(
            [[s.output_ids[-1]] for s in batch], [s.input_position for s in batch], slots
        )
        if self.allocator.has_swa_pool:
            fb.swa_out_cache_loc = self.allocator.swa_slots(fb.out_cache_loc)
            fb.swa_kv_indices = self.allocator.swa_slots(fb.kv_indices, missing=-1)
        return fb

    def _advance(self, seq: _Seq, token: int, logprob: TokenLogprob | None) -> Output:
        seq.output_ids.append(token)
        reason = self._finish_reason(seq)
        if reason is not None:
            del self._running[seq.key]
            self._free(seq)
        logprobs = None if logprob is None else [logprob]
        return Output(seq.key, [token], reason is not None, reason, logprobs)

    def _out_of_pages(self, seq: _Seq) -> Output:
        del self._running[seq.key]
        self._free(seq)
        message = (
            f"out of KV pages: no free page for position {seq.input_position} "
            f"({self.allocator.num_free_pages} of {self.allocator.num_pages} free)"
        )
        logger.warning("sequence %r aborted: %s", seq.key, message)
        return Output(seq.key, [], True, {"type": "abort", "message": message})

    # ---- sequences -----------------------------------------------------------------------

    def _finish_reason(self, seq: _Seq) -> dict | None:
        """SGLang's order: the length limit first, then a stop token (part of the output);
        `ignore_eos` turns off the stop tokens and EOS alike, as it does in SGLang."""
        p = seq.params
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        last = seq.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos_token_ids):
            return {"type": "stop", "matched": last}
        return None

    def _new_seq(
        self, key, prompt_ids: list[int], pages, first_token: int, params: SamplingParams
    ) -> _Seq:
        if key in self:
            raise ValueError(f"sequence {key!r} is already generating")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_ids)
        if n < 1:
            raise ValueError("prompt_ids is empty")
        vocab = self.model.config.vocab_size
        if not 0 <= int(first_token) < vocab:
            raise ValueError(f"first_token {first_token} is outside the vocabulary ({vocab})")
        pages = torch.as_tensor(pages, dtype=torch.int64).flatten().cpu().clone()
        self._check_pages(pages, n)
        seq = _Seq(key, n, pages, [int(first_token)], params)
        if params.has_penalties:
            seq.counts = self._occurrences([int(first_token)], torch.int32)
        if params.repetition_penalty != 1.0:
            seq.prompt_mask = self._occurrences(prompt_ids, torch.bool)
        return seq

    def _occurrences(self, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        """[V] on the pool's device: 1 (True) at each token of `ids`."""
        vocab = self.model.config.vocab_size
        index = torch.tensor(ids, dtype=torch.int64)
        if int(index.min()) < 0 or int(index.max()) >= vocab:
            raise ValueError(f"prompt_ids hold a token outside the vocabulary ({vocab})")
        out = torch.zeros(vocab, dtype=dtype)
        out[index] = 1
        return out.to(self.kv.device)

    def _check_pages(self, pages: torch.Tensor, prompt_len: int) -> None:
        need = cdiv(prompt_len, self.page_size)
        if len(pages) < need:
            raise ValueError(f"{prompt_len} prompt tokens need {need} pages, got {len(pages)}")
        if len(torch.unique(pages)) != len(pages):
            raise ValueError("pages repeat a page")
        if int(pages.min()) < 0 or int(pages.max()) >= self.allocator.num_pages:
            raise ValueError(f"page ids out of range 0..{self.allocator.num_pages - 1}")
        if not self.allocator.is_held(pages * self.page_size):
            raise ValueError("pages include a free page")

    def _free(self, seq: _Seq) -> None:
        self.allocator.free(seq.pages * self.page_size)


def _check_pool(config, kv: KVCache, allocator: PagedTokenAllocator) -> None:
    """The pool must be the model's (latent for a latent model), large enough for the
    allocator, SWA pools paired."""
    if kv.latent != config.is_latent:
        want = "a latent" if config.is_latent else "a K/V"
        raise ValueError(f"the model needs {want} KV pool")
    layers, heads, dim = KVCache.model_dims(config)
    if (kv.num_layers, *kv.buffer.shape[3:]) != (layers, heads, dim):
        raise ValueError(
            f"KV pool is {kv.num_layers} layers x {tuple(kv.buffer.shape[3:])}, "
            f"the model needs {layers} x {(heads, dim)}"
        )
    if allocator.size > kv.num_slots:
        raise ValueError(f"allocator has {allocator.size} slots, the pool {kv.num_slots}")
    if (kv.swa_buffer is not None) != allocator.has_swa_pool:
        raise ValueError("a KV pool with an SWA pool needs an SWA allocator, and only it")
    if kv.swa_buffer is not None:
        if kv.swa_layers != KVCache.swa_layers_of(config):
            raise ValueError(f"SWA pool layers {kv.swa_layers} are not the model's")
        if allocator.swa_size > kv.num_swa_slots:
            raise ValueError(f"SWA allocator has {allocator.swa_size} slots, the pool fewer")
